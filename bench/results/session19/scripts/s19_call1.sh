export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 500 python tmp_gpu/idx_proto.py 2>&1 | tee $OUT/call1_idx_proto.txt
