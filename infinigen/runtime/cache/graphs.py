"""CUDA graphs: an offloaded layer's decode-time selection (``SelectionGraph``), and the capture
that ``infinigen.runtime.generation.StepGraph`` uses for whole decode steps.

A policy's selection is a few dozen small kernels per layer and step; launched one at a time from
Python they cost more host time than the GPU spends on them, and the whole decode step becomes
host-bound (measured on an H200: ~80 launches per offloaded layer, the step as long as its
enqueue). A policy's ``select`` reads only per-slot buffers sized by the layer's
capacity, so its shapes and buffer addresses stay fixed until the capacity grows (once per pool
block): it is captured once per capacity and replayed as one launch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import torch

from infinigen.runtime.streams import side_stream

if TYPE_CHECKING:
    from infinigen.architectures import Norm
    from infinigen.runtime.cache.layers import OffloadedLayer
    from infinigen.runtime.selection.policies import Selection

T = TypeVar("T")


class SelectionGraph:
    """One offloaded layer's ``select`` (norm, policy selection, fetch mask) as a CUDA graph."""

    def __init__(self) -> None:
        self.capacity = -1  # the layer capacity the graph was captured at
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Selection, torch.Tensor] | None = None
        # the graph's static inputs, refilled before each replay: hidden (B, hidden) and the rotary cos/sin
        self.hidden: torch.Tensor | None = None
        self.rope: tuple[torch.Tensor, ...] = ()
        # the cache's shared arange the capture read: a later, longer one replaces it, and the graph
        # would read freed memory if this reference did not keep it alive
        self.slot_range: torch.Tensor | None = None

    def __call__(self, layer: OffloadedLayer, hidden: torch.Tensor, norm: Norm, rope) -> tuple[Selection, torch.Tensor]:
        if layer.capacity != self.capacity:
            self._capture(layer, hidden, norm, rope)
        else:
            self.hidden.copy_(hidden)
            for static, value in zip(self.rope, rope or (), strict=True):
                static.copy_(value)
        self.graph.replay()
        selection, valid = self.outputs
        if selection.count is not None:  # the stats keep each step's count: not the graph's buffer
            selection = replace(selection, count=selection.count.clone())
        return selection, valid

    def _capture(self, layer: OffloadedLayer, hidden: torch.Tensor, norm: Norm, rope) -> None:
        self.graph = self.outputs = None  # release the previous capture's memory first
        layer.cache.all_slots(layer.capacity + 1)  # the shared arange must not grow inside the capture
        self.slot_range = layer.cache.slot_range
        self.hidden = hidden.clone()  # static inputs, refilled before each replay
        self.rope = tuple(t.clone() for t in rope) if rope is not None else ()
        static_rope = self.rope or None
        side = side_stream(hidden.device, "capture")  # captures must not run on the default stream
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side):
            layer.select(self.hidden, norm, static_rope)  # lazy initialisation (cuBLAS workspaces) stays outside
        self.graph, self.outputs = capture(lambda: layer.select(self.hidden, norm, static_rope), side)
        self.capacity = layer.capacity


def make_room(device: torch.device) -> bool:
    """Return the allocator's idle cached memory to the device when it holds more than the device
    has free. A capture allocates from its own pool: it cannot reuse the general pool's cached
    blocks, nor free them (no cudaFree while capturing), so many short-lived caches (one per batch
    of 5-shot examples) would run it out of memory with most of the GPU cached and idle.
    True when it emptied the cache."""
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if idle <= torch.cuda.mem_get_info(device)[0]:
        return False
    torch.cuda.empty_cache()
    return True


def capture(fn: Callable[[], T], stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn()`` captured on ``stream`` (not the default stream; its lazy initialisation done by an
    earlier run on that stream): the graph and ``fn``'s outputs, which each replay refills."""
    make_room(stream.device)
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    collecting = gc.isenabled()
    gc.disable()  # a collection inside the capture could destroy a dead cache's graphs: that ends the capture
    try:
        with torch.cuda.stream(stream):
            # capture_begin/end rather than torch.cuda.graph, whose entry synchronises the device and
            # empties the allocator's cache (every later allocation a cudaMalloc again) at every
            # capture: costly where caches are short-lived (5-shot tasks: BENCHMARKS.md, "Method")
            # thread_local: the pools' blocks are pinned on worker threads (``host_memory``), whose
            # CUDA calls must not end this thread's capture
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                # a capture left open is ended with its own error (unjoined work), which would hide
                # this one: an out-of-memory must reach the caller as one (a batch job reruns in halves)
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise
            graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(stream)
    return graph, outputs
