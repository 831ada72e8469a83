#!/bin/bash
# One device call: the GPU suite (bench/h200_suite.sh, SUITE=1 BENCH=0), then the probes named in PROBES
# (space-separated module names under kvrelay.bench with their args, ';'-separated), each under PROBE_S.
set -u
SUITE=${SUITE:-1} BENCH=${BENCH:-0} bash bench/h200_suite.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
IFS=';' read -ra probes <<< "${PROBES:-}"
for probe in "${probes[@]}"; do
  name=$(echo $probe | awk '{print $1}')
  echo "== $probe"
  timeout "${PROBE_S:-300}" python3 -m kvrelay.bench.$probe > "$OUT/$name.txt" 2>&1
  echo "rc $?"; tail -${PROBE_TAIL:-30} "$OUT/$name.txt"
done
