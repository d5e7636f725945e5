"""Triton kernels for the dsv4 ops, each beside its torch reference and its torch.library
registration. Importing this package registers torch.ops.dsv4.*."""
from . import fp4_moe, hc_sinkhorn, indexer_physical, indexer_topk, moe_route, sparse_mla  # noqa: F401
