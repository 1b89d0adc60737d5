"""Throughput mode: the batch, and the decoder layers streamed for it, that decode the most tokens a second.

With weights streamed from host memory a decode step costs about the same for 1 row as for 100: the
streamed layers' bytes cross the bus once per step whatever the batch (FlexGen's observation), so large
batches pay. But each row's KV state and workspace take GPU memory that resident weights would otherwise
hold, so past some batch more layers must stream, and each streamed layer adds its bytes to every step.
``best_batch`` walks the streamed-layer counts from the fewest that fit, takes at each the largest batch
the memory plan admits (GPU and host), estimates its prefill and step and keeps the most new tokens a
second over the run (FlexGen's measure: a batch whose prefill chunks shrink to fit streams every layer
once more per chunk). The estimates are a model, stated: the larger of the bytes moved host->device at
the measured link rate and the device's own work (a step: every weight and GPU-resident KV read once at
the measured memory rate, or the weights' multiply-adds at the measured matmul rate, whichever is longer;
the prefill: the multiply-adds of every prompt token).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory import streaming
from infinigen.runtime.memory.pool import row_bytes
from infinigen.runtime.memory.sizing import offloaded_layer_indices, streamed_count
from infinigen.runtime.selection.policies import policy_class, row_bits

MOST_ROWS = 4096  # the largest batch searched
# of the host memory available when the batch is chosen, what the run leaves for the rest of its process: a
# batch chosen at 132.7 of 135 GB was refused once the weights had loaded (OPT-30B at 48 GB, H200)
HOST_MARGIN = 0.10


@dataclass(frozen=True)
class DeviceRates:
    """What a step's time is estimated from, measured on the device."""

    h2d_gb_s: float  # one large pinned host->device copy
    device_gb_s: float  # device memory traffic: a device-to-device copy's bytes read and written
    matmul_tflops: float  # one large matmul in the run's dtype


@dataclass(frozen=True)
class Candidate:
    plan: memory.MemoryPlan  # the largest batch at its streamed-layer count
    step_ms: float  # estimated (``step_estimate_ms``)
    prefill_ms: float = 0.0  # estimated (``prefill_estimate_ms``)

    @property
    def streamed_layers(self) -> int:
        return self.plan.config.streamed_layers or 0

    @property
    def batch(self) -> int:
        return self.plan.workload.batch

    @property
    def tokens_per_s(self) -> float:
        """New tokens a second over the run, its prefill included (as FlexGen counts its throughput); a
        decode step's alone where no new token is asked."""
        new = self.plan.workload.new_tokens
        if not new:
            return self.batch / self.step_ms * 1e3
        return self.batch * new / (self.prefill_ms + new * self.step_ms) * 1e3

    def estimates(self) -> dict:
        """What the plan proposes, for a report."""
        step, prefill = round(self.step_ms, 1), round(self.prefill_ms / 1e3, 2)
        return {"batch": self.batch, "streamed_layers": self.streamed_layers, "step_ms_estimate": step} | {
            "prefill_s_estimate": prefill,
            "tokens_per_s_estimate": round(self.tokens_per_s, 1),
        }


def _timed(run: Callable[[], object], device: torch.device, repeats: int, before: Callable[[], None]) -> float:
    """Seconds of ``run()`` on ``device``: the median of ``repeats`` after one warm-up."""
    cuda = device.type == "cuda"  # the CPU runs synchronously
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        before()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _copy_gb_s(source: torch.Tensor, target: torch.Tensor, repeats: int, before: Callable[[], None]) -> float:
    seconds = _timed(lambda: target.copy_(source, non_blocking=True), target.device, repeats, before)
    return source.nbytes / seconds / 1e9


def host_to_device_gb_s(
    device: torch.device, nbytes: int = 256 << 20, repeats: int = 5, before: Callable[[], None] = lambda: None
) -> float:
    """GB/s of one large pinned host->device copy (``before`` each: e.g. the ranks' barrier, so that every
    rank copies at once, as their gathers do). 256 MiB: at the link's full rate already, and handed back."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rate = _copy_gb_s(host, torch.empty(nbytes, dtype=torch.uint8, device=device), repeats, before)
    torch.cuda.empty_cache()  # the copy's block back to the device, not kept by the allocator
    return rate


def _matmul_tflops(matrix: torch.Tensor, repeats: int = 5) -> float:
    return 2 * matrix.shape[0] ** 3 / _timed(lambda: matrix @ matrix, matrix.device, repeats, lambda: None) / 1e12


def measured_rates(device: torch.device, dtype: torch.dtype, h2d_gb_s: float | None = None) -> DeviceRates | None:
    """The device's rates (``h2d_gb_s``: measured already by the caller), or None off CUDA. A 256 MiB
    device copy and a 4,096-square matmul: milliseconds, their memory handed back."""
    if device.type != "cuda":
        return None
    h2d = h2d_gb_s if h2d_gb_s is not None else host_to_device_gb_s(device)
    read, tflops = device_rates(device, dtype)
    torch.cuda.empty_cache()
    return DeviceRates(h2d, read, tflops)


def device_rates(device: torch.device, dtype: torch.dtype, nbytes: int = 256 << 20, square: int = 4096):
    """(GB/s of memory traffic: a device-to-device copy of ``nbytes``, which reads and writes each byte; TFLOP/s of
    a ``square``-sized matmul in ``dtype``) on ``device``, the CPU too. A step reads its weights and KV: at the
    traffic's rate (a dense step over 33 GB took 12.7 ms on an H200, where the copy's bytes one way gave 1.9 TB/s)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    traffic = 2 * _copy_gb_s(source, torch.empty_like(source), 5, lambda: None)
    return traffic, _matmul_tflops(torch.randn(square, square, device=device).to(dtype))


