"""Decode-throughput benchmark: every policy through the same runtime path, on one card, in one run.

Random-weight models of known shapes are built directly on the device. Their attention is near
uniform, so ``infinigen``'s token count then comes from the fixed budget (alpha = inf), as stated
in the output (``alpha``: None). A real model runs with its artifact and the paper's alpha (or the
one given), on prompts cut from a text. The pinned host->device bandwidth is measured in the same
process, so every transfer rate can be read as a share of the PCIe limit.
"""

from __future__ import annotations

import gc
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.prepare import DEFAULT_RATIO
from infinigen.runtime import POLICIES, InfinigenCache, RuntimeConfig, StepGraph, cache_argument, cache_for

HF_BASELINES = ("hf-dynamic", "hf-offloaded")  # transformers' own caches, for reference
BUDGETED = tuple(name for name, policy in POLICIES.items() if policy.budgeted)  # --budgets sweeps them
GRAPHS = ("step", "selection", "off")  # BenchCase.graphs
LOOKAHEAD = tuple(name for name, p in POLICIES.items() if p.offloads and p.lookahead)  # select one layer ahead
SPECULATING = tuple(name for name, policy in POLICIES.items() if policy.speculates)


def pinned_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """GB/s of one large pinned host->device copy (median of ``repeats``); None without a GPU (no
    host->device link to measure; the reports stay strict JSON)."""
    if not device.startswith("cuda"):
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


@dataclass(frozen=True)
class BenchCase:
    policy: str
    batch: int
    prompt_len: int
    gen_len: int = 16
    warmup: int = 3
    budget: float = 0.2
    alpha: float = math.inf  # speculation threshold; inf (random weights): the budget alone fixes the count
    # step: whole decode steps as CUDA graphs (``infinigen.decode``); selection: transformers' own
    # loop, each layer's selection a CUDA graph (plain ``model.generate``); off: no graphs
    graphs: str = "step"
    lookahead_from: str = "input"
    attention_lookahead_layers: int = RuntimeConfig.attention_lookahead_layers
    partial_key_bits: int = RuntimeConfig.partial_key_bits
    ratio: float = DEFAULT_RATIO  # the artifact's partial channels (speculating policies)
    reuse_rows: bool = RuntimeConfig.reuse_rows  # budgeted policies: rows stay on the GPU between steps

    def __post_init__(self) -> None:
        if self.graphs not in GRAPHS:
            raise InfinigenError(f"--graphs takes {', '.join(GRAPHS)}, got {self.graphs!r}")


def bench_cases(
    settings: list[dict],
    batches: list[int],
    prompt_lens: list[int],
    gen_len: int,
    *,
    graphs: tuple[str, ...] = ("step",),
    lookahead_from: tuple[str, ...] = ("input",),
    attention_lookahead_layers: tuple[int, ...] = (RuntimeConfig.attention_lookahead_layers,),
    partial_key_bits: tuple[int, ...] = (RuntimeConfig.partial_key_bits,),
    ratios: tuple[float, ...] = (DEFAULT_RATIO,),
    reuse_rows: tuple[bool, ...] = (RuntimeConfig.reuse_rows,),
) -> list[BenchCase]:
    """Every context x batch x policy setting; the runtime-option sweeps multiply only the policies
    they change (ratio and partial-key bits: speculating policies; lookahead_from and
    attention_lookahead_layers: offloading ones that select one layer ahead; reuse_rows: budgeted
    ones; graphs: our caches)."""
    cases = []
    for n, b, setting in itertools.product(prompt_lens, batches, settings):
        policy = POLICIES.get(setting["policy"])  # None: transformers' own caches
        speculates = policy is not None and policy.speculates
        looks_ahead = policy is not None and policy.offloads and policy.lookahead
        budgeted = policy is not None and policy.budgeted and policy.codec is None
        for ratio, bits, source, attention_layers, graph, reuse in itertools.product(
            ratios if speculates else ratios[:1],
            partial_key_bits if speculates else partial_key_bits[:1],
            lookahead_from if looks_ahead else lookahead_from[:1],
            attention_lookahead_layers if looks_ahead else attention_lookahead_layers[:1],
            graphs if policy is not None else graphs[:1],
            reuse_rows if budgeted else reuse_rows[:1],
        ):
            cases.append(
                BenchCase(
                    setting["policy"],
                    b,
                    n,
                    gen_len,
                    budget=setting["budget"],
                    alpha=setting.get("alpha", math.inf),
                    graphs=graph,
                    lookahead_from=source,
                    attention_lookahead_layers=attention_layers,
                    partial_key_bits=bits,
                    ratio=ratio,
                    reuse_rows=reuse,
                )
            )
    return cases


