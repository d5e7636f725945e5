#!/bin/bash
# session 9 call 2: e2e with the fused input projections (and the 16-splits combine at B=1)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
timeout 560 python -m bench --full --parts e2e --groups 64x1,1x1 --contexts 512 --budget-s 500 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -E "^\[" $OUT/e2e.log | tail -12
grep -E "^\| (64|1) \| 1 \||matched|head" $OUT/e2e/e2e.md | head -20
