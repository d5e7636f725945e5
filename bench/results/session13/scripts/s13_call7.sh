export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
CAPS=160/112,160/0 python tmp_gpu/s13_paired_kernels.py 2>&1 | tee $OUT/call7_paired_kernels_regcaps.txt
