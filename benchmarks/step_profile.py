"""Where a captured decode step's GPU time goes: kernel time per step by kernel name (torch.profiler
over replayed ``StepGraph`` steps), random-weight Llama-3-8B shape, bfloat16, ``infinigen`` at the
given budgets. The transfer stream's gather runs concurrently with the compute stream, so the
kernel times add up to more than the step. Needs CUDA.

    python benchmarks/step_profile.py 1 32768 0.2,0.1     # batch, context, budgets
    python benchmarks/step_profile.py 8 16384 0.1 kv_bits=8 resident_extra=2   # and RuntimeConfig fields
"""

from __future__ import annotations

import sys

import torch
from profiling import profiled_steps, settings_from

from infinigen.bench.shapes import random_artifact, random_model

STEPS = 5


def main(batch: int, context: int, budgets: list[float], settings: dict) -> None:
    model = random_model("llama-3-8b", "cuda", torch.bfloat16)
    artifact = random_artifact(model, "llama-3-8b", 0.5)
    for budget in budgets:
        step_ms, profiler = profiled_steps(model, artifact, batch, context, budget, STEPS, **settings)
        events = profiler.key_averages()
        total = sum(e.self_device_time_total for e in events) / STEPS / 1e3
        print(f"\n{batch} x {context}, infinigen {budget}: step {step_ms:.2f} ms (median), kernel time {total:.2f} ms")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:45]:
            print(f"  {e.self_device_time_total / STEPS / 1e3:8.3f} ms  n={e.count // STEPS:4d}  {e.key[:100]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [float(b) for b in sys.argv[3].split(",")], settings_from(sys.argv[4:]))
