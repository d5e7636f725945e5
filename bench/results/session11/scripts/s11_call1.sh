#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch; print(torch.__version__, hasattr(torch._inductor.config.triton, 'enable_pdl'))"
S=$(date +%s)
timeout 560 python tmp_gpu/s11_moe.py ${PART:-ab} 2>&1 | tee $OUT/s11_moe.txt | grep -v Warning
echo "rc=$? $(( $(date +%s)-S ))s"
