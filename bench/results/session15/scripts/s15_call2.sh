export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 580 python -m bench.paired_step --batch 64 --tokens 1 --rounds 100 --out $OUT/cdt --variants "base,nc:inductor.combo_kernels=False,cdt_nc:inductor.coordinate_descent_tuning=True;inductor.combo_kernels=False" 2>&1 | grep "^|\|compiled\|failed\|Error\|rror" | cut -c1-400
echo "[done $(( $(date +%s)-S ))s]"
