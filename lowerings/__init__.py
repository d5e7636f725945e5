"""Inductor lowerings around the dsv4 ops."""
