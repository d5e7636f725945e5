#!/bin/bash
# Session 10, call B: memcheck of dsv4::skinny_mm_partials, the mHC projection micro-bench, then e2e
# B=64 / B=1 at ctx 512 with the skinny_mm op in the step.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only skinny_mm > $OUT/sanitize_skinny_mm.log 2>&1
echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -8 $OUT/sanitize_skinny_mm.log
timeout 120 python tmp_gpu/hc_mix_bench.py > $OUT/hc_mix_bench.txt 2>&1
echo "hc bench rc=$? $(( $(date +%s)-S ))s"; grep rows $OUT/hc_mix_bench.txt
R=$(( 560 - ($(date +%s)-S) ))
timeout $R python -m bench --full --parts e2e --groups ${GROUPS_:-64x1,1x1} --contexts ${CONTEXTS:-512} --budget-s $(( R - 40 )) --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -E "^\[" $OUT/e2e.log | tail -12
