export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 330 python tmp_gpu/idx_call5.py 2>&1 | tee $OUT/call5_finish_in_split.txt
echo "proto $(( $(date +%s)-S ))s"; S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only indexer > $OUT/call5_sanitize_indexer.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -7 $OUT/call5_sanitize_indexer.log
