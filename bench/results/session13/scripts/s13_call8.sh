export PYTHONUNBUFFERED=1; rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
S=$(date +%s)
timeout 230 compute-sanitizer --tool memcheck --error-exitcode 9 python bench/sanitize_kernels.py --only fp4_moe > $OUT/call8_sanitize_fp4_h200.log 2>&1
echo "sanitize rc=$? $(( $(date +%s)-S ))s"; grep -c ": ok" $OUT/call8_sanitize_fp4_h200.log; grep -E "ERROR SUMMARY|Error|error|full block" $OUT/call8_sanitize_fp4_h200.log | tail -4
