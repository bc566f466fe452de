"""Parallelism on torch.distributed: process groups (group.py), what the driver sends the other ranks
(messages.py), how each rank slices the weights (sharding.py) and what a pipeline stage does with a forward
pass (pipeline.py). The executors that start and drive the ranks are above the model: executor/."""
