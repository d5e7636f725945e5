export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s); mkdir -p $OUT/two
timeout 250 python tmp_gpu/s14_two_pairs.py $OUT/two 2>&1 | grep "^|" ; echo "[kernels $(( $(date +%s)-S ))s]"
V="base,g16:mma.block_n=16;mma.down_block_n=32;mma.down_num_warps=1;mma.max_regs=0,g16nc:mma.block_n=16;mma.down_block_n=32;mma.down_num_warps=1;mma.max_regs=0;mma.down_max_regs=0,sepna:mma.block_n=16;mma.down_block_n=64;mma.down_num_warps=2;mma.max_regs=0;mma.down_max_regs=0;mma.scale_asm=False"
timeout 300 python -m bench.paired_step --batch 64 --tokens 1 --rounds 400 --out $OUT/t1 --variants "$V" 2>&1 | grep "^|\|compiled"
echo "[t1 $(( $(date +%s)-S ))s]"
