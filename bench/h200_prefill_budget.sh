#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23
# item 3, unified mode's inter-token latency under each prompt-token budget while requests decode. RUNS (default
# "cap512 target20 cap0 cap256") names one server each: capN = --max-prefill-tokens-with-decodes N (0 = no cap,
# the old behaviour; 512 the default), targetM = the default cap 512 with --target-step-ms M (the cap each step
# follows from the engine's fit of its own step times), pwN = capN with --cudagraph-mode FULL_AND_PIECEWISE (steps
# holding prompt tokens replay captured pieces around eager attention; the default mode), fdN = capN with
# FULL_DECODE_ONLY (those steps launched eagerly). Today's default and the target come first, so they are
# measured even if the call runs short: a run whose server would start past START_BY (default 420) s is skipped
# and said so. Each server, unified `kvrelay serve` on the Llama-3-8B shape with dummy weights, takes Poisson
# arrivals of 1,024 -> 128 at each rate in RATES (default "8 16 24" req/s, 200 requests each, ~200 / r s a run)
# through `kvrelay bench serve`: the load of the issue's table.
# Results land in $OUT: gpu.txt (device, date), <run>-<rate>.txt (vLLM-style tables), <run>-<rate>.json (every
# request), serve-<run>.log, <run>-<rate>.metrics (the worker's step-cost fit and cap gauges, its step counts and
# histograms of step time by kind and of prompt tokens per step with decodes, and its ITL histogram, cumulative over
# the server's rates so far), <run>-<rate>.steps (bench/step_metrics.py: what that rate added, per step kind), and
# summary.txt (a line per run: TTFT p50 p99, ITL p50 p99 in ms, then the rate's .steps lines). With STEP_KINDS=1 the
# call first runs bench/step_kinds.py (each step kind timed alone on one engine, up to STEP_KINDS_S, default 150 s)
# into step_kinds.txt; the servers' START_BY still counts from the call's start.
set -u
. bench/h200_setup.sh || exit 1
if [ "${STEP_KINDS:-0}" = 1 ]; then  # first, on an idle GPU: what each step kind costs alone
  timeout "${STEP_KINDS_S:-150}" python3 -m kvrelay.bench.step_kinds > "$OUT/step_kinds.txt" 2>&1
  echo "step_kinds rc $?"; tail -12 "$OUT/step_kinds.txt"
fi
for run in ${RUNS:-cap512 target20 cap0 cap256}; do
  case $run in
    cap*) flags=(--max-prefill-tokens-with-decodes "${run#cap}") ;;
    target*) flags=(--max-prefill-tokens-with-decodes 512 --target-step-ms "${run#target}") ;;
    pw*) flags=(--max-prefill-tokens-with-decodes "${run#pw}" --cudagraph-mode FULL_AND_PIECEWISE) ;;
    fd*) flags=(--max-prefill-tokens-with-decodes "${run#fd}" --cudagraph-mode FULL_DECODE_ONLY) ;;
    *) echo "unknown run $run (capN, targetM, pwN or fdN)" | tee -a "$OUT/summary.txt"; continue ;;
  esac
  if [ "$SECONDS" -gt "${START_BY:-420}" ]; then
    echo "$run skipped: ${SECONDS}s into the call" | tee -a "$OUT/summary.txt"; continue
  fi
  python3 -m kvrelay.cli serve --mode unified --port 8011 --worker-monitoring-port 9311 --model dummy:llama-3-8b \
    --load-format dummy --max-model-len 2048 --max-num-seqs 128 "${flags[@]}" > "$OUT/serve-$run.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do kill -0 "$server" 2> /dev/null || break; python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/ready')" 2> /dev/null && break; sleep 1; done
  before=""
  for rate in ${RATES:-8 16 24}; do
    timeout 120 python3 -m kvrelay.cli --log-level WARNING bench serve --base-url http://127.0.0.1:8011/v1 \
      --input-len 1024 --output-len 128 --num-prompts 200 --request-rate "$rate" --cold-cache \
      --json "$OUT/$run-$rate.json" > "$OUT/$run-$rate.txt" 2>&1
    echo "$run rate $rate rc $? TTFT/ITL p50 p99 (ms): $(grep -E '^(Median|P99) (TTFT|ITL) \(ms\)' \
      "$OUT/$run-$rate.txt" | awk '{print $NF}' | xargs)" | tee -a "$OUT/summary.txt"
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9311/metrics').read().decode())" \
      2> /dev/null | grep -E '^(kvrelay_(prefill_tokens_cap|step_cost|engine_step)|vllm:inter_token_latency)' \
      > "$OUT/$run-$rate.metrics"
    python3 -m kvrelay.bench.step_metrics "$OUT/$run-$rate.metrics" $before > "$OUT/$run-$rate.steps" 2>&1
    sed 's/^/    /' "$OUT/$run-$rate.steps" | tee -a "$OUT/summary.txt"
    before="$OUT/$run-$rate.metrics"
  done
  kill "$server"; wait "$server"
done
