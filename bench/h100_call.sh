#!/bin/bash
# One device call for fp8 fast accumulation (issue #27): bench/fp8_accum_probe.py's kernel and model checks, then
# `bench quant` of FP8_VARIANTS (e.g. bf16,fp8) at 32 x 4,096. Run on 2026-12-07 19:09 (BENCHMARKS.md): fast
# accumulation changed greedy tokens from the first one, so exact accumulation stays the only path. List bf16
# first: the first model process on a freshly started machine has run a prefill at half speed (BENCHMARKS.md,
# 2026-12-07 10:39).
# The suite and `bench gpu` (the offline engine's step budget) are bench/h200_suite.sh's call.
. bench/h200_setup.sh || exit 1
timeout "${PROBE_S:-240}" python3 -m kvrelay.bench.fp8_accum_probe > "$OUT/probe.txt" 2>&1
echo "probe rc $?"; grep '^|\|prompts of\|torch' "$OUT/probe.txt" | cut -c1-250
if [ -n "${FP8_VARIANTS:-}" ]; then  # e.g. bf16,fp8
  timeout "${FP8_S:-240}" python3 -m kvrelay.cli bench quant --variants "$FP8_VARIANTS" --prompts 32 --len 4096 \
    > "$OUT/fp8.txt" 2>&1
  echo "fp8 rc $?"; tail -6 "$OUT/fp8.txt"
fi
date -u
