# The device calls of the sixteenth session, as run (PP = the package assembled under /tmp/pp as in BENCH.md).
# 1: cd tmp_gpu && python lm_proto.py --out $OUT/lm_proto.json; compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only fp4_moe
# 2: python -m bench.paired_step --batch 64 --tokens 1 --rounds 200 --out $OUT/paired --variants "base,cublas_head:passes.weight_stream_mm=False,old_down:mma_small.down_block_n=64;mma_small.down_num_warps=2"
# 3: python -m bench --full --parts e2e --groups 64x1 --contexts 512 --budget-s 330 --out $OUT/e2e   (before the upload change)
# 4: cd tmp_gpu && python splitk_proto.py --out $OUT/splitk.json
# 5: pytest tests/test_engine_upload.py (collection failed, see call6_upload_paired.txt);
#    compute-sanitizer --tool memcheck python bench/sanitize_kernels.py --only weight_stream_mm;
#    python -m bench --full --parts e2e --groups 64x1 --contexts 512 --budget-s 330 --out $OUT/e2e   (with the upload change)
# 6: python tmp_gpu/upload_paired.py
# 7: cd /tmp && python -m pytest -q -p no:cacheprovider --rootdir $R $R/tests/test_engine_upload.py
# 8: refused (no machine could be started)
# 9: python -m bench.paired_step --batch 1 --tokens 1 --rounds 150 --out $OUT/paired_b1 --variants "base,cublas_head:passes.weight_stream_mm=False"
