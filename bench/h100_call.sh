#!/bin/bash
# One device call for fp8 fast accumulation (issue #27; branch fp8-fast-accum): bench/fp8_accum_probe.py's kernel
# and model checks, then bf16 / fp8 prefill with exact and fast sums. bf16 goes first: the first model process on
# a freshly started machine has run a prefill at half speed (BENCHMARKS.md, 2026-12-07 10:39).
# The suite and `bench gpu` (the offline engine's step budget) are bench/h200_suite.sh's call.
. bench/h200_setup.sh || exit 1
timeout "${PROBE_S:-240}" python3 -m kvrelay.bench.fp8_accum_probe > "$OUT/probe.txt" 2>&1
echo "probe rc $?"; grep '^|\|prompts of\|torch' "$OUT/probe.txt" | cut -c1-250
if [ -n "${FP8_VARIANTS:-}" ]; then  # e.g. bf16,fp8@exact_accum,fp8 on the branch
  timeout "${FP8_S:-240}" python3 -m kvrelay.cli bench quant --variants "$FP8_VARIANTS" --prompts 32 --len 4096 \
    > "$OUT/fp8.txt" 2>&1
  echo "fp8 rc $?"; tail -6 "$OUT/fp8.txt"
fi
date -u