def make_cache(model: PreTrainedModel, artifact: Artifact | None, case: BenchCase):
    if case.policy == "hf-dynamic":
        return DynamicCache(config=model.config)
    if case.policy == "hf-offloaded":
        return DynamicCache(config=model.config, offloading=True)
    return cache_for(
        model,
        artifact,
        policy=case.policy,
        budget=case.budget,
        alpha=case.alpha,
        cuda_graphs=case.graphs != "off",
        lookahead_from=case.lookahead_from,
        attention_lookahead_layers=case.attention_lookahead_layers,
        partial_key_bits=case.partial_key_bits,
        reuse_rows=case.reuse_rows,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoder:
    """Drives one cache through a prefill and timed greedy decode steps (an ``InfinigenCache``'s
    through ``StepGraph`` where ``case.graphs`` is "step")."""

    def __init__(self, model: PreTrainedModel, cache, case: BenchCase, text_ids: torch.Tensor | None = None) -> None:
        self.model, self.cache, self.case = model, cache, case
        self.device = next(model.parameters()).device
        self.name = cache_argument(model)
        self.ids = prompt_ids(case.batch, case.prompt_len, model.config.vocab_size, text_ids).to(self.device)
        self.token = self.ids[:, -1:]
        self.position = torch.full((case.batch, 1), case.prompt_len - 1, device=self.device)
        self.step = StepGraph(model, cache) if isinstance(cache, InfinigenCache) and case.graphs == "step" else None

    def forward(self, ids: torch.Tensor) -> None:
        if self.step is None or ids.shape[1] > 1:
            logits = self.model(ids, **{self.name: self.cache}, logits_to_keep=1).logits[:, -1]
        else:
            self.position = self.position + 1
            logits = self.step(ids, self.position)
        self.token = logits.argmax(-1, keepdim=True)

    def prefill_seconds(self) -> float:
        _sync(self.device)
        start = time.perf_counter()
        self.forward(self.ids)
        _sync(self.device)
        return time.perf_counter() - start

    def step_seconds(self) -> float:
        """Median wall time of ``gen_len`` decode steps after ``warmup`` steps. On CUDA the peak
        memory counter restarts after the warm-up (``warmup_peak`` keeps the warm-up's peak)."""
        times = []
        self.warmup_peak = 0
        for step in range(self.case.warmup + self.case.gen_len):
            if step == self.case.warmup and self.device.type == "cuda":
                self.warmup_peak = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            _sync(self.device)
            start = time.perf_counter()
            self.forward(self.token)
            _sync(self.device)
            if step >= self.case.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)


def prompt_ids(batch: int, length: int, vocab_size: int, text_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, length) prompts: consecutive slices of a tokenized text (T,), row after row, the text
    repeated where it is short; random tokens (seeded) without one."""
    if text_ids is None:
        return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(batch * length).view(batch, length) % text_ids.numel()
    return text_ids[positions]


def case_settings(case: BenchCase) -> dict:
    """A result row's first columns: what the case ran (None where a setting does not apply)."""
    return {
        "policy": case.policy,
        "batch": case.batch,
        "prompt_len": case.prompt_len,
        "budget": case.budget if case.policy in BUDGETED else None,
        "graphs": case.graphs if case.policy not in HF_BASELINES else None,
        "lookahead_from": case.lookahead_from if case.policy in LOOKAHEAD else None,
        "attention_lookahead_layers": case.attention_lookahead_layers if case.policy in LOOKAHEAD else None,
        "partial_key_bits": case.partial_key_bits if case.policy in SPECULATING else None,
        "ratio": case.ratio if case.policy in SPECULATING else None,
        "reuse_rows": case.reuse_rows if case.policy in BUDGETED else None,
        # None: no threshold, the budget alone sets the count (random weights); else the count rule's alpha
        "alpha": case.alpha if case.policy in SPECULATING and case.alpha < math.inf else None,
    }


