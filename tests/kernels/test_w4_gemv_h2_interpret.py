"""The half2 decode GEMV (kernels/triton/w4_gemv_h2.py) on the host: the fp16 bits its PTX relies on, its place in
kernels/triton/w4_decode.py's table, what its wrapper runs off CUDA (w4_gemv's atomic GEMV), and the kernel itself
through Triton's interpreter with its PTX emulated (tests/kernels/ptx_emulation.py) against dequantize-then-matmul:
its indexing, halves, act-order gathers, bias and split K. tests/gpu/test_w4_gemv_h2_gpu.py runs the real PTX.
"""

import pytest
import torch

from tests.kernels.interpreted import interpret_triton_kernels

interpret_triton_kernels("tests/gpu/test_w4_gemv_h2_gpu.py")
from kvrelay.kernels.triton import w4_decode, w4_gemv, w4_gemv_h2  # noqa: E402
from tests.kernels.ptx_emulation import emulated_ptx  # noqa: E402
from tests.kernels.quant_cases import check_w4_packed, w4_case  # noqa: E402


def fp16(bits: torch.Tensor) -> torch.Tensor:
    """int32 lanes (0..0xFFFF) -> their fp16 values, as float32."""
    return bits.to(torch.int16).view(torch.float16).float()


def test_each_nibble_pair_and_zero_point_gives_q_minus_z_exactly():
    # every nibble value in every position against every zero point: the lanes the LOP3s form, then the
    # subtraction of 1024 + z (nibbles at the lane's low end) or the FMA by 1/16 with -(64 + z) (nibbles in place)
    q = torch.arange(16, dtype=torch.int64)
    words = sum(q.roll(j) << 4 * j for j in range(8))  # nibble j of word i: (i - j) % 16; as uint32 values
    z = torch.arange(16, dtype=torch.float32)[:, None]
    # the column's pairs as the kernel rounds them to fp16: exact
    assert torch.equal((z + 1024).half().float(), z + 1024) and torch.equal((-64 - z).half().float(), -64 - z)
    sixteenth = fp16(torch.tensor(w4_gemv_h2.SIXTEENTH & 0xFFFF))
    assert fp16(torch.tensor(w4_gemv_h2.SIXTEENTH >> 16)) == sixteenth == 1 / 16
    for i in range(4):
        lanes = ((words >> (8 if i >= 2 else 0)) & (w4_gemv_h2.HIGH if i % 2 else w4_gemv_h2.LOW)) | w4_gemv_h2.MAGIC
        for lane, j in ((lanes & 0xFFFF, i), (lanes >> 16, i + 4)):
            nibble = q.roll(j).float()
            assert torch.equal(fp16(lane), 1024 + (16 * nibble if i % 2 else nibble))
            if i % 2:  # exact operands and an exact result: the FMA's one rounding changes nothing
                diff = (fp16(lane).double() * sixteenth.double() - 64 - z.double()).half().float()
            else:
                diff = (fp16(lane) - (z + 1024)).half().float()
            assert torch.equal(diff, nibble - z)


def test_the_table_names_it():
    assert w4_decode.DECODE_KERNELS["w4_gemv_h2"] is w4_gemv_h2.w4_gemv_h2_linear
    baseline = w4_decode.DECODE_KERNELS["w4_gemv_h2_3launch"]
    assert baseline.func is w4_gemv_h2.w4_gemv_h2_linear and baseline.keywords == {"in_launch": False}


@pytest.mark.parametrize("rows", [1, 3])
def test_off_cuda_it_runs_w4_gemvs_atomic_gemv(rows, monkeypatch):
    from kvrelay.kernels import quant
    from kvrelay.kernels.w4_repack import repack_w4

    def refuse(*args, **kwargs):
        raise AssertionError("the half2 kernel launched")

    monkeypatch.setattr(w4_gemv_h2, "launch", refuse)
    q, zeros, scales, _, x, b = w4_case(rows, 256, 40, 64, torch.bfloat16, False, True)
    p = repack_w4(quant.pack_w4(q), zeros, scales, 64)
    cfg = (16, 4, 2, 1, 1)
    assert torch.equal(w4_gemv_h2.w4_gemv_h2_linear(x, p, b, cfg=cfg), w4_gemv.w4_gemv_linear(x, p, b, atomic=True, cfg=cfg))


