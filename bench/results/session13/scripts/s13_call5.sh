export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
PAIRED_ROUNDS=400 python tmp_gpu/s13_paired.py 64 base,g160,g160d112,base2 1 2>&1 | tee $OUT/call5_paired_regcaps_b64.txt
