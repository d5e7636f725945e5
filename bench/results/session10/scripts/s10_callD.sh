#!/bin/bash
# Session 10, call D: prototype split-K FMA kernels for the mHC projection (not in the package).
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
timeout 280 python tmp_gpu/skinny_proto.py > $OUT/skinny_proto.txt 2>&1
echo "proto rc=$? $(( $(date +%s)-S ))s"; grep "^M=" $OUT/skinny_proto.txt | head -60; tail -3 $OUT/skinny_proto.txt
