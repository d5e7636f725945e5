"""Session 27: M=8 (48 pairs over 256 experts, the `mma_small` class) with register caps, split gate/up
sums and a narrower down kernel, paired against the default (bench_fp4_moe's sweep, tiled experts, PDL on).
With 123 registers a thread the default's one-warp gate/up programs fit 16 an SM (6,144 programs: 2.9
waves), its 4-warp down programs at 158 registers 3 an SM (1,536 programs: 3.9 waves)."""
import sys

sys.path.insert(0, "bench")
import bench_fp4_moe as bm  # noqa: E402

base = dict(down=(128, 4))
bm.SWEEP_CANDIDATES[8] = [
    bm._mma(8, 16, 128, 1, 1, True, **base),
    bm._mma(8, 16, 128, 1, 1, True, caps=(96, 0), **base),
    bm._mma(8, 16, 128, 1, 1, True, caps=(112, 0), **base),
    bm._mma(8, 16, 128, 1, 1, True, caps=(0, 128), **base),
    bm._mma(8, 16, 128, 1, 1, True, caps=(112, 128), **base),
    bm._mma(8, 16, 128, 1, 1, True, splits=2, **base),
    bm._mma(8, 16, 128, 1, 1, True, down=(64, 2)),
]
sys.argv = [sys.argv[0], "--sweep", "--ms", "8", "--rounds", "60", "--out", sys.argv[1]]
bm.main()
