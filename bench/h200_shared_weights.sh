#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl as bench/h200_suite.sh says): issue #26 item 1 on the GPU.
# 1. tests/gpu/test_shared_weights_gpu.py (CUDA IPC: mapped weights, same greedy tokens, lost with the exporter);
# 2. `kvrelay serve --model dummy:llama-3-8b` disaggregated (prefill + decode worker on one GPU), with and
#    without --no-share-weights: each process's HBM (nvidia-smi), the worker logs' "weights mapped" line, and
#    the greedy answer to one prompt, which must be equal in both runs.
# Results land in $OUT: gpu_test.txt, memory_<mode>.csv, answer_<mode>.json, serve_<mode>.log.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/gpu/test_shared_weights_gpu.py 2>&1 \
  | tail -5 | tee "$OUT/gpu_test.txt"
PORT=8123
for mode in share-weights no-share-weights; do
  python3 -m kvrelay.cli serve --model dummy:llama-3-8b --load-format dummy --served-model-name m --port $PORT \
    --kv-cache-memory 8000000000 --max-model-len 4096 --$mode > "$OUT/serve_$mode.log" 2>&1 &
  serve=$!
  start=$(date +%s)
  until curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null; do
    sleep 2
    if (( $(date +%s) - start > 240 )) || ! kill -0 $serve 2> /dev/null; then echo "$mode: not ready"; break; fi
  done
  echo "$mode: ready after $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/memory_$mode.csv"
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "m", "prompt": [5, 17, 99, 203, 7, 311, 42], "max_tokens": 16, "temperature": 0, "ignore_eos": true}' \
    | tee "$OUT/answer_$mode.json"; echo
  grep -h "weights mapped\|weights loaded\|private copy" "$OUT/serve_$mode.log" | tail -4
  kill -TERM $serve; wait $serve
done
python3 - "$OUT" <<'EOF'
import json, sys
texts = [json.load(open(f"{sys.argv[1]}/answer_{m}.json"))["choices"][0]["text"] for m in ("share-weights", "no-share-weights")]
print("greedy answers equal with and without sharing:", texts[0] == texts[1])
EOF
