export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 60 python tmp_gpu/s21_dot.py 2>&1 | grep -v Warn > $OUT/call3_dot_paths.txt; echo "dot rc=$? $(( $(date +%s)-S ))s"; cat $OUT/call3_dot_paths.txt
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 420 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only fp4_moe > $OUT/call3_sanitize_fp4_moe.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -5 $OUT/call3_sanitize_fp4_moe.log
