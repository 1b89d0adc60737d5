"""A batch job on one device: requests grouped into batches by the memory plan, each batch decoded through
a fresh cache and its results appended to the output before the next starts.

Batches are formed over every request of the input, done or not, in the same way every time (longest
prompt first; a batch grows while the plan admits one more row, up to ``max_batch``), and a rerun runs
only the batches that still have a request without a result, writing those results alone. So a job
stopped at any point and rerun gives exactly the rows of an uninterrupted run: each request is decoded
in the same batch, padded the same way. Requests that share a long prefix are one group, its prefix
computed once and each row run alone from it (``batch.shared``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infinigen.artifacts import Artifact
from infinigen.batch.records import Request, Work, append_rows, read_done
from infinigen.batch.shared import group_plan, run_group, shared_groups
from infinigen.errors import InfinigenError, OutOfMemory
from infinigen.runtime import cache_for
from infinigen.runtime.config import config_from
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.throughput import DeviceRates, best_batch, measured_rates
from infinigen.runtime.text import Sampling, generate_ids


@dataclass
class Planner:
    """What forms a job's batches, from the model's config alone (the same on a Ray driver without the
    weights as in the process that decodes): the tokenizer, the model's size, the settings and budget."""

    tokenizer: PreTrainedTokenizerBase
    model: memory.Model
    dtype: torch.dtype
    settings: dict = field(default_factory=dict)  # ``RuntimeConfig`` fields
    budget: int | None = None  # GPU bytes (``memory.budget_bytes``); None: no limit
    max_new_tokens: int = 64  # where a request gives none
    prefill_chunk: int | None = 4096  # None: a prompt in one forward
    max_batch: int = 64  # the most rows a batch takes, whatever the plan admits
    weights_loaded: bool = False  # planning beside the loaded model: its streamed layers' host memory is taken
    rates: DeviceRates | None = None  # the GPU's, measured, where a shared prefix's group must pay (``batch.shared``)

    def __post_init__(self) -> None:
        self.config = config_from(self.settings)
        if self.max_batch < 1 or self.max_new_tokens < 1:
            raise InfinigenError("the batch size and max_new_tokens must be at least 1")
        self.context = self.model.config.max_position_embeddings

    def plan(self, work: memory.Workload) -> memory.MemoryPlan:
        """The memory plan a batch of ``work`` runs in (a benchmark plans transformers' caches here)."""
        found = memory.plan(self.model, self.dtype, work, self.config, self.budget)
        return replace(found, weights_loaded=self.weights_loaded)


@dataclass
class Job:
    """A planner and what decodes: the model, its artifact, how tokens are chosen."""

    model: PreTrainedModel
    planner: Planner
    artifact: Artifact | None = None
    sampling: Sampling = Sampling()

    @classmethod
    def of(cls, model: PreTrainedModel, tokenizer, artifact: Artifact | None, settings: dict, **options) -> Job:
        """The job of a loaded model: its plan's budget (``budget``, else from ``gpu_memory_gb`` or the device's
        free memory) and ``Planner``'s other options."""
        sampling = options.pop("sampling", Sampling())
        param = next(model.parameters())
        if "budget" not in options:  # a Ray worker is given its driver's
            options["budget"] = memory.budget_bytes(config_from(settings).gpu_memory_gb, param.device)
        subject = memory.model_of(model.config, param.dtype)
        if "rates" not in options:
            options["rates"] = measured_rates(param.device, param.dtype)
        planner = Planner(tokenizer, subject, param.dtype, settings, weights_loaded=True, **options)
        return cls(model, planner, artifact, sampling)


@dataclass(frozen=True)
class Prepared:
    request: Request
    ids: list[int]
    new_tokens: int
    prefix: int = 0  # the tokens its group shares, computed once (``batch.shared``); 0: in no group


