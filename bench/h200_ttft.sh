#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23
# item 3, where the p99 TTFT goes. `kvrelay bench serve --launch disaggregated unified --sweep --sweep-rates
# 12 16 20` starts kvrelay serve on the Llama-3-8B shape with dummy weights, disaggregated (the default
# --gpu-share) and then unified, and loads each at 12, 16 and 20 Poisson req/s, 1,024 -> 128, judged against
# p99 TTFT <= 300 ms and p99 ITL <= 25 ms. Under each trial's row: the server's TTFT split into stages
# (gateway, redis, prefill_wait, prefill_step, worker_send, return; gateway/ttft_stages.py), p50 / p99 / mean of each, the
# mean of each over the slowest >= 5% of requests, and the gateway's mean TTFT beside the stages' sum.
# Results in $OUT: gpu.txt, ttft.{txt,json}, serve-{disaggregated,unified}.log. REQUESTS per trial (default
# 200), RATES, LIMIT_S (the whole bench, default 480), EXTRA (more engine flags, e.g. "--gpu-share mps").
set -u
. bench/h200_setup.sh || exit 1
ENGINE=${ENGINE:-"--model dummy:llama-3-8b --load-format dummy --max-model-len 2048 --max-num-seqs 128"}
start=$(date +%s)
# SIGINT, so bench serve's own clean-up stops its server (and serve its workers) when the limit comes
timeout -s INT -k 30 "${LIMIT_S:-480}" python3 -m kvrelay.cli --log-level WARNING bench serve \
  --launch disaggregated unified --sweep --sweep-rates ${RATES:-12 16 20} --input-len 1024 --output-len 128 \
  --sweep-requests "${REQUESTS:-200}" --json "$OUT/ttft.json" -- $ENGINE ${EXTRA:-} > "$OUT/ttft.txt" 2>&1
echo "== rc $?, $(( $(date +%s) - start )) s"
grep -vE "^launched|^goodput sweep" "$OUT/ttft.txt" | tail -60
log_dir=$(ls -td /tmp/kvrelay-bench-serve-*/ 2> /dev/null | head -1)
for mode in disaggregated unified; do
  [ -f "${log_dir}serve-$mode.log" ] && cp "${log_dir}serve-$mode.log" "$OUT/serve-$mode.log"
done
