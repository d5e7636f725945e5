export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 300 python tmp_gpu/idx_call2.py 2>&1 | tee $OUT/call2_sampled_bins.txt
echo "proto $(( $(date +%s)-S ))s"; S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only indexer > $OUT/call2_sanitize_indexer.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -8 $OUT/call2_sanitize_indexer.log
