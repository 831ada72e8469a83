#!/bin/bash
# One device call's first part (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), ~2.5 minutes:
# issue #23 item 3's unified target (>= 18 req/s). One unified `kvrelay serve` (Llama-3-8B shape, dummy weights,
# the default --max-prefill-tokens-with-decodes) and `kvrelay bench serve --sweep`: 1,024 -> 128, REQUESTS (150)
# per trial, from 16 req/s doubling on a pass and bisecting to RESOLUTION (2), at most TRIALS (5), never below 8.
# Results in $OUT: unified.txt, unified.json. UNIFIED_S bounds it; SERVE_ARGS adds server flags (e.g. --cudagraph-mode).
set -u
. bench/h200_setup.sh || exit 1
timeout -s INT -k 30 "${UNIFIED_S:-170}" python3 -m kvrelay.cli --log-level WARNING bench serve --launch unified --sweep \
  --input-len 1024 --output-len 128 --sweep-requests "${REQUESTS:-150}" --sweep-start 16 \
  --sweep-resolution "${RESOLUTION:-2}" --sweep-min-rate 8 --sweep-max-trials "${TRIALS:-5}" --json "$OUT/unified.json" \
  -- --model dummy:llama-3-8b --load-format dummy --max-model-len 2048 --max-num-seqs 128 ${SERVE_ARGS:-} > "$OUT/unified.txt" 2>&1
echo "unified sweep rc $?"
grep -E "^ +[0-9]+ +[0-9.]+ |highest rate|no rate met|did not become ready|error:" "$OUT/unified.txt" | tail -8
