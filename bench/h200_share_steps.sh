#!/bin/bash
# One device call (`run` tool, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23 item 3, how the
# prefill and decode processes sharing one GPU split its time, at fixed rates, with both workers' step times.
# RUNS (default "timeslice mps-priority_100_100 mps-priority_75_100") names one server each: a --gpu-share mode,
# optionally with SM shares MODE_P_D (--gpu-sm-percent P for prefill, --decode-gpu-sm-percent D), or "whole"
# (timeslice with --no-kv-stream-layers: each prompt's KV leaves after its prefill, not layer by layer during it).
# Each server (`kvrelay serve --mode disaggregated`, Llama-3-8B shape, dummy weights) takes Poisson arrivals of
# 1,024 -> 128 at each rate in RATES (default "15 18 21" req/s, REQUESTS = 150 each) through `kvrelay bench serve`
# (the SLO: p99 TTFT <= 300 ms, p99 ITL <= 25 ms). After each rate both workers' /metrics are scraped and what the
# rate added to their step times printed (bench/step_metrics.py). bench/h200_gpu_share.sh searches each mode's
# highest rate instead. A run that would start past START_BY (default 420) s is skipped and said so. Last, with
# OFFLINE=1 (the default), the offline engine takes the same 150 prompts all at once (`bench serve --offline-only`):
# its req/s is the capacity each rate is a fraction of.
# Results land in $OUT: gpu.txt, <run>-<rate>.txt (vLLM-style tables), serve-<run>.log, offline.txt, summary.txt
# (a line per rate: TTFT p50 p99, ITL p50 p99 in ms, then the step lines; the offline engine's req/s).
set -u
. bench/h200_setup.sh || exit 1
work=/tmp/share-steps; mkdir -p "$work"  # the scrapes and per-request JSON: the device returns only so many files
engine=(--model "${MODEL:-dummy:llama-3-8b}" --load-format dummy --max-model-len 2048 --max-num-seqs 128)
scrape() {  # port -> the worker's step series
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$1/metrics').read().decode())" \
    2> /dev/null | grep -E '^(kvrelay_engine_step|vllm:inter_token_latency)'
}
for name in ${RUNS:-timeslice mps-priority_100_100 mps-priority_75_100}; do
  IFS=_ read -r share prefill_pct decode_pct <<< "$name"
  case $share in
    whole) flags=(--no-kv-stream-layers) ;;
    *) flags=(--gpu-share "$share") ;;
  esac
  [ -n "$prefill_pct" ] && flags+=(--gpu-sm-percent "$prefill_pct")
  [ -n "$decode_pct" ] && flags+=(--decode-gpu-sm-percent "$decode_pct")
  if [ "$SECONDS" -gt "${START_BY:-420}" ]; then echo "$name skipped: ${SECONDS}s into the call" | tee -a "$OUT/summary.txt"; continue; fi
  python3 -m kvrelay.cli serve --mode disaggregated --port 8011 --worker-monitoring-port 9311 \
    "${engine[@]}" "${flags[@]}" \
    > "$OUT/serve-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do kill -0 "$server" 2> /dev/null || break; python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/ready')" 2> /dev/null && break; sleep 1; done
  before_d=""; before_p=""
  for rate in ${RATES:-15 18 21}; do
    timeout 100 python3 -m kvrelay.cli --log-level WARNING bench serve --base-url http://127.0.0.1:8011/v1 \
      --input-len 1024 --output-len 128 --num-prompts "${REQUESTS:-150}" --request-rate "$rate" --cold-cache \
      --json "$work/$name-$rate.json" > "$OUT/$name-$rate.txt" 2>&1
    rc=$?
    scrape 9312 > "$work/$name-$rate.decode.metrics"; scrape 9311 > "$work/$name-$rate.prefill.metrics"
    echo "$name (${flags[*]}) rate $rate rc $rc TTFT/ITL p50 p99 (ms): $(grep -E '^(Median|P99) (TTFT|ITL) \(ms\)' \
      "$OUT/$name-$rate.txt" | awk '{print $NF}' | xargs)" | tee -a "$OUT/summary.txt"
    { echo "  decode:"; python3 -m kvrelay.bench.step_metrics "$work/$name-$rate.decode.metrics" $before_d
      echo "  prefill:"; python3 -m kvrelay.bench.step_metrics "$work/$name-$rate.prefill.metrics" $before_p
    } 2>&1 | grep -v "steps with decodes" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    before_d="$work/$name-$rate.decode.metrics"; before_p="$work/$name-$rate.prefill.metrics"
  done
  kill "$server"; wait "$server"
done
if [ "${OFFLINE:-1}" = 1 ]; then
  timeout "${OFFLINE_S:-150}" python3 -m kvrelay.cli --log-level WARNING bench serve --offline-only --input-len 1024 \
    --output-len 128 --num-prompts "${REQUESTS:-150}" -- "${engine[@]}" > "$OUT/offline.txt" 2>&1
  echo "offline engine, the same prompts all at once: rc $?, $(grep -m1 'Request throughput' "$OUT/offline.txt")" \
    | tee -a "$OUT/summary.txt"
fi
