"""Host -> device copies that never make the host wait for the GPU.

``tensor.to(device)`` from pageable memory synchronises with the copy's stream: the host waits until every
kernel queued before it has run. Since a step is launched before the previous one's results are read (engine.py,
overlapped steps), the next step's inputs are built while the GPU still runs the one before: a blocking copy
there would hold the host until the GPU drains, and the GPU would then wait for the host to queue the step.
``upload`` stages the array in pinned memory from torch's caching host allocator, which keeps that block from
reuse until the copy has run, and copies it without blocking.
"""
from __future__ import annotations

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A device copy of ``array`` (on CPU: a tensor sharing its memory), queued on the current stream."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
