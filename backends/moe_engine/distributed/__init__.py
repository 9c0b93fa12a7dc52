"""Tensor and expert parallelism: process groups, sharding of the model before its weights load, and the ranks
that rank 0 (the serving process) starts and drives."""
