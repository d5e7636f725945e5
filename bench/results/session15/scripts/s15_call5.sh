export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s); mkdir -p $OUT/down
timeout 135 python tmp_gpu/s15_down_shapes.py $OUT/down 2>&1 | grep "^|" ; echo "[kernels $(( $(date +%s)-S ))s]"
