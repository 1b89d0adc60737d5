"""PyTorch's CUDA allocator as the memory plan assumes it: segments that grow in place (expandable
segments), so that a run the plan fits does not fail on the fragments of a nearly full card. Without
them the Python path at 4 x 32K on 24 GB ran out of memory with 1.74 GB reserved and unused, and 1 x 128K
decoded at 880 ms a token (the allocator freeing its cache to retry), where the command line, which sets
them, runs both (BENCHMARKS.md, "A small GPU").

A user's own ``PYTORCH_CUDA_ALLOC_CONF`` wins, everywhere."""

from __future__ import annotations

import os

import torch

VARIABLE, SETTING = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
_set_here = False  # whether this process's allocator was switched at run time (once is enough)


def before_cuda() -> None:
    """Before anything allocates on a GPU (the command line, ``infinigen.load``): expandable segments by
    default, through the variable PyTorch reads when its allocator starts."""
    os.environ.setdefault(VARIABLE, SETTING)


def expandable(device: torch.device) -> None:
    """Where a cache is made on CUDA and nobody configured the allocator: its new segments expandable from
    now on (PyTorch takes the setting at run time; segments it already holds keep theirs)."""
    global _set_here
    if device.type != "cuda" or VARIABLE in os.environ or _set_here:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    setter = setter or getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is not None:
        setter(SETTING)
        _set_here = True
