"""One layer's speculation (``select_tokens``: 4-bit partial keys over 64 channels, i.e. ratio 0.5 of
head_dim 128, Llama-3-8B's 32 query / 8 KV heads), replayed from a CUDA graph as the runtime does:
the radix ``top_slots`` (count rule inside its passes) against PyTorch (the count's reductions,
top-k + sort), in one process, then a kernel profile of the radix path at 1 x 32K. Needs CUDA.
(BENCHMARKS.md, "Micro-benchmarks": the sort-free selection.)

    python benchmarks/selection_profile.py
"""

from __future__ import annotations

import functools
import math

import torch
from torch.profiler import ProfilerActivity, profile

import infinigen.runtime.policies.infinigen as speculation
from infinigen.bench.micro import captured_replay, device_ms
from infinigen.runtime import top_slots as selection
from infinigen.runtime.scoring import quantize_rows


def pytorch_top_slots(scores: torch.Tensor, rule: selection.CountRule, k_max: int, tile_max=None):
    """The selection before the radix select: the count by PyTorch reductions, top-k over the row,
    then a sort of the kept slots."""
    count = rule.counts(scores)
    return selection.first_ranks(scores.topk(k_max, dim=-1).indices, count, scores.shape[-1]), count


def inputs(batch: int, context: int):
    query = torch.randn(batch, 32, 64, device="cuda", dtype=torch.bfloat16)
    codes, scale = quantize_rows(torch.randn(batch, 8, context, 64, device="cuda", dtype=torch.bfloat16), 4)
    valid = torch.ones(batch, 8, context, dtype=torch.bool, device="cuda")
    return query, codes, scale, valid


def main() -> None:
    print(f"{'batch':>5} {'context':>7} {'budget':>6} {'pytorch ms':>10} {'radix ms':>9}")
    for batch, context in [(1, 4096), (1, 32768), (1, 131072), (8, 16384)]:
        query, codes, scale, valid = inputs(batch, context)
        for budget in (0.1, 0.2):
            k_max = math.ceil(budget * context)
            times = {}
            for name, implementation in [("pytorch", pytorch_top_slots), ("radix", selection.top_slots)]:
                speculation.top_slots = implementation  # what select_tokens calls
                rule = selection.CountRule(budget, math.inf, 8)
                select = functools.partial(speculation.select_tokens, query, codes, valid, k_max, rule, key_scale=scale)
                times[name] = device_ms(select, torch.device("cuda"))
            speculation.top_slots = selection.top_slots
            print(f"{batch:>5} {context:>7} {budget:>6} {times['pytorch']:>10.3f} {times['radix']:>9.3f}", flush=True)
    query, codes, scale, valid = inputs(1, 32768)
    rule = selection.CountRule(0.2, math.inf, 8)
    select = functools.partial(speculation.select_tokens, query, codes, valid, 6554, rule, key_scale=scale)
    replay = captured_replay(select)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
    events = profiler.key_averages()
    total = sum(e.self_device_time_total for e in events) / 10
    print(f"radix path, 1 x 32K, 20%: {total / 1e3:.3f} ms of kernels per call")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:16]:
        print(f"   {e.self_device_time_total / 10:8.1f} us  n={e.count // 10}  {e.key[:90]}")


if __name__ == "__main__":
    main()
