export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 240 python bench/bench_indexer.py --sweep --out $OUT/sweep > $OUT/sweep.log 2>&1; echo "sweep rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| (512|131072)" $OUT/sweep.log | cut -c1-200
S=$(date +%s)
timeout 300 python bench/bench_indexer.py --out $OUT/indexer > $OUT/indexer.log 2>&1; echo "bench rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| (1|16|64) \|" $OUT/indexer.log | cut -c1-260
