#!/bin/bash
# session 9 call 1: decode_mm vs cuBLAS (+ sweep); the combine change: memcheck + sparse-MLA bench
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
S=$(date +%s)
timeout 280 python bench/bench_decode_mm.py --sweep --out $OUT/dmm > $OUT/dmm.log 2>&1; echo "dmm rc=$? $(( $(date +%s)-S ))s"
tail -45 $OUT/dmm.log
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only sparse_mla,hc_sinkhorn > $OUT/sanitize_smla.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"
grep -E "ERROR SUMMARY|ok|rror" $OUT/sanitize_smla.log | tail -14
S=$(date +%s)
timeout 150 python bench/bench_sparse_mla.py --out $OUT/smla > $OUT/smla.log 2>&1; echo "smla rc=$? $(( $(date +%s)-S ))s"; grep -E "^\| (hca|csa)-bf16 \| 1 " $OUT/smla/sparse_mla.md
