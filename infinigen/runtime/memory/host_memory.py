"""Host memory for the CPU pools: pinned blocks made ahead of need, off the prefill's critical path.

PyTorch's pinned tensors (``pin_memory=True``: cudaHostAlloc through its caching host allocator)
cost the first token three ways (H100, 2026-11-27, BENCHMARKS "Prefill"): they pin at ~2 GB/s;
each allocation holds the driver's lock, so the prefill's kernel launches wait behind it (a 0.3 s
GPU loop took 3.4 s beside 8 GiB pinned on another thread); and every block is rounded up to a
power of two (an 8-bit block of 17.3 MB takes 32 MiB). Here a block is an anonymous mapping whose
pages worker threads fault in (zero) and then register with ``cudaHostRegister``: 15 GB/s on 4
threads alone (8.7 GB/s beside an OPT-13B prefill), exact sizes, and the GPU's queue does not wait.

The cache plans a multi-token step's blocks at its first layer (``HostBlocks.plan``); each pool
takes them as the forward reaches its layer (``take``), and a block nobody planned is made on the
spot. A dropped pool's blocks are retired, not freed: the next plan synchronises the device once
(no queued work may still read them), reuses those of the sizes it needs and unregisters the rest.
On the CPU a block is a plain tensor, made through the same path.

A process's first prompt still waits for its blocks to be pinned (a 32 GB pool: seconds).
``reserve_host_memory`` pins memory before any prompt exists, beside the model's loading, as a
server allocates its KV space at start-up: a few large regions registered on the workers, from which
blocks of any size are carved (and to which they return), so the first prefill runs as a later one does.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
import weakref
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

WORKERS = 4  # registration rate levels off beyond 4 threads (H100 host, 16 cores)
_REGISTER_MAPPED_PORTABLE = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped: the kernels read it by address

_executor: ThreadPoolExecutor | None = None
# reentrant: a pool's finaliser (``retire``) takes it, and garbage collection may run one on a thread
# that holds it already (inside a carve, say), where a plain lock would wait for itself
_lock = threading.RLock()
# blocks of dropped pools, (device, block) in the order dropped: put here by finalisers, which may run
# anywhere (inside a captured step too), and taken by the next ``HostBlocks.plan``
_retired: list[tuple[torch.device, torch.Tensor]] = []
# every block this process registered and has not unregistered, by data_ptr: held here so that its
# mapping outlives every other reference (unmapping registered pages would leave CUDA a registration
# that the next mapping at that address collides with) until ``release`` unregisters it
_registered: dict[int, torch.Tensor] = {}
# reserved regions (``reserve_host_memory``) by device, as they are made; and every block carved from one, by data_ptr
_reserved: dict[torch.device, list[Future]] = defaultdict(list)
_carved: dict[int, tuple[_Region, int, int]] = {}
PAGE = 4096  # carved blocks start on page boundaries, as mapped ones do


def _workers() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="infinigen-host-blocks")
        return _executor


def retire(blocks: list[torch.Tensor], device: torch.device) -> None:
    """Hand a dropped pool's blocks back (a finaliser: no CUDA call, no lock held for long)."""
    with _lock:
        _retired.extend((device, as_bytes(block)) for block in blocks)


def release_retired(device: torch.device) -> int:
    """Free the retired blocks of ``device`` now rather than at the next plan: before other work needs
    the host's memory (a baseline of a benchmark, say). Returns the bytes freed."""
    device = _indexed(device)
    with _lock:
        mine = [block for where, block in _retired if where == device]
        _retired[:] = [(where, block) for where, block in _retired if where != device]
    if mine and device.type == "cuda":
        torch.cuda.synchronize(device)  # no queued work may still read them
    for block in mine:
        release(block)
    return sum(block.numel() for block in mine)


def retired_bytes() -> int:
    """The bytes of dropped pools' blocks kept for the next plan (it reuses or frees them): memory a new
    pool can count on beside what the host has free."""
    with _lock:
        return sum(block.numel() for _, block in _retired)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current device): blocks are kept by the device they serve."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _retire_unused(spare: dict[int, list[torch.Tensor]], planned: dict[int, deque[Future]], device) -> None:
    """A dropped ``HostBlocks``' spare blocks and its planned ones never taken (a prefill that raised)."""
    retire([block for blocks in spare.values() for block in blocks], device)
    for futures in planned.values():
        for future in futures:
            future.add_done_callback(lambda done: done.exception() or retire([done.result()], device))


def _new_block(nbytes: int, device: torch.device) -> torch.Tensor:
    """A (nbytes,) uint8 block: carved from the device's reservation where one has room, else pinned
    and mapped for ``device`` on CUDA, plain memory on the CPU."""
    carved = _carve(nbytes, device)
    return carved if carved is not None else pinned_block(nbytes, device)


