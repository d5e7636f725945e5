#!/bin/bash
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
FMTS=mxfp4 MS=64 CFGS=default ROUNDS=1 timeout 200 compute-sanitizer --tool memcheck --print-limit 5 python tmp_gpu/s12_scales.py 2>&1 | tail -30
echo "rc=$? $(( $(date +%s)-S ))s"
