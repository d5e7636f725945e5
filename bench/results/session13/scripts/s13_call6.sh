export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
PAIRED_ROUNDS=300 python tmp_gpu/s13_paired.py 64 base,g160d112,g144d112,g176d112,g160d96,base2 1 2>&1 | grep -v Warn | tee $OUT/call6_paired_regcaps_b64_sweep.txt
PAIRED_ROUNDS=200 python tmp_gpu/s13_paired.py 64 base,g160d112,base2 4 2>&1 | grep -v Warn | tee $OUT/call6_paired_regcaps_b64_t4.txt
