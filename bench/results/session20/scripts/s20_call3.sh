export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only rms_mm > $OUT/call3_sanitize_rms_mm.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -6 $OUT/call3_sanitize_rms_mm.log
S=$(date +%s)
timeout 400 python -m bench.paired_step --batch 64 --tokens 1 --rounds 200 --out $OUT/paired --variants "base,mulsum:passes.rms_mm=False" > $OUT/paired.log 2>&1; echo "paired rc=$? $(( $(date +%s)-S ))s"
tail -14 $OUT/paired.log
