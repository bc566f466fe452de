"""Tensor parallelism on torch.distributed: process groups (group.py), how each rank slices the
weights (sharding.py), and the multi-process executor that starts and drives the ranks (executor.py)."""
