"""What the profiling scripts share: replayed decode steps of ``infinigen`` under torch.profiler."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from infinigen.bench.runs import BenchCase, Decoder, make_cache


@torch.no_grad()
def decoded(model, artifact, batch: int, context: int, budget: float, gen_len: int = 8) -> tuple[Decoder, float]:
    """``infinigen`` at ``budget`` after a prefill of ``batch`` x ``context`` random tokens and
    ``gen_len`` timed decode steps: the decoder, and the median step (ms)."""
    case = BenchCase("infinigen", batch, context, budget=budget, gen_len=gen_len)
    decoder = Decoder(model, make_cache(model, artifact, case), case)
    decoder.prefill_seconds()
    step_ms = decoder.step_seconds() * 1e3
    torch.cuda.synchronize()
    return decoder, step_ms


def profiled_steps(model, artifact, batch: int, context: int, budget: float, steps: int) -> tuple[float, profile]:
    """``decoded``, then ``steps`` more steps under the profiler (CUDA kernels only)."""
    decoder, step_ms = decoded(model, artifact, batch, context, budget)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            decoder.forward(decoder.token)
        torch.cuda.synchronize()
    return step_ms, profiler
