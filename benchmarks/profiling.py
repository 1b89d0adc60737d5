"""What the profiling scripts share: replayed decode steps of ``infinigen`` under torch.profiler."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from infinigen.bench.runs import BenchCase, Decoder, make_cache
from infinigen.runtime.config import parse_value


def settings_from(arguments: list[str]) -> dict:
    """``RuntimeConfig`` fields given on a script's command line as FIELD=VALUE (``kv_bits=8``,
    ``resident_extra=2``, ``reuse_rows=on``); other arguments are the script's own."""
    return {name: parse_value(name, value) for name, value in (a.split("=", 1) for a in arguments if "=" in a)}


@torch.no_grad()
def decoded(
    model, artifact, batch: int, context: int, budget: float, gen_len: int = 8, **settings
) -> tuple[Decoder, float]:
    """``infinigen`` at ``budget`` (and ``settings``: further ``RuntimeConfig`` fields) after a prefill
    of ``batch`` x ``context`` random tokens and ``gen_len`` timed decode steps: the decoder, and the
    median step (ms)."""
    case = BenchCase("infinigen", batch, context, gen_len=gen_len, runtime={"budget": budget, **settings})
    decoder = Decoder(model, make_cache(model, artifact, case), case)
    decoder.prefill_seconds()
    step_ms = decoder.step_seconds() * 1e3
    torch.cuda.synchronize()
    return decoder, step_ms


def profiled_steps(
    model, artifact, batch: int, context: int, budget: float, steps: int, **settings
) -> tuple[float, profile]:
    """``decoded``, then ``steps`` more steps under the profiler (CUDA kernels only)."""
    decoder, step_ms = decoded(model, artifact, batch, context, budget, **settings)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            decoder.forward(decoder.token)
        torch.cuda.synchronize()
    return step_ms, profiler
