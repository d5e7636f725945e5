export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 100 python bench/bench_fp4_moe.py --sweep --ms 8 --rounds 100 --out $OUT/sweep8 > $OUT/sweep8.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| (mx|nv)" $OUT/sweep8.log | cut -c1-300
S=$(date +%s)
timeout 150 python bench/bench_fp4_moe.py --ms 1,8 --out $OUT/fp4_moe > $OUT/fp4_moe.log 2>&1; echo "fp4 bench rc=$? $(( $(date +%s)-S ))s"
tail -12 $OUT/fp4_moe.log | cut -c1-400
S=$(date +%s)
timeout 200 python -m bench --full --parts e2e --groups 1x1 --contexts 512 --out $OUT/e2e > $OUT/e2e.log 2>&1; echo "e2e rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| 1 \||met|missed" $OUT/e2e/e2e.md | head -8 | cut -c1-500
