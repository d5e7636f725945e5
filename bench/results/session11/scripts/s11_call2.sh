#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
timeout 570 python tmp_gpu/s11_pdl_e2e.py ${B_:-64} 2>&1 | tee $OUT/s11_pdl_e2e.txt | grep -v Warning | tail -40
echo "rc=$? $(( $(date +%s)-S ))s"
