#!/bin/bash
# session 9 call 4: e2e after the cheaper step validation and guard skipping; host probe at B=1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
timeout 400 python -m bench --full --parts e2e --groups 64x1,1x1 --contexts 512 --budget-s 380 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -E "^\[" $OUT/e2e.log | tail -8
timeout 150 python tmp_gpu/host_probe.py 1 2>&1 | tee $OUT/host_probe.txt | grep -E "^B="
