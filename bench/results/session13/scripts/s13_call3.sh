export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
python tmp_gpu/s13_bound_bench.py 2>&1 | tee $OUT/call3_block_bound_kernel_bench.txt
PAIRED_ROUNDS=400 python tmp_gpu/s13_paired.py 1 base,oldbound,base2 1 2>&1 | tee $OUT/call3_paired_bound_b1.txt