def pinned_block(nbytes: int, device: torch.device) -> torch.Tensor:
    """A (nbytes,) uint8 block of its own, of exactly ``nbytes`` (PyTorch's pinned allocator rounds up to a power
    of two): pinned and mapped for ``device`` on CUDA, plain memory on the CPU; ``release`` hands it back."""
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8)
    # A mapping of its own: page-aligned, so no two registrations share a page. Its pages are faulted
    # in here, on this worker: registering absent pages is 3-5x slower. (MAP_POPULATE instead made the
    # prefill slower still, 8 x 16K: 10.6 against 6.1 s, and OPT-13B's decode steps 3.6x slower.)
    block = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).zero_()
    torch.cuda.set_device(_indexed(device))  # register in this device's context, not device 0's
    if int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, _REGISTER_MAPPED_PORTABLE)) != 0:
        _clear_cuda_error()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # PyTorch's pinned allocator instead
    with _lock:
        _registered[block.data_ptr()] = block
    return block


def _clear_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error, which a failed cudaHostRegister leaves set and
    PyTorch's next kernel-launch check would raise (not Linux: the error stays, and PyTorch may raise it
    at the next launch)."""
    for library in _cuda_runtimes():
        library.cudaGetLastError()


_runtimes: list[ctypes.CDLL] = []


def _cuda_runtimes() -> list[ctypes.CDLL]:
    """The CUDA runtime libraries this process has loaded, for what PyTorch does not bind
    (cudaGetLastError, cudaMemcpy2DAsync); none off Linux or before CUDA is initialised."""
    if not _runtimes:
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
        except OSError:
            return []
        for path in paths:
            library = ctypes.CDLL(path)
            library.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t] * 2 + [ctypes.c_size_t] * 2
            library.cudaMemcpy2DAsync.argtypes += [ctypes.c_int, ctypes.c_void_p]
            _runtimes.append(library)
    return _runtimes


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def copy_runs(target: torch.Tensor, source: torch.Tensor) -> bool:
    """target <- source, both (B, H, ...) with each (batch row, head)'s elements contiguous and the runs
    a uniform pitch apart (a token range of pool blocks, on the host or the device): one DMA copy of B x H
    runs on the current stream (cudaMemcpy2DAsync), where ``copy_`` of a strided host tensor stages it in
    pageable memory and a copy per run costs its launch (an OPT-30B prefill of 30 x 1,920 tokens in
    128-token chunks issued ~10 M of them). False, nothing copied, where the layout or the library does
    not allow it."""
    runs = target.shape[0] * target.shape[1]
    width = target[0, 0].numel() * target.element_size()
    if target.shape != source.shape or target.dtype != source.dtype or not _uniform_runs(target, source):
        return False
    libraries = _cuda_runtimes()
    if not libraries:
        return False
    pitches = [_pitch(t, width) for t in (target, source)]
    stream = torch.cuda.current_stream(source.device if source.is_cuda else target.device).cuda_stream
    status = libraries[0].cudaMemcpy2DAsync(
        target.data_ptr(), pitches[0], source.data_ptr(), pitches[1], width, runs, _MEMCPY_DEFAULT, stream
    )
    if status != 0:
        _clear_cuda_error()
        return False
    return True


def _pitch(t: torch.Tensor, width: int) -> int:
    """Bytes from one (batch row, head) run of ``t`` to the next (``width``: a lone run's)."""
    if t.shape[1] > 1:
        return t.stride(1) * t.element_size()
    return t.stride(0) * t.element_size() if t.shape[0] > 1 else width


def _uniform_runs(*tensors: torch.Tensor) -> bool:
    """Each (batch row, head) run of every tensor contiguous, the runs one pitch apart (rows of one pitch
    per head, heads of a row after each other)."""
    for t in tensors:
        run = t[0, 0]
        if not run.is_contiguous() or (t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1)):
            return False
    return True


def release(block: torch.Tensor) -> None:
    """Unregister a block here, on the thread that plans (at a prefill, never inside a captured
    step), and unmap it on a worker (0.8 s for 8 GiB, against 0.15 s to unregister it)."""
    with _lock:
        carved = _carved.pop(block.data_ptr(), None)
        if carved is not None:
            region, offset, size = carved
            region.release(offset, size)
            return
        registered = _registered.pop(block.data_ptr(), None) is not None
    if registered:
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
    _workers().submit(lambda block: None, block)  # the worker drops the last reference: the unmap


