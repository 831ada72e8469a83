#!/bin/bash
# One device call (`run` tool, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23 item 3,
# disaggregated serving with the decode loop paced while a prompt is prefilled for it (--decode-step-pace-ms,
# decode_worker/step_pace.py), and with the two processes under CUDA MPS, decode's stream above prefill's. RUNS
# (default "pace0 pace20 mps0 mps12") names one server each: paceN = --decode-step-pace-ms N under the default
# --gpu-share timeslice; mpsN = the same pace under --gpu-share mps-priority with both workers allowed every SM
# (--gpu-sm-percent 100 --decode-gpu-sm-percent 100: the priority, not a split, orders them); mpsNsP the same with
# the prefill worker held to P% of the SMs (decode keeps 100%: some SMs always free for its kernels); wholeN = paceN with
# --no-kv-stream-layers (each prompt's KV leaves after its prefill, not layer by layer during it). Each server
# (`kvrelay serve --mode disaggregated`, Llama-3-8B shape, dummy weights) takes Poisson arrivals of 1,024 -> 128 at each rate in RATES (default "15 18 21"
# req/s, REQUESTS = 150 each) through `kvrelay bench serve` (p99 TTFT <= 300 ms and p99 ITL <= 25 ms is the SLO).
# After each rate both workers' /metrics are scraped: what the rate added to the decode worker's paced seconds
# and step times by kind, and the prefill worker's step times (bench/step_metrics.py). A run that would start past
# START_BY (default 420) s is skipped and said so.
# Results land in $OUT: gpu.txt, <run>-<rate>.txt (vLLM-style tables), serve-<run>.log, summary.txt (a line per
# rate: TTFT p50 p99, ITL p50 p99 in ms, paced s, then the step lines).
set -u
. bench/h200_setup.sh || exit 1
work=/tmp/decode-pace; mkdir -p "$work"  # the scrapes and per-request JSON: the device returns only so many files
scrape() {  # port -> the worker's step, pace and ITL series
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$1/metrics').read().decode())" \
    2> /dev/null | grep -E '^(kvrelay_(engine_step|decode_paced)|vllm:inter_token_latency)'
}
for name in ${RUNS:-pace0 pace20 mps0 mps12}; do
  case $name in
    pace*) flags=(--decode-step-pace-ms "${name#pace}") ;;
    mps*s*) pace=${name#mps}; flags=(--decode-step-pace-ms "${pace%s*}" --gpu-share mps-priority
                                      --gpu-sm-percent "${name##*s}" --decode-gpu-sm-percent 100) ;;
    mps*) flags=(--decode-step-pace-ms "${name#mps}" --gpu-share mps-priority --gpu-sm-percent 100
                 --decode-gpu-sm-percent 100) ;;
    whole*) flags=(--decode-step-pace-ms "${name#whole}" --no-kv-stream-layers) ;;
    *) echo "unknown run $name (paceN, mpsN, mpsNsP or wholeN)" | tee -a "$OUT/summary.txt"; continue ;;
  esac
  if [ "$SECONDS" -gt "${START_BY:-420}" ]; then echo "$name skipped: ${SECONDS}s into the call" | tee -a "$OUT/summary.txt"; continue; fi
  python3 -m kvrelay.cli serve --mode disaggregated --port 8011 --worker-monitoring-port 9311 \
    --model ${MODEL:-dummy:llama-3-8b} --load-format dummy --max-model-len 2048 --max-num-seqs 128 "${flags[@]}" \
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
    paced=$(python3 -c "
import sys
def v(p):
    try: return sum(float(l.split()[-1]) for l in open(p) if l.startswith('kvrelay_decode_paced_seconds_total'))
    except OSError: return 0.0
print(round(v('$work/$name-$rate.decode.metrics') - v('${before_d:-/nonexistent}'), 2))")
    echo "$name rate $rate rc $rc TTFT/ITL p50 p99 (ms): $(grep -E '^(Median|P99) (TTFT|ITL) \(ms\)' \
      "$OUT/$name-$rate.txt" | awk '{print $NF}' | xargs); paced ${paced} s" | tee -a "$OUT/summary.txt"
    { echo "  decode:"; python3 -m kvrelay.bench.step_metrics "$work/$name-$rate.decode.metrics" $before_d
      echo "  prefill:"; python3 -m kvrelay.bench.step_metrics "$work/$name-$rate.prefill.metrics" $before_p
    } 2>&1 | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    before_d="$work/$name-$rate.decode.metrics"; before_p="$work/$name-$rate.prefill.metrics"
  done
  kill "$server"; wait "$server"
done
