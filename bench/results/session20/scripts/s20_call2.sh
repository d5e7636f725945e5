export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only moe_pairs > $OUT/call2_sanitize_moe_pairs.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"; tail -4 $OUT/call2_sanitize_moe_pairs.log
S=$(date +%s)
timeout 420 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --out $OUT/e2e > $OUT/e2e.log 2>&1; echo "e2e rc=$? $(( $(date +%s)-S ))s"
grep -A3 "^## Targets" $OUT/e2e/e2e.md; grep "^| 64 | 1 | 512" $OUT/e2e/e2e.md | head -2
python -c "
import json; d=json.load(open('$OUT/e2e/e2e.json'))
b=d['cases'][0]['breakdown']['optimize']; print('kernel us/step', round(b['total_us_per_step'],1))
for k in b['kernels']:
    if any(s in k['name'] for s in ('pairs', 'softmax_online', 'Memcpy', 'mma_kernel', 'sparse_mla')): print(k['name'][:90], round(k['us_per_step'],1))
"