def run_repeated(
    model: PreTrainedModel,
    artifact: Artifact | None,
    case: BenchCase,
    repeats: int = 1,
    text_ids: torch.Tensor | None = None,
) -> dict:
    """``run_case`` ``repeats`` times (each with its own cache and prefill): the median run's row
    (the lower median for an even count), with every run's ms per step in ``ms_per_step_runs``.
    A case that does not fit the GPU gives a row with ``error`` (see ``unless_out_of_memory``)."""

    def runs() -> dict:
        rows = [run_case(model, artifact, case, text_ids) for _ in range(repeats)]
        rows.sort(key=lambda r: r["ms_per_step"])
        return rows[(len(rows) - 1) // 2] | {"ms_per_step_runs": [r["ms_per_step"] for r in rows]}

    return unless_out_of_memory(runs, case, next(model.parameters()).device)


def unless_out_of_memory(run: Callable[[], dict], case: BenchCase, device: torch.device) -> dict:
    """``run()``, or where the case does not fit the GPU, its settings with ``error``: a sweep goes
    on past it (dense decoding is the ideal only where it fits)."""
    try:
        return run()
    except torch.OutOfMemoryError as exc:
        wanted = re.search(r"allocate ([\d.]+ \w+)", str(exc))
        error = "out of GPU memory" + (f" allocating {wanted[1]}" if wanted else "")
    # out of the handler: the traceback's frames are gone, and with them the case's tensors
    _release_cached_memory(device)
    return case_settings(case) | {"error": error}


def _release_cached_memory(device: torch.device) -> None:
    """Between cases: the device's cached blocks, and (torch >= 2.12) the pinned host blocks the
    last case's pool left cached, which would otherwise add up over a sweep's sizes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()


@torch.no_grad()
def run_case(
    model: PreTrainedModel, artifact: Artifact | None, case: BenchCase, text_ids: torch.Tensor | None = None
) -> dict:
    device = next(model.parameters()).device
    _release_cached_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = make_cache(model, artifact, case)
    decoder = Decoder(model, cache, case, text_ids)
    prefill_s = decoder.prefill_seconds()
    prefill_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = decoder.step_seconds()
    result = case_settings(case) | {
        "prefill_s": round(prefill_s, 3),
        "ms_per_step": round(step_s * 1e3, 2),
        "decode_tok_s": round(case.batch / step_s, 1),
        "prefill_peak_gpu_gb": round(prefill_peak / 1e9, 2) if device.type == "cuda" else None,
        # the timed steps; the warm-up's peak includes the first pool-block growth (a copy of the
        # growing GPU buffers, once per block of tokens)
        "decode_peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
        if device.type == "cuda"
        else None,
        "warmup_peak_gpu_gb": round(decoder.warmup_peak / 1e9, 2) if device.type == "cuda" else None,
    }
    if case.policy not in HF_BASELINES:
        stats = cache.summary()
        steps = case.warmup + case.gen_len
        per_step = stats["bytes_host_to_device"] / steps
        result |= {
            "fraction_fetched": stats["fraction_fetched"],
            "fraction_bytes": stats["fraction_bytes"],
            "h2d_mb_per_step": round(per_step / 1e6, 3),
            "h2d_gb_s": round(per_step / step_s / 1e9, 1),
            # the compute stream's waits for rows: of the last replayed step where steps replay a graph
            "wait_ms_per_step": round(stats["prefetch_wait_ms"] / steps, 2)
            if stats["last_replay_wait_ms"] is None
            else round(stats["last_replay_wait_ms"], 2),
            "cpu_pool_gb": round(stats["cpu_pool_bytes"] / 1e9, 2),
        }
    del cache
    return result


@torch.no_grad()
def breakdown(
    model: PreTrainedModel, artifact: Artifact | None, case: BenchCase, text_ids: torch.Tensor | None = None
) -> dict:
    """Where an offloaded decode step's time goes: the step as is, the same step with the row moves
    skipped (compute only), one step's row moves replayed back to back (transfer only), and the
    step refetching each layer's previous selection instead of selecting (speculation included):
    the selection's share of the step is what that saves. (With row reuse a refetched selection
    moves nothing, so that share then counts the row moves too.)"""
    device = next(model.parameters()).device
    cache = make_cache(model, artifact, case)
    decoder = Decoder(model, cache, case, text_ids)
    decoder.prefill_seconds()
    full_step = decoder.step_seconds() * 1e3
    diagnostics = cache.diagnostics
    diagnostics.select_rows = False
    without_selection = decoder.step_seconds() * 1e3
    diagnostics.select_rows, diagnostics.move_rows = True, False
    compute_only = decoder.step_seconds() * 1e3
    diagnostics.move_rows, diagnostics.kept_gathers = True, []
    decoder.forward(decoder.token)
    gathers, diagnostics.kept_gathers = diagnostics.kept_gathers, None
    _sync(device)
    start = time.perf_counter()
    for pool, indices, count, out, destination in gathers:
        pool.gather(indices, count, out, destination)
    _sync(device)
    transfer_only = (time.perf_counter() - start) * 1e3
    return case_settings(case) | {
        "step_ms": round(full_step, 2),
        "compute_only_ms": round(compute_only, 2),
        "transfer_only_ms": round(transfer_only, 2),
        "step_over_max": round(full_step / max(compute_only, transfer_only), 3),
        "without_selection_ms": round(without_selection, 2),
        "selection_share": round(1 - without_selection / full_step, 3),
        # the same saving per offloaded layer: what speculating (or any policy's selecting) costs one
        # layer of a decode step in wall time, beside the compute
        "selection_ms_per_layer": round((full_step - without_selection) / max(cache.n_offloaded, 1), 4),
    }
