export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
python -c "import torch._inductor.config as c; print('pdl' , c.triton.enable_pdl, 'cdt', c.coordinate_descent_tuning)"
timeout 560 python -m bench.paired_step --batch 64 --tokens 1 --rounds 200 --out $OUT/opts --variants "base,pdl:inductor.triton.enable_pdl=True,cdt:inductor.coordinate_descent_tuning=True" 2>&1 | grep "^|\|compiled\|failed\|Error\|rror" | cut -c1-400
echo "[done $(( $(date +%s)-S ))s]"
