"""What the profiling scripts share: replayed decode steps of ``infinigen`` under torch.profiler."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from infinigen.bench import BenchCase, _Decoder, _make_cache


def profiled_steps(model, artifact, batch: int, context: int, budget: float, steps: int) -> tuple[float, profile]:
    """Prefill ``batch`` x ``context`` random tokens, time the median decode step (ms), then profile
    ``steps`` more steps (CUDA kernels only)."""
    case = BenchCase("infinigen", batch, context, budget=budget, gen_len=8)
    decoder = _Decoder(model, _make_cache(model, artifact, case), case)
    with torch.no_grad():
        decoder.prefill_seconds()
        step_ms = decoder.step_seconds() * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(steps):
                decoder.forward(decoder.token)
            torch.cuda.synchronize()
    return step_ms, profiler