@dataclass
class Progress:
    """What a job has done so far (``run_job``'s report, updated after every batch)."""

    pending: int  # requests without a result when the job started
    done_before: int  # requests an earlier run finished
    written: int = 0
    errors: int = 0
    tokens: int = 0  # generated, over the rows written
    cached: int = 0  # prompt tokens of those rows served from a kept prefix (not computed)
    batches: int = 0
    split: int = 0  # rows of batches that ran out of memory and ran again in halves
    seconds: float = 0.0
    interrupted: bool = False

    def report(self) -> dict:
        return {
            "pending": self.pending,
            "done_before": self.done_before,
            "written": self.written,
            "errors": self.errors,
            "generated_tokens": self.tokens,
            "cached_tokens": self.cached,
            "batches": self.batches,
            "rows_split_after_out_of_memory": self.split,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None,
            "interrupted": self.interrupted,
        }


@dataclass
class Schedule:
    """What is left of a job: the batches (by index) with a request unwritten."""

    batches: list[tuple[int, list[Prepared]]]
    done_ids: set
    progress: Progress


def begin(planner: Planner, work: Work) -> Schedule:
    """The job's batches, formed over every request (done or not: the same batches every run), those with
    a request the output lacks; the error rows it lacks (bad lines, requests that cannot run) written."""
    done_ids, done_lines = read_done(work.output)
    prepared, refused = prepare(planner, work.requests)
    errors = [b.row() for b in work.bad if b.line not in done_lines]
    errors += [{"id": r.id, "error": message} for r, message in refused if r.id not in done_ids]
    batches, unfit = form_batches(planner, prepared)
    errors += [{"id": p.request.id, "error": message} for p, message in unfit if p.request.id not in done_ids]
    left = [(i, batch) for i, batch in enumerate(batches) if any(p.request.id not in done_ids for p in batch)]
    pending = sum(p.request.id not in done_ids for _, batch in left for p in batch)
    progress = Progress(pending=pending + len(errors), done_before=len(done_ids) + len(done_lines))
    append_rows(work.output, errors)
    progress.written = progress.errors = len(errors)
    return Schedule(left, done_ids, progress)


def record(output: Path, rows: list[dict], progress: Progress, done_ids: set, start: float) -> None:
    """Append a batch's rows (those not written before) and count them."""
    rows = [row for row in rows if row["id"] not in done_ids]
    append_rows(output, rows)
    progress.written += len(rows)
    progress.errors += sum("error" in row for row in rows)
    progress.tokens += sum(row.get("tokens", 0) for row in rows)
    progress.cached += sum(row.get("stats", {}).get("cached_tokens", 0) for row in rows)
    progress.batches += 1
    progress.split += sum("split_from" in row.get("stats", {}) for row in rows)
    progress.seconds = time.perf_counter() - start


def run_job(
    job: Job,
    work: Work,
    *,
    on_batch: Callable[[Progress], None] = lambda progress: None,
    stop: Callable[[], bool] = lambda: False,
) -> Progress:
    """Decode every request of ``work`` without a result in its output and append its row, a batch at a
    time; bad input lines become error rows first. ``on_batch`` hears the progress after each batch;
    ``stop()``, asked between batches, ends the job early (its results kept)."""
    left = begin(job.planner, work)
    start = time.perf_counter()
    for index, batch in left.batches:
        if stop():
            left.progress.interrupted = True
            break
        record(work.output, run_batch(job, batch, index), left.progress, left.done_ids, start)
        on_batch(left.progress)
    return left.progress


def prepare(planner: Planner, requests: list[Request]) -> tuple[list[Prepared], list[tuple[Request, str]]]:
    """Each request's prompt tokens and new tokens, or why it cannot run (too long for the model, a chat
    without the tokenizer's template)."""
    prepared, refused = [], []
    for request in requests:
        new_tokens = request.max_new_tokens or planner.max_new_tokens
        try:
            ids = prompt_ids(planner.tokenizer, request)
        except InfinigenError as exc:
            refused.append((request, str(exc)))
            continue
        if not ids:
            refused.append((request, "the prompt has no tokens"))
        elif len(ids) + new_tokens > planner.context:
            total = f"prompt ({len(ids)} tokens) + max_new_tokens ({new_tokens})"
            refused.append((request, f"{total} exceeds the model's context of {planner.context} tokens"))
        else:
            prepared.append(Prepared(request, ids, new_tokens))
    return prepared, refused


