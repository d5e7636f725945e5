export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 150 python bench/bench_fp4_moe.py --sweep --ms 1 --rounds 150 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| (mx|nv)" $OUT/sweep.log | cut -c1-300
S=$(date +%s)
timeout 200 python -m bench.paired_step --batch 1 --tokens 1 --rounds 200 --out $OUT/paired_b1 --variants "base,direct:mma_token.direct_blocks=True,direct_s1:mma_token.direct_blocks=True;mma_token.k_splits=1" > $OUT/paired_b1.log 2>&1; echo "paired rc=$? $(( $(date +%s)-S ))s"
grep -E "^\||compiled" $OUT/paired_b1.log | tail -8 | cut -c1-250
S=$(date +%s)
timeout 330 compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only fp4_moe > $OUT/sanitize_fp4.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"
grep -c ": ok" $OUT/sanitize_fp4.log; grep -E "ERROR SUMMARY|rror" $OUT/sanitize_fp4.log | head -5
