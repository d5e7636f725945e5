export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
python -m bench.paired_step --batch 64 --tokens 1 --rounds 200 --out $OUT/inductor --variants "base,combo:inductor.combo_kernels=True,aggr:inductor.aggressive_fusion=True" 2>&1 | grep "^|\|compiled\|failed\|Error" | cut -c1-400
echo "[done $(( $(date +%s)-S ))s]"