def weights_plan(settings: dict, requests: list[Request], **options) -> Callable:
    """``load_model``'s ``before_weights`` for a job: where the weights alone exceed the budget (or layers to
    stream are asked), the decoder layers to keep in host memory: on a GPU, throughput mode's (the count
    whose largest batch of the job's longest request decodes the most tokens/s, ``memory.throughput``),
    else the fewest with which that request runs alone; the rest of the model goes to the GPU, never all
    of it. None: every weight on the GPU."""

    def planned(config, tokenizer, dtype: torch.dtype, device: torch.device):
        asked = config_from(settings)
        budget = memory.budget_bytes(asked.gpu_memory_gb, device)
        planner = Planner(tokenizer, memory.model_of(config, dtype), dtype, settings, budget, **options)
        if asked.streamed_layers is None and (budget is None or planner.model.weight_bytes < budget):
            return None
        prepared, _ = prepare(planner, requests)
        if not prepared:
            return None
        longest = max(prepared, key=lambda p: len(p.ids) + p.new_tokens)
        work = memory.Workload(1, len(longest.ids), longest.new_tokens, planner.prefill_chunk)
        rates = measured_rates(device, dtype)
        if rates is not None:
            most = min(len(prepared), planner.max_batch)
            best, _ = best_batch(planner.model, dtype, work, planner.config, budget, rates, most)
            return None if best is None else best.plan.config
        found = planner.plan(work)
        return found.config if found.fits else None

    return planned


