"""Session 30: the FP4 MoE's per-block ready counts (twenty-eighth session, TileConfig.ready_counts) timed
against the defaults they would replace: bench_fp4_moe's sweep (tiled experts, PDL on, outputs checked
against the reference and 20 more replays bit-equal to the first), trimmed to the default of each class
and its ready-count twin, plus 32 gate/up columns with ready counts at M=8 and 16-pair blocks (64-column K
steps) with and without them at M=256.

    python bench/results/session30/scripts/s30_ready_sweep.py OUT_DIR ROUNDS
"""
import sys

sys.path.insert(0, "bench")
import bench_fp4_moe as bm  # noqa: E402

small = dict(down=(128, 4))
wide = dict(down=(128, 4), asm=True, caps=(160, 0))
bm.SWEEP_CANDIDATES[8] = [bm._mma(8, 16, 128, 1, 1, True, **small), bm._mma(8, 16, 128, 1, 1, True, ready=True, **small),
                          bm._mma(8, 32, 128, 1, 1, True, ready=True, **small)]
bm.SWEEP_CANDIDATES[64] = [bm._mma(8, 16, 128, 1, 1, True, **small), bm._mma(8, 16, 128, 1, 1, True, ready=True, **small)]
bm.SWEEP_CANDIDATES[256] = [bm._mma(8, 32, 128, 1, 1, True, **wide), bm._mma(8, 32, 128, 1, 1, True, ready=True, **wide),
                            bm._mma(8, 16, 128, 1, 1, True, **small), bm._mma(8, 16, 128, 1, 1, True, ready=True, **small),
                            bm._mma(16, 16, 64, 1, 1, True, **small), bm._mma(16, 16, 64, 1, 1, True, ready=True, **small)]
sys.argv = [sys.argv[0], "--sweep", "--ms", "8,64,256", "--rounds", sys.argv[2], "--out", sys.argv[1]]
bm.main()
