export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 280 python bench/bench_fp4_moe.py --sweep --ms 1,8 --rounds 100 --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| (mx|nv)" $OUT/sweep.log | cut -c1-400
tail -3 $OUT/sweep.log
S=$(date +%s)
timeout 290 python -m bench.paired_step --batch 1 --tokens 1 --rounds 200 --out $OUT/paired_b1 --variants "base,s2:mma_token.k_splits=2,s4x2:mma_token.k_splits=4;mma_token.down_k_splits=2,s8x2:mma_token.k_splits=8;mma_token.down_k_splits=2" > $OUT/paired_b1.log 2>&1; echo "paired rc=$? $(( $(date +%s)-S ))s"
grep -E "^\||compiled" $OUT/paired_b1.log | tail -12
