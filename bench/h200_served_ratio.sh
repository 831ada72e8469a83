#!/bin/bash
# One device call (`run` tool, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23 items 1 and 2,
# each mode served against the offline engine on the same prompts in the same call, with the server's TTFT split
# into stages under each run (Llama-3-8B shape, dummy weights). LOADS (default "short batch1") picks the runs:
# - short: 256 x (32 -> 256), 128 in flight, both modes and the offline engine (short.txt);
# - nocap: the same load on unified with --max-prefill-tokens-with-decodes 0, no prompt-token cap beside
#   decodes (nocap.txt): does the cap stagger the waves?
# - long: 256 x (1,024 -> 128), 64 in flight, both modes and the offline engine (long.txt);
# - batch1: 8 x (32 -> 256), one in flight: batch-1 TPOT served against the engine's (batch1.txt);
# - MODE@N (e.g. disaggregated@1, unified@4): the short load on MODE with --api-server-count N gateways, the
#   offline engine beside it only for N = 1 (MODE_gwN.txt): is one gateway process what holds the stream back?
# EXTRA: more engine flags for every run. Each run's table and comparison are printed; the files land in $OUT, with
# each run's serve and Redis logs in $OUT/NAME_logs.
set -u
. bench/h200_setup.sh || exit 1
engine=(--model "${MODEL:-dummy:llama-3-8b}" --load-format dummy --max-model-len 2048 --max-num-seqs 128 ${EXTRA:-})
bench() {  # name, timeout, bench serve args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" python3 -m kvrelay.cli --log-level WARNING bench serve "$@" > "$OUT/$name.txt" 2>&1
  echo "rc $?"
  grep -E "^(launched|TTFT stages|p50 |p99 |mean |gateway TTFT|slowest)|Output token throughput|Median TPOT|P99 TTFT|Client CPU" \
    "$OUT/$name.txt"
  sed -n '/Served vs offline engine/,$p' "$OUT/$name.txt"
  # each launch's serve log (its last 2 MB) and its embedded Redis's log, whose AOF lines say whether a slow
  # disk held Redis up (a stall inside the server's `gateway` or `redis` stage)
  for dir in $(grep -o "(log /tmp/kvrelay-bench-serve-[^/]*" "$OUT/$name.txt" | cut -c6- | sort -u); do
    mkdir -p "$OUT/${name}_logs"
    for log in "$dir"/serve-*.log; do [ -f "$log" ] && tail -c 2000000 "$log" > "$OUT/${name}_logs/$(basename "$log")"; done
    for log in "$dir"/state-*/redis.log; do
      [ -f "$log" ] && cp "$log" "$OUT/${name}_logs/redis-$(basename "$(dirname "$log")").log"
    done
  done
  grep -h -i "fsync\|aof\|latency" "$OUT/${name}_logs"/redis-*.log 2>/dev/null | tail -5
}
for load in ${LOADS:-short batch1}; do
  case $load in
    short) bench short 240 --launch disaggregated unified --compare-offline --num-prompts 256 --input-len 32 \
             --output-len 256 --max-concurrency 128 -- "${engine[@]}" ;;
    nocap) bench nocap 150 --launch unified --num-prompts 256 --input-len 32 --output-len 256 --max-concurrency 128 \
             -- "${engine[@]}" --max-prefill-tokens-with-decodes 0 ;;
    long) bench long 240 --launch disaggregated unified --compare-offline --num-prompts 256 --input-len 1024 \
            --output-len 128 --max-concurrency 64 -- "${engine[@]}" ;;
    batch1) bench batch1 200 --launch disaggregated unified --compare-offline --num-prompts 8 --input-len 32 \
              --output-len 256 --max-concurrency 1 -- "${engine[@]}" ;;
    *@*) mode=${load%@*} gateways=${load#*@}; offline=(); [ "$gateways" = 1 ] && offline=(--compare-offline)
         bench "${mode}_gw$gateways" 200 --launch "$mode" "${offline[@]}" --num-prompts 256 --input-len 32 --output-len 256 \
           --max-concurrency 128 -- "${engine[@]}" --api-server-count "$gateways" ;;
    *) echo "unknown load $load" ;;
  esac
done
