#!/bin/bash
# Session 12 call 1: FP4 MoE scale loads (row-major tl.load / row-major asm load / tiled asm load) x tile shapes,
# interleaved rounds of CUDA-graph replays of the pair kernels; plus sm_90 register counts on the device's ptxas.
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
ROUNDS=${ROUNDS:-5} timeout 420 python tmp_gpu/s12_scales.py 2>&1 | tee $OUT/s12_scales.txt | grep -v "^round"
echo "rc=$? $(( $(date +%s)-S ))s"
