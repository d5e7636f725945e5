#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
python tmp_gpu/prof_idx8.py > $OUT/prof_idx.txt 2>&1; echo "prof rc=$? $(( $(date +%s)-S ))s"; cat $OUT/prof_idx.txt | grep -v Warn | head -80
S=$(date +%s)
python tmp_gpu/moe_bm16.py $OUT/moe_bm16 > $OUT/moe_bm16.log 2>&1; echo "moe rc=$? $(( $(date +%s)-S ))s"; grep "^| " $OUT/moe_bm16.log
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 250 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only sparse_mla,indexer > $OUT/sanitize_smla_idx.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"
grep -E "ERROR SUMMARY|rror" $OUT/sanitize_smla_idx.log | tail -5; tail -3 $OUT/sanitize_smla_idx.log
