export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 300 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --budget-s 280 --out $OUT/e2e > $OUT/e2e.log 2>&1
grep "^\[\|optimize()\|Targets\|x19\|x20\|missed\|met" $OUT/e2e.log | grep -v Warning | cut -c1-600 | head -20
echo "[e2e done $(( $(date +%s)-S ))s]"
timeout $(( 585 - ($(date +%s)-S) )) python tmp_gpu/s15_cdt_bisect.py 256 base,cdt 2>&1 | grep -v "Warning\|warn" | tail -40
echo "[done $(( $(date +%s)-S ))s]"
