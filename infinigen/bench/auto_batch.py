"""``bench --sizes autoxN``: the batch the throughput plan chooses for each context (``runtime.memory.throughput``)
for the first policy of ours, and for accelerate's baselines the largest their cache leaves weights room for
(their best: their step is the host-mapped weights' copy)."""

from __future__ import annotations

from dataclasses import replace

import torch

from infinigen.bench import ACCELERATED
from infinigen.bench.hf_memory import accelerate_batch
from infinigen.errors import InfinigenError
from infinigen.models import parse_dtype
from infinigen.runtime.config import config_from
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.throughput import best_batch, measured_rates
from infinigen.runtime.selection.policies import POLICIES

AUTO = 0  # a --sizes batch the throughput plan chooses
# the new tokens an auto batch is planned for (the paper's generation length), whatever the steps timed: the
# plan weighs the prefill against them
AUTO_NEW_TOKENS = 128


def parse_sizes(text: str) -> list[tuple[list[int], list[int]]]:
    """--sizes 8x16384,1x131072 -> [([8], [16384]), ([1], [131072])]: each pair a sweep of its own; a batch
    ``auto`` is ``AUTO`` until the throughput plan sets it (``resolve``)."""
    pairs = []
    for pair in text.split(","):
        parts = [part.strip() for part in pair.lower().split("x")]
        auto = parts[:1] == ["auto"]
        if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts[auto:]):
            raise InfinigenError(
                f"--sizes takes comma-separated BATCHxCONTEXT pairs (8x16384, autox1920), got {text!r}"
            )
        pairs.append(([AUTO if auto else int(parts[0])], [int(parts[1])]))
    return pairs


def resolve(pairs: list, grid: list[dict], subject_config, dtype: str, device: str, budget, chunk):
    """``pairs`` with each ``auto`` batch set by the throughput plan (``memory.throughput``) for the grid's
    first policy of ours, at the pair's context, and what the plan estimated (the report's ``throughput``)."""
    if not any(AUTO in batches for batches, _ in pairs):
        return pairs, []
    ours = next((row for row in grid if row["policy"] in POLICIES), None)
    torch_dtype = parse_dtype(dtype, device)
    rates = measured_rates(torch.device(device), torch_dtype)
    if ours is None or rates is None or budget is None:
        raise InfinigenError("an auto batch needs a policy of ours, a CUDA device and a GPU budget to plan for")
    model, config = memory.model_of(subject_config, torch_dtype), config_from(ours)
    resolved, estimates = [], []
    for batches, (context,) in pairs:
        if AUTO in batches:
            work = memory.Workload(1, context, AUTO_NEW_TOKENS, chunk)
            best, _ = best_batch(model, torch_dtype, work, config, budget, rates)
            if best is None:
                raise InfinigenError(f"auto batch at context {context}: not even one row fits the GPU budget")
            batches = [best.batch if b == AUTO else b for b in batches]
            estimates.append({"policy": ours["policy"], "context": context} | best.estimates() | {"rates": vars(rates)})
        resolved.append((batches, [context]))
    return resolved, estimates


def measured_run(plan: dict, results: list[dict]) -> dict:
    """An auto batch's plan beside what its row measured, over the run it was planned for (its prefill and
    ``AUTO_NEW_TOKENS`` steps at the measured step): the estimate's check."""
    key = (plan["policy"], plan["batch"], plan["context"])
    row = next((r for r in results if (r["policy"], r["batch"], r["prompt_len"]) == key), None)
    if row is None or row.get("ms_per_step") is None:
        return plan
    run_s = row["prefill_s"] + AUTO_NEW_TOKENS * row["ms_per_step"] / 1e3
    return plan | {"measured_tokens_per_s": round(plan["batch"] * AUTO_NEW_TOKENS / run_s, 1)}


def baselines_at_their_batch(cases: list, throughput: list[dict], subject_config, dtype: str, device: str, budget):
    """``cases`` with each accelerate baseline of an auto size at its own best batch (``accelerate_batch``)
    instead of the plan's for ours; where not even one row fits, the case keeps its batch (its row says so)."""
    auto = {(entry["batch"], entry["context"]) for entry in throughput}
    model, torch_dtype = memory.Model(subject_config, 0), parse_dtype(dtype, device)
    for i, case in enumerate(cases):
        if case.policy in ACCELERATED and (case.batch, case.prompt_len) in auto and budget is not None:
            work = memory.Workload(case.batch, case.prompt_len, case.warmup + case.gen_len, case.prefill_chunk)
            best = accelerate_batch(model, torch_dtype, work, ACCELERATED[case.policy], budget)
            cases[i] = case if best is None else replace(case, batch=best)
    return cases
