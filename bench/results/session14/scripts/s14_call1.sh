export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
V="base,sep:mma.block_n=16;mma.down_block_n=64;mma.down_num_warps=2;mma.max_regs=0;mma.down_max_regs=0,g16:mma.block_n=16;mma.down_block_n=32;mma.down_num_warps=1;mma.max_regs=0,d64:mma.down_block_n=64;mma.down_num_warps=2;mma.down_max_regs=0"
S=$(date +%s)
timeout 280 python -m bench.paired_step --batch 64 --tokens 1 --rounds 300 --out $OUT/t1 --variants "$V" 2>&1 | grep -v "^Online\|^split the\|^softmax\|^important\|^$" | tail -25
echo "[t1 done $(( $(date +%s)-S ))s]"
timeout 280 python -m bench.paired_step --batch 64 --tokens 4 --rounds 200 --out $OUT/t4 --variants "$V" 2>&1 | grep -v "^Online\|^split the\|^softmax\|^important\|^$" | tail -25
echo "[t4 done $(( $(date +%s)-S ))s]"
