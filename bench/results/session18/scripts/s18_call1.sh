set -x
export PYTHONUNBUFFERED=1
rm -rf /tmp/pp && mkdir -p /tmp/pp && cp -r dsv4_compile /tmp/pp/ && cp -r passes kernels lowerings /tmp/pp/dsv4_compile/ && export PYTHONPATH=/tmp/pp:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
S=$(date +%s)
timeout 300 python -m bench.paired_step --batch 64 --tokens 1 --rounds 200 --out $OUT/paired --variants "base,mulsum:passes.rms_mm=False" > $OUT/paired.log 2>&1; echo "paired rc=$? $(( $(date +%s)-S ))s"
tail -30 $OUT/paired.log
S=$(date +%s)
timeout 120 compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only rms_mm > $OUT/sanitize.log 2>&1; echo "sanitize rc=$? $(( $(date +%s)-S ))s"
tail -8 $OUT/sanitize.log
S=$(date +%s)
timeout 170 python -m bench --full --parts e2e --groups 64x1 --contexts 512 --out $OUT/e2e > $OUT/e2e.log 2>&1; echo "e2e rc=$? $(( $(date +%s)-S ))s"
tail -6 $OUT/e2e.log