# check_w4_packed's stand-in module: the half2 kernel itself (``launch``), past the wrapper's fallback on the host
H2 = type("H2", (), {"w4_packed_linear": staticmethod(lambda x, p, bias=None, cfg=None: w4_gemv_h2.launch(x, p, bias, cfg))})


@pytest.mark.parametrize("source, n, group, dtype, cfg", [
    ("awq", 48, 32, torch.bfloat16, (16, 4, 1, 1, 1)),  # one split: the bias in the kernel; tiles dividing N
    ("gptq_act_order", 40, 64, torch.bfloat16, (16, 8, 1, 1, 1)),
    ("gptq", 40, 128, torch.float16, (32, 16, 2, 1, 1)),  # split K by atomics, the bias added after
    ("gptq_act_order", 48, 128, torch.float16, (16, 2, 3, 1, 1)),  # halves of one packed row; the last split short
    ("w4_act_order", 37, 64, torch.bfloat16, (16, 4, 2, 1, 1)),  # the last tile's words past N never stored
])
def test_the_kernel_with_its_ptx_emulated(source, n, group, dtype, cfg):
    with emulated_ptx():
        check_w4_packed(H2, "cpu", 1, 256, n, group, dtype, source, bias=True, cfg=cfg)


@pytest.mark.parametrize("cfg", [(32, 8, 2, 1, 1), (16, 4, 3, 1, 1)])
def test_the_sum_after_the_launch_the_baseline_entry_runs(cfg):
    # w4_decode's w4_gemv_h2_3launch: splits into a zeroed fp32 output, the bias and the cast after
    three = type("H2", (), {"w4_packed_linear": staticmethod(
        lambda x, p, bias=None, cfg=None: w4_gemv_h2.launch(x, p, bias, cfg, in_launch=False))})
    with emulated_ptx():
        check_w4_packed(three, "cpu", 1, 256, 40, 64, torch.bfloat16, "awq", bias=True, cfg=cfg)


def test_an_odd_chunk_and_more_rows_are_refused():
    with pytest.raises(ValueError, match="odd"):
        check_w4_packed(H2, "cpu", 1, 128, 40, 64, torch.bfloat16, "awq", cfg=(16, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="one row"):
        check_w4_packed(H2, "cpu", 2, 128, 40, 64, torch.bfloat16, "awq", cfg=(16, 4, 1, 1, 1))


def test_split_sums_leave_the_scratch_zeroed_for_the_next_launch():
    # the last split of each tile writes the output and zeroes what the splits added into: the next launch, at the
    # same N (the same scratch) but other weights, inputs and bias, starts from zero. A scratch left dirty would
    # add the first launch's sums into the second's output.
    from kvrelay.kernels import quant
    from kvrelay.kernels.triton import split_arrival
    from kvrelay.kernels.w4_repack import repack_w4

    cfg = (16, 4, 4, 1, 1)  # 3 column tiles (the last ragged), 4 splits
    with emulated_ptx():
        for seed_rows in (1, 2):
            q, zeros, scales, _, x, b = w4_case(seed_rows, 256, 40, 64, torch.bfloat16, False, True)
            x = x[-1:]
            p = repack_w4(quant.pack_w4(q), zeros, scales, 64)
            got = w4_gemv_h2.launch(x, p, b, cfg)
            expected = quant.w4a16_linear(x.float(), quant.pack_w4(q), zeros, scales, 64, None, b.float())
            torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
            sums, counters = split_arrival.scratch(x.device, 40, 3)
            assert not sums.any() and not counters.any()


def test_one_split_writes_the_output_without_the_scratch():
    from kvrelay.kernels import quant
    from kvrelay.kernels.triton import split_arrival
    from kvrelay.kernels.w4_repack import repack_w4

    before = set(split_arrival._scratch)
    q, zeros, scales, _, x, b = w4_case(1, 128, 24, 64, torch.bfloat16, False, True)
    with emulated_ptx():
        w4_gemv_h2.launch(x, repack_w4(quant.pack_w4(q), zeros, scales, 64), b, (16, 4, 1, 1, 1))
    assert set(split_arrival._scratch) == before
