#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23
# item 3, unified mode's inter-token latency with and without --max-prefill-tokens-with-decodes. For each cap
# in CAPS (default "0 512 256"; 0 = no cap, the old behaviour) one unified `kvrelay serve` on the Llama-3-8B
# shape with dummy weights takes Poisson arrivals of 1,024 -> 128 at each rate in RATES (default "8 16 24"
# req/s, 200 requests each, ~200 / r s a run): the load of the issue's table, through `kvrelay bench serve`.
# Results land in $OUT: gpu.txt (device, date), cap<N>-<rate>.txt (vLLM-style tables), cap<N>-<rate>.json
# (every request), serve-cap<N>.log, and summary.txt (a line per run: TTFT p50 p99, ITL p50 p99 in ms).
set -u
. bench/h200_setup.sh || exit 1
for cap in ${CAPS:-0 512 256}; do
  python3 -m kvrelay.cli serve --mode unified --port 8011 --model dummy:llama-3-8b --load-format dummy \
    --max-model-len 2048 --max-num-seqs 128 --max-prefill-tokens-with-decodes "$cap" > "$OUT/serve-cap$cap.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do kill -0 "$server" 2> /dev/null || break; python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/ready')" 2> /dev/null && break; sleep 1; done
  for rate in ${RATES:-8 16 24}; do
    timeout 120 python3 -m kvrelay.cli --log-level WARNING bench serve --base-url http://127.0.0.1:8011/v1 \
      --input-len 1024 --output-len 128 --num-prompts 200 --request-rate "$rate" --cold-cache \
      --json "$OUT/cap$cap-$rate.json" > "$OUT/cap$cap-$rate.txt" 2>&1
    echo "cap $cap rate $rate rc $? TTFT/ITL p50 p99 (ms): $(grep -E '^(Median|P99) (TTFT|ITL) \(ms\)' \
      "$OUT/cap$cap-$rate.txt" | awk '{print $NF}' | xargs)" | tee -a "$OUT/summary.txt"
  done
  kill "$server"; wait "$server"
done
