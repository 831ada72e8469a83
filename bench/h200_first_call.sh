#!/bin/bash
# A device call that may get either card. On an H200 (>= 100 GiB) the pool density run (issue #26, which needs
# its memory). Otherwise the SECTIONS asked for (default "quant handoff"):
#   quant:   `bench quant` of AWQ (issue #27), AWQ_VARIANTS (default: the half2 GEMV with its split sums after the
#            launch, then in it: kernels/triton/w4_decode.py), ~3 min;
#   fp8:     the fp8 one-row skinny loop's tile sweep (bench/quant_kernels.py), the fp8 batch-1 step's kernels
#            (bench/step_timeline.py) and `bench quant` of FP8_VARIANTS (default bf16,fp8), ~6 min;
#   tests:   `pytest -m gpu` of GPU_TESTS (default tests/gpu/test_w4_gemv_h2_gpu.py), at most 150 s;
#   gemm:    the prefill GEMMs alone at GEMM_ROWS (default 4,096 and 16,384) rows (bench/quant_kernels.py): cuBLASLt's fp8 with row-wise
#            scales against scalar ones (what row-wise costs), bf16 weights as [N, K] and as [K, N], ~1 min;
#   sweep:   the one-row W4 GEMVs' tile sweep (SWEEP_FORMATS, default w4_gemv_atomic,w4_gemv_h2) (bench/quant_kernels.py; at most SWEEP_S, default 150 s);
#   fp8gemm: kernels/triton/fp8_gemm.py (issue #27's fp8 prefill): its GPU test, its configs (and on bf16, against cuBLAS) against cuBLASLt's row-wise
#            and scalar-scale GEMMs at GEMM_ROWS, then `bench quant --variants FP8_GEMM_VARIANTS` (default
#            fp8,fp8@triton,bf16: the model's prefill with each GEMM, bf16 as the 1.5x target's base; FP8_GEMM_ARGS=--throughput
#            adds 128 x (32 -> 2,048)), ~6 min;
#   handoff: the handoff trace (issue #23 item 4; TRACE_TOKENS, TRACE_S) and, unless HANDOFF=0, `bench handoff
#            --sections cuda` on the same sizes, so the trace sits beside the table it explains (~3 min).
. bench/h200_setup.sh || exit 1
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -ge 100000 ] && [ -z "${NO_POOL:-}" ]; then
  timeout 570 python3 -m kvrelay.cli bench pool --model dummy:llama-3-8b --load-format dummy --num-models 8 \
    --max-model-len 2048 --min-kv-seqs 16 --num-requests 320 --request-rate 8 --input-len 512 --output-len 128 \
    > "$OUT/pool.txt" 2>&1
  echo "pool rc $?"; tail -60 "$OUT/pool.txt"
  exit 0
fi
for section in ${SECTIONS:-quant handoff}; do
  case $section in
  handoff)
    timeout "${TRACE_S:-150}" python3 -m kvrelay.bench.handoff_trace --device cuda --tokens ${TRACE_TOKENS:-8,256,2048} \
      --repeats 20 > "$OUT/trace.txt" 2>&1
    echo "trace rc $?"; grep -v "^$" "$OUT/trace.txt" | tail -80
    [ "${HANDOFF:-1}" = 1 ] || continue
    timeout 150 python3 -m kvrelay.bench.handoff --sections cuda --tokens 256,2048 --repeats 5 > "$OUT/handoff.txt" 2>&1
    echo "handoff rc $?"; grep -v "^$" "$OUT/handoff.txt" | tail -45 ;;
  quant)
    timeout 240 python3 -m kvrelay.cli bench quant --variants ${AWQ_VARIANTS:-awq@w4_gemv_h2_3launch,awq} --prompts 2 \
      --len 1024 > "$OUT/quant.txt" 2>&1
    echo "quant rc $?"; tail -6 "$OUT/quant.txt" ;;
  fp8)
    timeout "${FP8_SWEEP_S:-240}" python3 -m kvrelay.bench.quant_kernels --rows 1 --formats fp8_sk \
      --json "$OUT/fp8_sk.json" > "$OUT/fp8_sk.txt" 2>&1
    echo "fp8 sweep rc $?"; grep '^|\|sweep\|copy' "$OUT/fp8_sk.txt" | cut -c1-300 | tail -12
    timeout 120 python3 -m kvrelay.bench.step_timeline --quantization fp8 --prefill '' > "$OUT/fp8_timeline.txt" 2>&1
    echo "fp8 timeline rc $?"; tail -30 "$OUT/fp8_timeline.txt"
    timeout 200 python3 -m kvrelay.cli bench quant --variants ${FP8_VARIANTS:-bf16,fp8} --prompts 2 --len 1024 \
      > "$OUT/fp8_quant.txt" 2>&1
    echo "fp8 quant rc $?"; tail -6 "$OUT/fp8_quant.txt" ;;
  tests)
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_w4_gemv_h2_gpu.py} \
      > "$OUT/gpu_tests.txt" 2>&1
    echo "tests rc $?"; tail -8 "$OUT/gpu_tests.txt" ;;
  gemm)
    timeout 150 python3 -m kvrelay.bench.quant_kernels --rows ${GEMM_ROWS:-4096,16384} --formats bf16,bf16_kn,fp8_gemm,fp8_gemm_tensor \
      --json "$OUT/gemm.json" > "$OUT/gemm.txt" 2>&1
    echo "gemm rc $?"; grep '^|' "$OUT/gemm.txt" | cut -c1-200 | tail -30 ;;
  fp8gemm)  # the model's numbers before the kernels' sweep: the call's 600 s may cut the last
    timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fp8_gemm_gpu.py > "$OUT/fp8_gemm_tests.txt" 2>&1
    echo "fp8 gemm tests rc $?"; tail -4 "$OUT/fp8_gemm_tests.txt"
    timeout 270 python3 -m kvrelay.cli bench quant --variants ${FP8_GEMM_VARIANTS:-fp8,fp8@triton,bf16} --prompts 32 \
      --len 4096 ${FP8_GEMM_ARGS:-} > "$OUT/fp8_gemm_quant.txt" 2>&1
    echo "fp8 gemm quant rc $?"; tail -8 "$OUT/fp8_gemm_quant.txt"
    timeout 180 python3 -m kvrelay.bench.quant_kernels --rows ${GEMM_ROWS:-4096,16384} --formats bf16,bf16_triton,fp8_gemm,fp8_gemm_tensor,fp8_triton \
      --json "$OUT/fp8_gemm.json" > "$OUT/fp8_gemm.txt" 2>&1
    echo "fp8 gemm rc $?"; grep '^|\|refused\|wrong' "$OUT/fp8_gemm.txt" | cut -c1-220 | tail -50 ;;
  sweep)
    timeout "${SWEEP_S:-150}" python3 -m kvrelay.bench.quant_kernels --rows 1 --formats ${SWEEP_FORMATS:-w4_gemv_atomic,w4_gemv_h2} \
      --json "$OUT/quant_kernels.json" > "$OUT/quant_kernels.txt" 2>&1
    echo "sweep rc $?"; grep '^|\|sweep\|copy\|"fmt"' "$OUT/quant_kernels.txt" | cut -c1-400 | tail -24 ;;
  esac
done
