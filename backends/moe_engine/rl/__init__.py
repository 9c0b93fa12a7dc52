"""The RL rollout lifecycle: weight updates (from disk or a torch.distributed broadcast, into the live parameters),
pause / continue, release / resume of GPU memory, cache flushes."""