def prompt_ids(tokenizer: PreTrainedTokenizerBase, request: Request) -> list[int]:
    """The tokens the model reads: the prompt with the tokenizer's usual special tokens, or the messages
    in its chat template with the assistant's turn opened."""
    if request.prompt is not None:
        return tokenizer(request.prompt)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise InfinigenError("messages need a tokenizer with a chat template; this one has none (use prompt)")
    text = tokenizer.apply_chat_template(list(request.messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def batch_plan(planner: Planner, batch: list[Prepared]) -> memory.MemoryPlan:
    """The memory plan of a batch: its rows, padded to its longest prompt, for its most new tokens."""
    lengths = {len(p.ids) for p in batch}
    new_tokens = max(p.new_tokens for p in batch)
    return planner.plan(memory.Workload(len(batch), max(lengths), new_tokens, planner.prefill_chunk, len(lengths) > 1))


def form_batches(planner: Planner, prepared: list[Prepared]) -> tuple[list[list[Prepared]], list[tuple[Prepared, str]]]:
    """The batches, longest prompts first (little padding: neighbours have about the same length), each
    as large as the plan admits up to ``max_batch``; a request that does not fit alone, with why. Then the
    groups that share a prefix (``batch.shared``), each one batch whose rows run one at a time."""
    groups, prepared = shared_groups(planner, prepared)
    ordered = sorted(prepared, key=lambda p: (-len(p.ids), p.request.line))
    batches: list[list[Prepared]] = []
    unfit: list[tuple[Prepared, str]] = []
    for item in ordered:
        current = batches[-1] if batches else None
        if current is not None and len(current) < planner.max_batch and admits(batch_plan(planner, [*current, item])):
            current.append(item)
            continue
        alone = batch_plan(planner, [item])
        if admits(alone):
            batches.append([item])
        else:
            unfit.append((item, memory.why_not(alone)))
    for group in groups:
        found = group_plan(planner, group)
        if admits(found):
            batches.append(group)
        else:
            unfit += [(item, memory.why_not(found)) for item in group]
    return batches, unfit


def admits(found: memory.MemoryPlan) -> bool:
    """Whether a batch's plan fits the GPU budget and the host memory available."""
    return found.fits and memory.fits_host(found)


def run_batch(job: Job, batch: list[Prepared], index: int) -> list[dict]:
    """One batch through a fresh cache with its plan's settings (a group's rows one at a time from their
    kept prefix): a row per request (an error row each where the batch failed)."""
    found = group_plan(job.planner, batch) if batch[0].prefix else batch_plan(job.planner, batch)
    tokenizer, sampling = job.planner.tokenizer, job.sampling
    if job.model.device.type == "cuda":
        # batches differ in shape, and blocks the allocator cached for one fit the next badly (a batch of
        # 256 x 8K ran out of memory with 4.9 GB cached and idle): each batch starts from none cached
        torch.cuda.empty_cache()
    if sampling.seed is not None:  # each batch its own stream: a rerun samples a batch as the first run did
        sampling = replace(sampling, seed=sampling.seed + index)
    failure = None  # out of GPU memory: the plan's miss, not the requests'
    try:
        if batch[0].prefix:
            ran = run_group(job, batch, found, sampling)
            return [result_row(job, p, new[0].tolist(), stats, found, index) for p, new, stats in ran]
        with cache_for(job.model, job.artifact, plan=found) as cache:
            new, stats = generate_ids(
                job.model,
                tokenizer,
                [p.ids for p in batch],
                cache,
                max_new_tokens=max(p.new_tokens for p in batch),
                sampling=sampling,
                prefill_chunk=found.workload.prefill_chunk or 0,
            )
    except OutOfMemory as exc:
        failure = str(exc)
    except torch.OutOfMemoryError:  # making the cache itself
        failure = f"out of GPU memory making the cache of a batch of {len(batch)} x {found.workload.context} tokens"
    except InfinigenError as exc:
        return [{"id": p.request.id, "error": str(exc)} for p in batch]
    if failure is not None:
        # each half on its own, down to one row; only once the except clause is left, so that the failed
        # attempt's tensors (held by its traceback's frames) are free before the halves run
        if len(batch) == 1:
            return [{"id": batch[0].request.id, "error": failure}]
        halves = (batch[: len(batch) // 2], batch[len(batch) // 2 :])
        rows = [row for half in halves for row in run_batch(job, half, index)]
        for row in rows:
            row.setdefault("stats", {}).setdefault("split_from", len(batch))
        return rows
    return [result_row(job, p, tokens, stats, found, index) for p, tokens in zip(batch, new.tolist(), strict=True)]


def result_row(job: Job, p: Prepared, tokens: list[int], stats: dict, found: memory.MemoryPlan, index: int) -> dict:
    """A request's result row: its text up to its end of sequence, and the statistics of the run it was in."""
    tokenizer = job.planner.tokenizer
    tokens = tokens[: p.new_tokens]
    ends = end_tokens(job.model, tokenizer)
    stop = next((i for i, t in enumerate(tokens) if t in ends), None)
    kept = tokens if stop is None else tokens[: stop + 1]
    run = {
        "batch": stats["batch"],
        "batch_index": index,
        "batch_prefill_s": stats["prefill_s"],
        "batch_decode_s": stats["decode_s"],
        "batch_peak_gpu_gb": stats["peak_gpu_gb"],
        "batch_planned_gpu_gb": round(found.peak_gpu / 1e9, 3),
        "batch_prefill_tok_s": stats["prefill_tok_s"],
        "batch_decode_tok_s": stats["decode_tok_s"],
        "fraction_fetched": stats["fraction_fetched"],
    }
    return {
        "id": p.request.id,
        "text": tokenizer.decode(kept, skip_special_tokens=True),
        "tokens": len(kept),
        "finish_reason": "length" if stop is None else "stop",
        "stats": {"prompt_tokens": len(p.ids), "cached_tokens": stats["cached_tokens"]} | run,
    }


def end_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end a sequence: the generation config's and the tokenizer's end of sequence."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ends = set(configured if isinstance(configured, list) else [configured])
    ends.add(tokenizer.eos_token_id)
    ends.discard(None)
    return ends
