"""Triton kernels for the dsv4 ops, each beside its torch reference and its torch.library
registration. Importing this package registers torch.ops.dsv4.*."""
# With the checkout's root on sys.path (a script or `python -c` run from the root) this folder is
# also importable as a top-level `kernels`, the name under which transformers probes for the Hugging
# Face `kernels` package (by importing it). Only dsv4_compile.kernels registers the ops, so that one
# copy of each module serves them and what is set on dsv4_compile.kernels.* applies to the ops.
if __name__ == "dsv4_compile.kernels":
    from . import (fp4_moe, hc_sinkhorn, indexer_physical, indexer_topk, moe_route, rms_mm, sparse_mla,  # noqa: F401
                   weight_stream_mm)
