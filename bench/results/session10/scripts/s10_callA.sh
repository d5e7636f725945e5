#!/bin/bash
# Session 10, call A: e2e B=64 / B=1 at ctx 512, optimize() on host inputs (Engine.step without a sync),
# its GPU-input form and compiled_step beside it; then a host-path check on CUDA.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
git log --oneline -1
S=$(date +%s)
timeout 540 python -m bench --full --parts e2e --groups ${GROUPS_:-64x1,1x1} --contexts ${CONTEXTS:-512} --budget-s 480 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -E "^\[" $OUT/e2e.log | tail -12
