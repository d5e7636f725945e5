export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 520 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --out $OUT/e2e > $OUT/e2e.log 2>&1; echo "e2e rc=$? $(( $(date +%s)-S ))s"
grep -E "^\| 64 \||met|missed" $OUT/e2e/e2e.md | head -8 | cut -c1-600
grep -E "select|hist|split|finish|score_pages" $OUT/e2e/e2e.md | head -8