class _Region:
    """One reserved region of host memory and its free byte ranges (offset -> size), first fit."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory  # (nbytes,) uint8, pinned and mapped on CUDA
        self.free = {0: memory.numel()}

    def take(self, size: int) -> int | None:
        """The offset of ``size`` bytes taken from the first free range that holds them, or None."""
        for offset, room in sorted(self.free.items()):
            if room >= size:
                del self.free[offset]
                if room > size:
                    self.free[offset + size] = room - size
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        """Give a range back, merged with the free ranges on either side."""
        following = self.free.pop(offset + size, 0)
        before = next((start for start, room in self.free.items() if start + room == offset), None)
        if before is None:
            self.free[offset] = size + following
        else:
            self.free[before] += size + following


def reserve_host_memory(nbytes: int, device: torch.device | str = "cuda", regions: int = WORKERS) -> list[Future]:
    """Start pinning ``nbytes`` of host memory for ``device``'s pools, as ``regions`` regions made on
    the worker threads at once (their registration rate adds up); returns at once. Blocks are carved
    from it from then on (a block waits for regions still being made rather than pin more), and go
    back to it when their pool is dropped; it stays pinned until the process ends. The futures
    resolve when each region is ready (``wait`` them to time it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = -(-nbytes // (regions * PAGE)) * PAGE  # whole pages, the total rounded up
    futures = [_workers().submit(lambda: _Region(pinned_block(size, device))) for _ in range(regions)]
    with _lock:
        _reserved[device].extend(futures)
    return futures


def _carve(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """A (nbytes,) view of the device's reservation with room for it, or None. Waits for regions being
    made, not for those still queued: a block made on a worker would then wait on work behind it."""
    with _lock:
        futures = list(_reserved.get(device, ()))
    size = -(-nbytes // PAGE) * PAGE
    for future in futures:
        if not (future.running() or future.done()) or future.exception() is not None:
            continue  # a region that could not be made (host memory short): blocks of their own instead
        region = future.result()
        with _lock:
            offset = region.take(size)
            if offset is not None:
                block = region.memory[offset : offset + nbytes]
                _carved[block.data_ptr()] = (region, offset, size)
                return block
    return None


def as_bytes(block: torch.Tensor) -> torch.Tensor:
    """The (nbytes,) uint8 view of a contiguous block of any shape and dtype."""
    return block.reshape(-1).view(torch.uint8)


class HostBlocks:
    """Where one cache's pool blocks come from (a block: ``nbytes`` of host memory, pinned on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device = _indexed(device)
        self.planned: dict[int, deque[Future]] = defaultdict(deque)  # by size, in the order planned
        self.spare: dict[int, list[torch.Tensor]] = defaultdict(list)  # blocks kept for reuse
        self.waited_s = 0.0  # time ``take`` waited for blocks still being pinned (a first prompt's)
        weakref.finalize(self, _retire_unused, self.spare, self.planned, device)  # when the cache goes

    def plan(self, sizes: list[int]) -> None:
        """Start making blocks of these sizes (in the order they will be taken) on the workers,
        reusing spare blocks of the same sizes; every other spare block is freed first."""
        self._recycle()
        reused = [self.spare[nbytes].pop() if self.spare[nbytes] else None for nbytes in sizes]
        for blocks in self.spare.values():  # the rest, freed before new blocks take the host's memory
            while blocks:
                release(blocks.pop())
        self.spare.clear()
        for nbytes, block in zip(sizes, reused, strict=True):
            if block is None:
                future = _workers().submit(_new_block, nbytes, self.device)
            else:
                future = Future()
                future.set_result(block)
            self.planned[nbytes].append(future)

    def take(self, nbytes: int) -> torch.Tensor:
        """A (nbytes,) uint8 block: the next planned one of this size, else a new one now."""
        start = time.perf_counter()
        planned = self.planned[nbytes]
        block = planned.popleft().result() if planned else _new_block(nbytes, self.device)
        self.waited_s += time.perf_counter() - start
        return block

    def settle(self) -> None:
        """Wait for every planned block (no registration may run while a step is captured) and keep
        the ones not taken for the next plan."""
        for nbytes, futures in self.planned.items():
            self.spare[nbytes].extend(future.result() for future in futures)
        self.planned.clear()

    @property
    def pending(self) -> int:
        return sum(len(futures) for futures in self.planned.values())

    def _recycle(self) -> None:
        """Make the process's retired blocks for this device spare, once no queued work can read them."""
        with _lock:
            mine = [block for device, block in _retired if device == self.device]
            _retired[:] = [(device, block) for device, block in _retired if device != self.device]
        if mine and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for block in mine:
            self.spare[block.numel()].append(block)
