#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
ROUNDS=6 timeout 200 python tmp_gpu/s11_pdl_e2e.py 64 base,tiles 2>&1 | tee $OUT/s11_tiles_e2e_rounds.txt | grep -E "^B=|^\[|max \||overridden" | tail -20
echo "rc=$? $(( $(date +%s)-S ))s"
