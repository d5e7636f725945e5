#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
python tmp_gpu/sinkhorn8.py 2>&1 | grep -v -i warn
S=$(date +%s)
timeout 280 python bench/bench_sparse_mla.py --out $OUT/smla > $OUT/smla.log 2>&1; echo "smla rc=$? $(( $(date +%s)-S ))s"; tail -45 $OUT/smla.log | grep -v -i warn
S=$(date +%s)
timeout 200 python bench/bench_indexer.py --out $OUT/idx > $OUT/idx.log 2>&1; echo "idx rc=$? $(( $(date +%s)-S ))s"; tail -45 $OUT/idx.log | grep -v -i warn
