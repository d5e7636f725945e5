export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 150 python tmp_gpu/s21_moe.py 100 2>&1 | grep -v Warn > $OUT/call2_moe_swz.txt; echo "moe rc=$? $(( $(date +%s)-S ))s"; cat $OUT/call2_moe_swz.txt
S=$(date +%s)
timeout 60 python tmp_gpu/s21_dot.py 2>&1 | grep -v Warn > $OUT/call2_dot_paths.txt; echo "dot rc=$? $(( $(date +%s)-S ))s"; cat $OUT/call2_dot_paths.txt
S=$(date +%s)
timeout 360 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --out $OUT/e2e > $OUT/e2e.log 2>&1; echo "e2e rc=$? $(( $(date +%s)-S ))s"
grep -A3 "^## Targets" $OUT/e2e/e2e.md; grep "^| 64 | 1 | 512" $OUT/e2e/e2e.md | head -2
python -c "
import json; d=json.load(open('$OUT/e2e/e2e.json'))
b=d['cases'][0]['breakdown']['optimize']; print('kernel us/step', round(b['total_us_per_step'],1))
for k in b['kernels'][:6]: print(k['name'][:90], round(k['us_per_step'],1))
"
