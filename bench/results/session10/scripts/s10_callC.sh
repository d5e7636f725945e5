#!/bin/bash
# Session 10, call C: e2e verify (T=4) and ctx 128K on host inputs.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
git log --oneline -1
S=$(date +%s)
timeout 560 python -m bench --full --parts e2e --groups ${GROUPS_:-64x1,1x1} --contexts ${CONTEXTS:-512} --budget-s 500 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -E "^\[" $OUT/e2e.log | tail -12
