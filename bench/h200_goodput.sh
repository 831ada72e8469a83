#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23
# item 3's goodput. `kvrelay bench serve --sweep` launches each mode in turn (disaggregated, then unified) on
# the Llama-3-8B shape with dummy weights, finds on that one running server the highest Poisson rate at which
# p99 TTFT <= 300 ms and p99 ITL <= 25 ms hold for 1,024 -> 128 (200 requests per trial), then runs the offline
# engine on the same prompts for its req/s; each found rate prints as a fraction of it.
# Search: from 8 req/s, doubling until a trial fails, bisecting to 1 req/s, at most 8 trials per mode; a mode
# that fails at 8 is tried once more at 4 and no lower (a trial at rate r lasts 200 / r seconds).
# Results land in $OUT: gpu.txt (device, date), goodput.txt (the tables), goodput.json (every trial),
# serve-<mode>.log (each server's log). SWEEP_ARGS adds flags (e.g. --slo-itl-ms 30); SWEEP_S bounds the sweep.
set -u
. bench/h200_setup.sh || exit 1
timeout "${SWEEP_S:-480}" python3 -m kvrelay.cli --log-level WARNING bench serve --launch disaggregated unified \
  --sweep --compare-offline --input-len 1024 --output-len 128 --sweep-requests 200 \
  --sweep-start 8 --sweep-min-rate 4 --sweep-resolution 1 --sweep-max-trials 8 ${SWEEP_ARGS:-} \
  --json "$OUT/goodput.json" -- --model dummy:llama-3-8b --load-format dummy --max-model-len 2048 --max-num-seqs 128 \
  > "$OUT/goodput.txt" 2>&1
echo "sweep rc $?"
grep -v "^Loading\|^Writing" "$OUT/goodput.txt" | tail -60
# launched() keeps each server's log in a fresh temporary folder: the last sweep's are the newest
for log in $(ls -td /tmp/kvrelay-bench-serve-*/ 2> /dev/null | head -1)serve-*.log; do
  [ -f "$log" ] && cp "$log" "$OUT/"
done
