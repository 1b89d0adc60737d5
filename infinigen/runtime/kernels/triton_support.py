"""Triton where it is installed (CUDA builds of PyTorch ship it; CPU builds run the PyTorch paths, and
CI runs the kernels under Triton's interpreter), and whether a device runs this package's kernels."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = tl = None


def on_triton(device: torch.device) -> bool:
    """Whether ``device`` runs the Triton kernels (CUDA, with Triton installed)."""
    return triton is not None and device.type == "cuda"
