"""Triton kernels for the dsv4 ops, each beside its torch reference and its torch.library registration."""
