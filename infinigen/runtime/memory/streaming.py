"""Streamed weights in the memory plan: which settings a run takes when its weights must stream (the plan's
last resort, ``least_moved``), and how many layers one loaded model streams for a sweep of runs
(``streamed_for``: what ``bench`` and ``eval`` load the model with).

A streamed layer's weights cross the bus at every forward: each prefill chunk and each decode step. So a
prefill chunk shed to fit the budget is paid for with the streamed layers once more per extra chunk (and
every later chunk reads the earlier ones' rows back from the pool), while a layer more on the bus costs
its bytes once per forward. ``least_moved`` takes each candidate setting (most asked first) at the fewest
streamed layers with which it fits and keeps the one that moves the fewest bytes over the run
(``run_bytes``); of those within ``TOLERANCE`` of the fewest, the most asked. Llama-3-70B at 8 x 8K on 80
GB: 256-token chunks with 43 layers streamed stream 73.6 GB 32 + 128 times (a 79 s prefill, H200); whole
4,096-token chunks with a few layers more stream it 2 + 128 times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from infinigen.errors import InfinigenError

TOLERANCE = 0.05  # bytes over the run within which the most asked setting is kept


def prefill_bytes(found) -> int:
    """The bytes a planned run's (``plan.MemoryPlan``) prefill moves host->device: the streamed layers at
    each chunk's forward and the earlier chunks' rows each later chunk reads again (about half the pool
    per chunk)."""
    work = found.workload
    forwards = math.ceil(work.context / work.chunk)
    pool = sum(p.nbytes for p in found.parts if p.name == "CPU KV pool")
    return _streamed(found) * forwards + pool * (forwards - 1) // 2


def run_bytes(found) -> int:
    """The bytes a planned run moves host->device that depend on its streamed layers and prefill chunk:
    the prefill's and the streamed layers at each new token's step. The rows a decode step fetches are
    left out: the same for every chunk."""
    return prefill_bytes(found) + _streamed(found) * found.workload.new_tokens


def _streamed(found) -> int:
    return (found.config.streamed_layers or 0) * found.model.layer_bytes


def streamed_for(model, dtype, runs: Sequence[tuple], budget: int | None):
    """The settings (a ``RuntimeConfig``, or None) with which one loaded model keeps decoder layers in host
    memory for every run of a sweep (``runs``: each a ``plan.Workload`` and its ``RuntimeConfig``, whose
    ``streamed_layers`` may be fixed). One count asked: it. Else, where the weights fit the budget, None: each
    run streams what it asks or its plan says, its layers moved out for its run alone. Else the most any run
    streams under ``budget``, runs of policies that offload the KV cache deciding where there are any
    (``dense``, the GPU-resident ideal, never makes theirs stream); for the policy that keeps the most layers
    ahead. Refuses, before anything loads, several counts where the weights do not fit, and weights that fit no
    way."""
    from infinigen.runtime.config import RuntimeConfig
    from infinigen.runtime.memory import plan  # which imports this module for its last resort
    from infinigen.runtime.memory.sizing import weights_ahead
    from infinigen.runtime.selection.policies import POLICIES

    asked = sorted({config.streamed_layers for _, config in runs} - {None})
    fits = budget is None or model.weight_bytes < budget
    if len(asked) > 1 and not fits:
        raise InfinigenError(
            f"streamed_layers takes one count where the weights ({plan.gb(model.weight_bytes)} GB) exceed the GPU "
            f"budget ({plan.gb(budget)} GB): the model loads once, those layers in host memory; got {asked}"
        )
    if len(asked) == 1:
        count = asked[0]
    elif fits:
        return None
    else:
        deciding = [(work, config) for work, config in runs if POLICIES[config.policy].offloads] or runs
        planned = (plan.plan(model, dtype, work, config, budget) for work, config in deciding)
        count = max(((found.config.streamed_layers or 0) if found.fits else 0 for found in planned), default=0)
        if not count:
            raise InfinigenError(
                f"the weights alone ({plan.gb(model.weight_bytes)} GB) exceed the GPU budget ({plan.gb(budget)} "
                "GB), and no run fits with any of their layers streamed from host memory"
            )
    policy = max((config.policy for _, config in runs), key=weights_ahead, default="full")
    return RuntimeConfig(policy=policy, streamed_layers=count) if count else None


def least_moved(candidates: Sequence[tuple], planned: Callable, layers: int):
    """Of ``candidates`` (``planned``'s arguments, most asked first), each planned at the fewest streamed
    layers (1 .. ``layers``) with which it fits, the one of fewest ``run_bytes`` (the most asked within
    ``TOLERANCE`` of them); None where none fits even with every layer streamed. Fitting is monotone in
    the streamed layers (each frees its GPU memory), so the fewest is a bisection."""
    found = []
    for candidate in candidates:
        if not planned(*candidate, layers).fits:
            continue
        low, high = 1, layers
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if planned(*candidate, middle).fits else (middle + 1, high)
        found.append(planned(*candidate, low))
    if not found:
        return None
    fewest = min(run_bytes(f) for f in found)
    return next(f for f in found if run_bytes(f) <= fewest * (1 + TOLERANCE))
