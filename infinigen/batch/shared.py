"""Batch-job requests that share a long prompt prefix (a document asked several questions, a long few-shot
preamble): the prefix is computed once, kept (``runtime.cache.kept``), and each request computes only the rest.

A group is every request whose first ``prefill_chunk`` tokens are the same as another's; its prefix, their
longest common one (each request goes at least two tokens past it: the rest is a prefill forward). The
prefix is prefilled alone, in the chunks a cold run takes, and each row then runs alone from it: a row's
state is a cold run's whose prefill stops at the prefix's end (to rounding, as a served prompt's, where
the prefix ends inside a chunk; 8-bit rows' channel factors come from the first chunk, which the prefix
holds whole). It depends on the row and the prefix alone, so a rerun of a stopped job gives the rows an
uninterrupted one does, whichever rows were done. A row alone gives up batching: on a GPU, where a step of
many rows costs about one row's, a group is formed only where the plan's estimates (``memory.throughput``)
say the prefill it saves outweighs the steps it adds; off one, always (5.3x on the CPU, BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import replace

from infinigen.runtime import cache_for
from infinigen.runtime.cache.prompts import PromptCache, keeps_prompts
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.throughput import prefill_estimate_ms, step_estimate_ms
from infinigen.runtime.text import generate_ids


def shared_groups(planner, prepared: list) -> tuple[list[list], list]:
    """The groups of ``prepared`` (``runner.Prepared``) that share a prefix, each row with its ``prefix``
    set, in input order; and the other requests. No groups where prompts are not kept (``keeps_prompts``) or are
    prefilled in one forward."""
    chunk = planner.prefill_chunk
    if not chunk or not keeps_prompts(planner.config):
        return [], prepared
    by_start: dict[tuple[int, ...], list] = {}
    for p in prepared:
        if len(p.ids) >= chunk + 2:
            by_start.setdefault(tuple(p.ids[:chunk]), []).append(p)
    groups, grouped = [], set()
    for members in by_start.values():
        if len(members) < 2:
            continue
        first = members[0].ids
        common = min(len(p.ids) for p in members) - 2
        for p in members[1:]:
            common = next((i for i in range(chunk, common) if p.ids[i] != first[i]), common)
        if not pays(planner, members, common):
            continue
        groups.append(sorted((replace(p, prefix=common) for p in members), key=lambda p: p.request.line))
        grouped.update(p.request.line for p in members)
    return groups, [p for p in prepared if p.request.line not in grouped]


def pays(planner, members: list, common: int) -> bool:
    """Whether ``members`` sharing ``common`` tokens take less time as a group than padded and batched, by
    the plan's estimates with the device's rates (``planner.rates``; None, off a GPU: always)."""
    rates = planner.rates
    if rates is None:
        return True
    rows, longest = len(members), max(len(p.ids) for p in members)
    new, chunk = max(p.new_tokens for p in members), planner.prefill_chunk
    batch = min(rows, planner.max_batch)
    batched = planner.plan(memory.Workload(batch, longest, new, chunk, True))
    alone = planner.plan(memory.Workload(1, longest, new, chunk, False, keeps=True))
    prefix = planner.plan(memory.Workload(1, common, 1, chunk, False, keeps=True))
    rest = planner.plan(memory.Workload(1, longest - common, 1, chunk, False, keeps=True))
    batched_ms = -(-rows // batch) * (prefill_estimate_ms(batched, rates) + new * step_estimate_ms(batched, rates))
    grouped_ms = prefill_estimate_ms(prefix, rates) + rows * (
        prefill_estimate_ms(rest, rates) + new * step_estimate_ms(alone, rates)
    )
    return grouped_ms < batched_ms


def group_plan(planner, group: list) -> memory.MemoryPlan:
    """The plan every run of a group takes (its prefix's and each row's: one prompt key): its longest
    row alone, for its most new tokens, with kept prompts' pool blocks."""
    longest = max(len(p.ids) for p in group)
    new_tokens = max(p.new_tokens for p in group)
    return planner.plan(memory.Workload(1, longest, new_tokens, planner.prefill_chunk, False, keeps=True))


def run_group(job, group: list, found: memory.MemoryPlan, sampling) -> list[tuple]:
    """The group's prefix computed and kept, then each row from it: (request, new tokens (1, n), stats)."""
    model, tokenizer, chunk = job.model, job.planner.tokenizer, found.workload.prefill_chunk or 0
    prompts = PromptCache(job.planner.config.prompt_cache_gb)

    def run(ids: list[int], new_tokens: int):
        with cache_for(model, job.artifact, plan=found) as cache:
            cache.prompts = prompts
            return generate_ids(
                model, tokenizer, [ids], cache, max_new_tokens=new_tokens, sampling=sampling, prefill_chunk=chunk
            )

    run(group[0].ids[: group[0].prefix], 1)  # kept after its first token
    prompts.read_only = True  # each row served the prefix alone, never another row's prompt
    return [(p, *run(p.ids, p.new_tokens)) for p in group]
