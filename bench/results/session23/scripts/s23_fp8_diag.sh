#!/usr/bin/env bash
# Call 10: each FP8-row variant x case in its own process (an illegal address ends only that process),
# then compute-sanitizer memcheck of the tree's 32/32/8w tile on the B=64 cases.
export CUDA_LAUNCH_BLOCKING=1
for case in hca1 csa1; do
  for v in "head default" "head 32/32/8w" "tree default" "tree 32/32/8w" "tree 16/32/8w cap128"; do
    set -- $v
    timeout 120 python tmp_gpu/s23_fp8_diag.py "$1" "${*:2}" "$case" 2>&1 | grep -E "correct|Error|error" | head -3
    echo "  rc=${PIPESTATUS[0]} ($v, $case)"
  done
done
unset CUDA_LAUNCH_BLOCKING
for case in hca1 csa1 csa4; do
  timeout 150 compute-sanitizer --tool memcheck python tmp_gpu/s23_fp8_diag.py tree 32/32/8w "$case" 2>&1 | grep -E "correct|ERROR SUMMARY|Invalid" | head -5
done
