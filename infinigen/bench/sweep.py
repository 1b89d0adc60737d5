"""``bench``'s sweep: each case as the memory plan runs it under the GPU budget (or the row saying why it
cannot run), in one process, after an untimed warm-up of the first case the plan accepts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from infinigen.artifacts import Artifact
from infinigen.bench import ACCELERATED, runs
from infinigen.bench.hf_memory import accelerate_least_room, accelerate_weight_room, hf_plan
from infinigen.bench.runs import BenchCase
from infinigen.runtime.memory import plan as memory


def planned_case(model: PreTrainedModel, case: BenchCase, budget: int | None) -> tuple[BenchCase, dict | None, dict]:
    """``case`` as the memory plan runs it, the row of a case the plan refuses (else None), and what the
    row says of the plan. transformers' caches are not planned on the GPU (where they do not fit, their
    error is their row), but the offloaded one's host memory is checked: the host's out-of-memory killer
    would end the whole run, not the case."""
    work = memory.Workload(case.batch, case.prompt_len, case.warmup + case.gen_len, case.prefill_chunk)
    subject, dtype = memory.Model(model.config, 0), next(model.parameters()).dtype
    if not case.ours:  # transformers' cache, or the one an accelerate baseline runs
        found = hf_plan(subject, dtype, work, ACCELERATED.get(case.policy, case.policy))
        if not memory.fits_host(found):
            return case, runs.case_settings(case) | {"error": _host_error(found)}, {}
        if case.policy not in ACCELERATED or budget is None:
            return case, None, {}
        # its weights: the budget less its KV and workspace (its best split)
        room = accelerate_weight_room(subject, dtype, work, ACCELERATED[case.policy], budget)
        if room < (least := accelerate_least_room(subject, dtype)):
            error = (
                f"does not fit: DynamicCache's KV and workspace need {memory.gb(found.peak_gpu)} GB of the budget, "
                f"leaving accelerate {memory.gb(max(room, 0))} GB of weights, less than the input embeddings and "
                f"its largest layer ({memory.gb(least)} GB): it would run every layer on the CPU"
            )
            return case, runs.case_settings(case) | {"error": error}, {}
        return replace(case, accelerate_gpu_bytes=room), None, {"accelerate_gpu_weights_gb": memory.gb(room)}
    found = memory.plan_for(model, case.config, work, budget)
    said = {"planned_peak_gpu_gb": memory.gb(found.peak_gpu), "given_up": "; ".join(found.shed) or None}
    if why := memory.why_not(found):
        return case, runs.case_settings(case) | {"error": why}, said
    planned = replace(case, plan=found, prefill_chunk=found.workload.prefill_chunk)
    return planned, None, said


def _host_error(found: memory.MemoryPlan) -> str:
    available = memory.gb(memory.host_available_bytes())
    return f"does not fit in host memory: its KV needs {memory.gb(found.host)} GB, {available} GB is available"


def run_sweep(
    model: PreTrainedModel,
    artifacts: dict[float, Artifact | None],
    cases: list[BenchCase],
    *,
    repeat: int = 1,
    text_ids: torch.Tensor | None = None,
    split: bool = False,
    on_case: Callable[[str], None] = lambda label: None,
    on_row: Callable[[dict], None] = lambda row: None,
    budget: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """Every case (``artifacts``: per ratio), then with ``split`` the ``breakdown`` of the offloaded
    ones: (result rows, breakdown rows). ``on_case`` hears each case as it starts, ``on_row`` each
    result row as it finishes. Our cases run as the memory plan under ``budget`` (GPU bytes) has them;
    one it cannot fit is a row with its reason."""
    device = next(model.parameters()).device
    # The first case of a process runs slower (one-time library and autotuning work, its first pool pinned):
    # an untimed short run goes first, of the first case the plan accepts, ours where there is one (a refused
    # first case must not leave the next to pay it all in its timed prefill)
    for candidate in sorted(cases, key=lambda case: not case.ours):
        first, refused, _ = planned_case(model, replace(candidate, gen_len=2, warmup=1), budget)
        if refused is None:
            warm = functools.partial(runs.run_case, model, artifacts[first.ratio], first, text_ids)
            runs.unless_out_of_memory(warm, first, device)
            break
    rows, splits = [], []
    for case in cases:
        on_case(runs.case_label(case))
        case, refused, planned = planned_case(model, case, budget)
        row = refused or runs.run_repeated(model, artifacts[case.ratio], case, repeat, text_ids)
        rows.append(row | planned)
        on_row(rows[-1])
    for case in cases if split else []:
        if case.policy in ("full", "infinigen"):
            on_case(f"{runs.case_label(case)}, breakdown")
            step = functools.partial(runs.breakdown, model, artifacts[case.ratio], case, text_ids)
            splits.append(runs.unless_out_of_memory(step, case, device))
    return rows, splits
