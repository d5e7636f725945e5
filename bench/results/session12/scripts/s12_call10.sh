#!/bin/bash
# e2e paired A/B at B=64 T=4 (verify, 256 tokens: the 32-row mma class) ctx 512: default (scale_asm) vs tl.load scales.
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
PAIRED_ROUNDS=300 timeout 300 python tmp_gpu/s12_paired.py 64 base,tlload,base2 4 2>&1 | tee $OUT/s12_paired_t4.txt | grep -E "^B=|^\[|max \||mma config|pass records" | tail -20
echo "rc=$? $(( $(date +%s)-S ))s"
