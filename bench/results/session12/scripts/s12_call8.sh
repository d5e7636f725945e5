#!/bin/bash
# Session 12 call 5: compute-sanitizer of every fp4_moe path (incl. the new scale_asm default and forced config),
# then the e2e B=64 T=1 ctx 512 of the tree (scale_asm on by default in the 32-row mma class).
export PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 220 compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only fp4_moe > $OUT/sanitize_fp4_h200.log 2>&1
echo "sanitize rc=$? $(( $(date +%s)-S ))s"; grep -c ": ok" $OUT/sanitize_fp4_h200.log; grep -E "ERROR SUMMARY|Error|error" $OUT/sanitize_fp4_h200.log | tail -3
grep "scale_asm" $OUT/sanitize_fp4_h200.log | head -3
python -m bench --full --parts e2e --groups 64x1 --contexts 512 --budget-s 340 --out $OUT/e2e > $OUT/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s)-S ))s"; tail -4 $OUT/e2e.log
grep -E "^\| 64 |kernel time|idle|20x|compile" $OUT/e2e/e2e.md | head -20
