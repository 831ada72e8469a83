#!/bin/bash
# Sourced (`. bench/h200_setup.sh`) at the top of a device call's script: the set-up every H200 call shares.
# Installs the cp312 wheels the GPU image lacks from .whl/ (carry it; bench/h200_suite.sh lists them) into
# /tmp/site, points KVRELAY_SMOLLM2_TOKENIZER at .tok/ when it was carried, installs the package itself, and
# writes the device and date to $OUT/gpu.txt. Returns non-zero when an install fails.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -d .tok ] && export KVRELAY_SMOLLM2_TOKENIZER=${KVRELAY_SMOLLM2_TOKENIZER:-$PWD/.tok}
# the package as installed: from the repository root a bare `kvrelay/` would shadow its folder mapping
python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . || return 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
