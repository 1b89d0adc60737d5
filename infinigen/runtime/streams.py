"""The runtime's side streams: one per role and device for the whole process.

PyTorch gives each stream that runs a matrix multiply its own cuBLAS workspace (32 MiB on an H100)
and keeps it until the process ends, so new streams per cache would leave that much behind per
cache (67 MB per ``infinigen`` case of a bench sweep, BENCHMARKS.md, "GPU memory"). Sharing the streams
is safe: every hand-over between streams is an event or a ``wait_stream``.
"""

from __future__ import annotations

import functools

import torch

# Row moves and the selections they wait for run at a higher priority than the compute: when both
# have blocks waiting for SMs, theirs are dispatched first (the transfer is the long pole).
PRIORITY = {"transfer": -1, "selection": -1, "capture": 0}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The process's stream for ``role`` (transfer, selection or capture) on CUDA ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _stream(index, role)


@functools.cache
def _stream(index: int, role: str) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index), priority=PRIORITY[role])
