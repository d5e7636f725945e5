export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 380 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --budget-s 330 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; grep -A3 "^## Targets" $OUT/e2e/e2e.md; grep "^| 64 " $OUT/e2e/e2e.md | head -3; grep -A6 "^| kernel | per step" $OUT/e2e/e2e.md | head -7
timeout 190 python bench/bench_fp4_moe.py --out $OUT/fp4_moe > $OUT/fp4_moe.log 2>&1
echo "bench rc=$? $(( $(date +%s)-S ))s"; grep "^|" $OUT/fp4_moe/results.md | head -30