def step_floor_ms(
    plan_: memory.MemoryPlan, model: memory.Model, dtype: torch.dtype, bandwidth_gb_s: float | None
) -> float | None:
    """A decode step's lower bound from the host->device bytes it must move (``bandwidth_gb_s``, measured):
    the budget's share of every offloaded row (all of them for ``full``, none for ``dense``) and every
    streamed layer's weights."""
    if bandwidth_gb_s is None:
        return None
    policy = policy_class(plan_.policy)
    spec, work, config = model.spec, plan_.workload, plan_.config
    weights = streamed_count(config, spec.n_layers) * model.layer_bytes
    if not policy.offloads:
        return weights / (bandwidth_gb_s * 1e9) * 1e3
    offloaded = len(offloaded_layer_indices(model.windows, config.dense_layers, True))
    share = config.budget if policy.budgeted else 1.0
    rows = offloaded * work.batch * spec.n_kv_heads * math.ceil(share * work.tokens)
    nbytes = rows * row_bytes(spec.head_dim, dtype, policy.codec, row_bits(config)) + weights
    return nbytes / (bandwidth_gb_s * 1e9) * 1e3


def step_estimate_ms(found: memory.MemoryPlan, rates: DeviceRates) -> float:
    """A decode step's estimated time: what crosses the bus (``step_floor_ms``: streamed layers and
    fetched rows) overlapped with the device's work, the longer of reading every weight and the GPU's
    KV (dense layers, sliding windows) and the weights' multiply-adds for the batch."""
    model, dtype = found.model, found.dtype
    moved = step_floor_ms(found, model, dtype, rates.h2d_gb_s)
    on_gpu = {"dense layers' KV", "sliding windows' KV"}
    read = model.weight_bytes + sum(p.nbytes for p in found.parts if p.name in on_gpu)
    flops = 2 * model.weight_bytes / dtype.itemsize * found.workload.batch
    device = max(read / (rates.device_gb_s * 1e9), flops / (rates.matmul_tflops * 1e12)) * 1e3
    return max(moved, device)


def prefill_estimate_ms(found: memory.MemoryPlan, rates: DeviceRates) -> float:
    """The prefill's estimated time: the longer of what crosses the bus (``streaming.prefill_bytes``: each
    chunk streams every streamed layer, each later chunk reads the earlier ones' rows back) and the
    weights' multiply-adds for every prompt token."""
    model, work = found.model, found.workload
    moved = streaming.prefill_bytes(found) / (rates.h2d_gb_s * 1e9)
    flops = 2 * model.weight_bytes / found.dtype.itemsize * work.batch * work.context
    return max(moved, flops / (rates.matmul_tflops * 1e12)) * 1e3


def best_batch(
    model: memory.Model,
    dtype: torch.dtype,
    work: memory.Workload,
    config: RuntimeConfig,
    budget: int | None,
    rates: DeviceRates,
    most: int = MOST_ROWS,
    host_bytes: int | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """The candidate with the most estimated tokens a second for rows of ``work``'s context and new tokens
    (its batch ignored), and every candidate walked (one per streamed-layer count); None where not even
    one row fits. ``most``: the largest batch worth having (a job's requests); ``host_bytes``: the host
    memory a run may take (default: what is available now less ``HOST_MARGIN``)."""
    if host_bytes is None:  # less a tenth: the process's own (loading, CUDA's host allocations) beside the plan's
        available = memory.host_available_bytes()
        host_bytes = None if available is None else int(available * (1 - HOST_MARGIN))
    host = host_bytes

    def planned(batch: int, settings: RuntimeConfig) -> memory.MemoryPlan:
        return memory.plan(model, dtype, replace(work, batch=batch), settings, budget)

    def admitted(found: memory.MemoryPlan) -> bool:
        return found.fits and (host is None or found.host <= host)

    alone = planned(1, config)
    if not admitted(alone):
        return None, []
    fewest = alone.config.streamed_layers or 0
    counts = [fewest] if config.streamed_layers is not None or not model.layer_bytes else None
    candidates = []
    for streamed in counts or range(fewest, model.spec.n_layers + 1):
        settings = replace(config, streamed_layers=streamed)
        batch = memory.largest(lambda b, s=settings: admitted(planned(b, s)), 1, most)
        if batch < 1:
            continue
        found = planned(batch, settings)
        candidates.append(Candidate(found, step_estimate_ms(found, rates), prefill_estimate_ms(found, rates)))
    return max(candidates, key=lambda c: c.tokens_per_s, default=None), candidates
