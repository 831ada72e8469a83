#!/bin/bash
# A device call that may get either card. On an H200 (>= 100 GiB) the pool density run (issue #26, which needs
# its memory). Otherwise the SECTIONS asked for (default "handoff w4"):
#   handoff: the handoff trace (issue #23 item 4) and `bench handoff --sections cuda` on the same sizes, so the
#            trace sits beside the table it explains (~3 min);
#   w4:      the one-row W4 GEMVs (issue #27): their GPU tests, the sweep of the split-K and the whole-column
#            kernels at one row, and `bench quant` of AWQ under each (~7 min).
. bench/h200_setup.sh || exit 1
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -ge 100000 ] && [ -z "${NO_POOL:-}" ]; then
  timeout 570 python3 -m kvrelay.cli bench pool --model dummy:llama-3-8b --load-format dummy --num-models 8 \
    --max-model-len 2048 --min-kv-seqs 16 --num-requests 320 --request-rate 8 --input-len 512 --output-len 128 \
    > "$OUT/pool.txt" 2>&1
  echo "pool rc $?"; tail -60 "$OUT/pool.txt"
  exit 0
fi
for section in ${SECTIONS:-handoff w4}; do
  case $section in
  handoff)
    timeout 150 python3 -m kvrelay.bench.handoff_trace --device cuda --tokens 8,256,2048 --repeats 20 \
      > "$OUT/trace.txt" 2>&1
    echo "trace rc $?"; grep -v "^$" "$OUT/trace.txt" | tail -80
    timeout 150 python3 -m kvrelay.bench.handoff --sections cuda --tokens 256,2048 --repeats 5 > "$OUT/handoff.txt" 2>&1
    echo "handoff rc $?"; grep -v "^$" "$OUT/handoff.txt" | tail -45 ;;
  w4)
    timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_w4_gemv_gpu.py -k "cols or columns" \
      > "$OUT/w4_tests.txt" 2>&1
    echo "w4 tests rc $?"; tail -5 "$OUT/w4_tests.txt"
    timeout 240 python3 -m kvrelay.bench.quant_kernels --rows 1 --formats bf16,w4_gemv_atomic,w4_gemv_cols \
      --json "$OUT/quant_kernels.json" > "$OUT/quant_kernels.txt" 2>&1
    echo "sweep rc $?"; grep '^|\|sweep\|copy' "$OUT/quant_kernels.txt" | tail -20
    timeout 200 python3 -m kvrelay.cli bench quant --variants awq@w4_gemv_atomic,awq@w4_gemv_cols --prompts 4 \
      --len 1024 > "$OUT/quant.txt" 2>&1
    echo "quant rc $?"; tail -6 "$OUT/quant.txt" ;;
  esac
done
