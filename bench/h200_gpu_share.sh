#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says), under 9 minutes: issue #23
# item 3, how the prefill and decode processes share the GPU. For each --gpu-share mode (MODES, default
# timeslice priority mps mps-priority green) `kvrelay bench serve --launch disaggregated --sweep` starts kvrelay serve on the
# Llama-3-8B shape with dummy weights under that mode (an entry MODE_P_D also sets SM shares: mps_100_70 gives prefill 100%, decode 70%)
# and searches, 1,024 -> 128, for the highest Poisson rate
# with p99 TTFT <= 300 ms and p99 ITL <= 25 ms: from 16 req/s, doubling to 32 on a pass and bisecting (24, then
# 20 or 28), 4 trials at most and never below 8, so a mode that passes 16 is also measured at 24. The first mode
# also runs the offline engine on the same prompts once (--compare-offline). A mode that does not start (no MPS
# control program, no green contexts in this torch) leaves its reason in its log and the script goes on.
# Then one table: per mode the rate found and p50 / p99 TTFT and ITL at 16 and 24 req/s
# (bench/gpu_share_report.py). Results in $OUT: gpu.txt, goodput-<mode>.{txt,json}, serve-<mode>.log,
# gpu_share.txt (the table). REQUESTS per trial (default 150), MODE_S / FIRST_S bound a mode / the first one
# (offline included); TESTS=1 first runs tests/gpu/test_gpu_share_gpu.py (about 3 more minutes).
set -u
. bench/h200_setup.sh || exit 1
python3 -c "import torch; print('torch', torch.__version__, 'green contexts:', torch.cuda.green_contexts.SUPPORTED)" \
  2>&1 | tee -a "$OUT/gpu.txt"
echo "nvidia-cuda-mps-control: $(command -v nvidia-cuda-mps-control || echo none)" | tee -a "$OUT/gpu.txt"
if [ "${TESTS:-0}" = 1 ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_gpu_share_gpu.py \
    2>&1 | tee "$OUT/gpu_share_tests.txt" | tail -12
fi
ENGINE=${ENGINE:-"--model dummy:llama-3-8b --load-format dummy --max-model-len 2048 --max-num-seqs 128"}
MODES=${MODES:-timeslice priority mps mps-priority green}
first=1
for mode in $MODES; do
  start=$(date +%s)
  # a mode may name SM shares: mps_80_60 is --gpu-share mps with 80% for prefill and 60% for decode
  IFS=_ read -r share prefill_pct decode_pct <<< "$mode"
  shares=""
  [ -n "$prefill_pct" ] && shares="--gpu-sm-percent $prefill_pct"
  [ -n "$decode_pct" ] && shares="$shares --decode-gpu-sm-percent $decode_pct"
  offline="" limit=${MODE_S:-85}
  if [ $first = 1 ]; then offline="--compare-offline" limit=${FIRST_S:-140}; first=0; fi
  # SIGINT, so bench serve's own clean-up stops its server (and serve its workers and MPS daemon) before the next mode
  timeout -s INT -k 30 "$limit" python3 -m kvrelay.cli --log-level WARNING bench serve --launch disaggregated --sweep $offline \
    --input-len 1024 --output-len 128 --sweep-requests "${REQUESTS:-150}" --sweep-start 16 --sweep-resolution "${RESOLUTION:-4}" \
    --sweep-min-rate 8 --sweep-max-trials 4 --json "$OUT/goodput-$mode.json" \
    -- $ENGINE --gpu-share "$share" $shares > "$OUT/goodput-$mode.txt" 2>&1
  rc=$?
  echo "== $mode: rc $rc, $(( $(date +%s) - start )) s"
  grep -E "^ +[0-9]+ +[0-9.]+ |highest rate|no rate met|did not become ready|error:" "$OUT/goodput-$mode.txt" | tail -8
  # launched() keeps the server's log in a fresh temporary folder: this mode's is the newest
  log=$(ls -td /tmp/kvrelay-bench-serve-*/ 2> /dev/null | head -1)serve-disaggregated.log
  [ -f "$log" ] && cp "$log" "$OUT/serve-$mode.log"
done
python3 -m kvrelay.bench.gpu_share_report "$OUT" $MODES | tee "$OUT/gpu_share.txt"
