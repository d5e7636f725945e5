#!/bin/bash
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/
export PYTHONPATH=/tmp/pp:$PWD
timeout 400 python tmp_gpu/host_probe.py 1,64 2>&1 | tee $OUT/host_probe.txt | grep -v "^\s*$" | head -150
