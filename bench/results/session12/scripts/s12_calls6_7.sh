#!/bin/bash
# e2e paired A/B at B=64 ctx 512: default launcher vs scale words by inline-asm loads; a second default compile for noise.
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
PAIRED_ROUNDS=400 timeout 530 python tmp_gpu/s12_paired.py ${B:-64} ${V:-base,asm,base2} 2>&1 | tee $OUT/s12_paired_asm.txt | grep -E "^B=|^\[|max \||launcher|pass records" | tail -24
echo "rc=$? $(( $(date +%s)-S ))s"
