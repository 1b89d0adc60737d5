"""Decode-throughput benchmark: every policy through the same runtime path, on one card, in one run.

Random-weight models of known shapes are built directly on the device. Their attention is near
uniform; ``infinigen`` fetches its budget's share of the tokens there as on real weights (the
paper's alpha count only where given). A real model runs with its artifact, on prompts cut from a
text. The pinned host->device bandwidth is measured in the same
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
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from infinigen.artifacts import Artifact
from infinigen.bench import ACCELERATED, bounds
from infinigen.bench.accelerate_offload import accelerate_offloaded
from infinigen.errors import InfinigenError
from infinigen.prepare import DEFAULT_RATIO
from infinigen.runtime import POLICIES, InfinigenCache, RuntimeConfig, StepGraph, cache_argument
from infinigen.runtime.config import config_from
from infinigen.runtime.generation import prefill
from infinigen.runtime.memory import host_memory
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.plan import cache_settings
from infinigen.runtime.memory.throughput import host_to_device_gb_s
from infinigen.runtime.weights import layer_bytes, streamed_weights
from infinigen.tensor_parallel import together

GRAPHS = ("step", "selection", "off")  # BenchCase.graphs


def pinned_bandwidth(device: str, nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """GB/s of one large pinned host->device copy (median of ``repeats``); None without a GPU (no
    host->device link to measure; the reports stay strict JSON). Under torchrun every rank copies at
    once, as their gathers do (the host's links are shared): this rank's rate while all copy. 256 MiB:
    at the link's full rate already, and small beside a run's plan (measured after its weights load)."""
    if not device.startswith("cuda"):
        return None
    return host_to_device_gb_s(torch.device(device), nbytes, repeats, before=together)


@dataclass(frozen=True)
class BenchCase:
    policy: str  # a runtime policy, or one of transformers' caches (HF_BASELINES)
    batch: int
    prompt_len: int
    gen_len: int = 16
    warmup: int = 3
    # step: whole decode steps as CUDA graphs (``infinigen.decode``); selection: transformers' own
    # loop, each layer's selection a CUDA graph (plain ``model.generate``); off: no graphs
    graphs: str = "step"
    ratio: float = DEFAULT_RATIO  # the artifact's partial channels (speculating policies)
    # further RuntimeConfig fields (a ``settings_grid`` row; None: the field's default)
    runtime: dict = field(default_factory=dict)
    prefill_chunk: int | None = None  # the prompt's chunks, as ``generate`` prefills (None: one forward)
    plan: Any = field(default=None, compare=False, repr=False)  # the memory plan the cache runs (``planned_case``)
    accelerate_gpu_bytes: int | None = None  # hf-accelerate: the weights accelerate may map to the GPU

    def __post_init__(self) -> None:
        if self.graphs not in GRAPHS:
            raise InfinigenError(f"--graphs takes {', '.join(GRAPHS)}, got {self.graphs!r}")

    @property
    def ours(self) -> bool:
        return self.policy in POLICIES

    @property
    def config(self) -> RuntimeConfig:
        if self.plan is not None:
            return RuntimeConfig(**cache_settings(self.plan))
        return config_from({**self.runtime, "policy": self.policy, "cuda_graphs": self.graphs != "off"})


def bench_cases(
    settings: list[dict],
    batches: list[int],
    prompt_lens: list[int],
    gen_len: int,
    *,
    graphs: list[str] = ("step",),
    ratios: list[float] = (DEFAULT_RATIO,),
    prefill_chunk: int | None = None,
) -> list[BenchCase]:
    """Every context x batch x ``settings`` row (``settings_grid``: runtime sweeps already vary only
    the policies they change), times the graph modes (our caches) and the artifact ratios
    (speculating policies)."""
    cases = []
    for n, b, row in itertools.product(prompt_lens, batches, settings):
        policy = POLICIES.get(row["policy"])
        speculates = policy is not None and policy.speculates
        for graph, ratio in itertools.product(
            graphs if policy is not None else graphs[:1], ratios if speculates else ratios[:1]
        ):
            runtime = {key: value for key, value in row.items() if key != "policy"}
            case = BenchCase(row["policy"], b, n, gen_len, graphs=graph, ratio=ratio, runtime=runtime)
            cases.append(replace(case, prefill_chunk=prefill_chunk))
    return cases


def make_cache(model: PreTrainedModel, artifact: Artifact | None, case: BenchCase):
    cache = ACCELERATED.get(case.policy, case.policy)  # transformers' cache of an accelerate baseline
    if cache in ("hf-dynamic", "hf-offloaded"):
        return DynamicCache(config=model.config, offloading=cache == "hf-offloaded")
    return InfinigenCache(model, case.config, artifact, case.plan)


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
        if isinstance(cache, InfinigenCache):  # as ``infinigen.decode`` tells it: the run's length
            cache.expect(case.prompt_len + case.warmup + case.gen_len)

    def forward(self, ids: torch.Tensor) -> None:
        if self.step is None or ids.shape[1] > 1:
            logits = self.model(ids, **{self.name: self.cache}, logits_to_keep=1).logits[:, -1]
        else:
            self.position = self.position + 1
            logits = self.step(ids, self.position)
        self.token = logits.argmax(-1, keepdim=True)

    def prefill_seconds(self) -> float:
        """The prompt as ``generate`` feeds it: in chunks of ``case.prefill_chunk`` tokens."""
        _sync(self.device)
        start = time.perf_counter()
        mask = torch.ones_like(self.ids)
        self.token = prefill(self.model, self.cache, self.ids, mask, self.case.prefill_chunk).argmax(-1, keepdim=True)
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
    policy = POLICIES.get(case.policy)
    alpha = case.runtime.get("alpha")
    return {
        "policy": case.policy,
        "batch": case.batch,
        "prompt_len": case.prompt_len,
        **{name: value for name, value in case.runtime.items() if name != "alpha"},
        "graphs": case.graphs if case.ours else None,
        "ratio": case.ratio if policy is not None and policy.speculates else None,
        # None: the budget alone sets the count (the default); else the paper's count rule's alpha
        "alpha": alpha if alpha is not None and alpha < math.inf else None,
    }


def run_repeated(
    model: PreTrainedModel,
    artifact: Artifact | None,
    case: BenchCase,
    repeats: int = 1,
    text_ids: torch.Tensor | None = None,
) -> dict:
    """``run_case`` ``repeats`` times (each with its own cache and prefill): the median run's row
    (the lower median for an even count), with every run's ms per step in ``ms_per_step_runs`` and
    prefill seconds in ``prefill_s_runs``, in the order run (a process's first offloading cache makes
    its host blocks; later ones reuse them).
    A case that does not fit the GPU gives a row with ``error`` (see ``unless_out_of_memory``)."""

    def runs() -> dict:
        rows = [run_case(model, artifact, case, text_ids) for _ in range(repeats)]
        prefills = [r["prefill_s"] for r in rows]
        rows.sort(key=lambda r: r["ms_per_step"])
        median = rows[(len(rows) - 1) // 2]
        return median | {"ms_per_step_runs": [r["ms_per_step"] for r in rows], "prefill_s_runs": prefills}

    return unless_out_of_memory(runs, case, next(model.parameters()).device)


def unless_out_of_memory(run: Callable[[], dict], case: BenchCase, device: torch.device) -> dict:
    """``run()``, or where the case does not fit the GPU, its settings with ``error``: a sweep goes
    on past it (dense decoding is the ideal only where it fits). Likewise where one of transformers'
    caches refuses the setting (its offloaded cache needs CUDA): its error is that baseline's row."""
    try:
        return run()
    except torch.OutOfMemoryError as exc:
        wanted = re.search(r"allocate ([\d.]+ \w+)", str(exc))
        error = "out of GPU memory" + (f" allocating {wanted[1]}" if wanted else "")
    except Exception as exc:  # ours must not fail: only a baseline's failure is a result
        if case.ours:
            raise
        lines = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    # out of the handler: the traceback's frames are gone, and with them the case's tensors
    release_cached_memory(device)
    return case_settings(case) | {"error": error}


def release_cached_memory(device: torch.device, keep_pool_blocks: bool = True) -> None:
    """Between cases: the device's cached blocks, (torch >= 2.12) the pinned host blocks the last case's
    pool left cached, which would otherwise add up over a sweep's sizes, and unless ``keep_pool_blocks``
    (the next case's pool reuses them) the last pool's blocks: a baseline needs that host memory."""
    gc.collect()
    if not keep_pool_blocks:
        host_memory.release_retired(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def run_case(
    model: PreTrainedModel, artifact: Artifact | None, case: BenchCase, text_ids: torch.Tensor | None = None
) -> dict:
    if case.policy not in ACCELERATED:
        return _run_case(model, artifact, case, text_ids)
    device = next(model.parameters()).device
    gpu_bytes = case.accelerate_gpu_bytes
    if gpu_bytes is None:  # no budget: every weight the GPU's
        gpu_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the last pool's host blocks go before accelerate copies weights to the host: beside them (79 GB after
    # OPT-30B at 56 x 1,920, with 39 GB of streamed layers) its copies overran a 128 GB host
    release_cached_memory(device, keep_pool_blocks=False)
    with accelerate_offloaded(model, device, gpu_bytes) as device_map:
        row = _run_case(model, artifact, case, text_ids)
        on_host = [module for name, module in model.named_modules() if device_map.get(name) == "cpu"]
        # accelerate's hooks copy every host-mapped module's weights to the GPU at each forward
        crossing = sum(p.numel() * p.element_size() for module in on_host for p in module.parameters())
    return row | {"accelerate_host_modules": len(on_host), "streamed_weights_mb_per_step": round(crossing / 1e6, 3)}


def _peak_and_retries(device: torch.device) -> tuple[int, int]:
    """The most allocated since the last reset, and the caching allocator's retries so far (each freed its
    cached blocks, a device sync, to retry an allocation): a run at the edge of its memory."""
    return torch.cuda.max_memory_allocated(device), torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


@torch.no_grad()
def _run_case(
    model: PreTrainedModel, artifact: Artifact | None, case: BenchCase, text_ids: torch.Tensor | None = None
) -> dict:
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    release_cached_memory(device, keep_pool_blocks=case.ours)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    retries = _peak_and_retries(device)[1] if cuda else 0
    cache = make_cache(model, artifact, case)
    decoder = Decoder(model, cache, case, text_ids)
    prefill_s = decoder.prefill_seconds()
    prefill_peak, prefill_retries = _peak_and_retries(device) if cuda else (0, 0)
    # the prefill's re-reads of earlier chunks' rows are not a step's
    prefill_bytes = cache.summary()["bytes_host_to_device"] if case.ours else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_s = decoder.step_seconds()
    decode_peak, decode_retries = _peak_and_retries(device) if cuda else (0, 0)
    result = case_settings(case) | {
        "prefill_s": round(prefill_s, 3),
        "ms_per_step": round(step_s * 1e3, 2),
        "decode_tok_s": round(case.batch / step_s, 1),
        "prefill_peak_gpu_gb": round(prefill_peak / 1e9, 2) if cuda else None,
        # the timed steps; the warm-up's peak includes the first pool-block growth (a copy of the
        # growing GPU buffers, once per block of tokens)
        "decode_peak_gpu_gb": round(decode_peak / 1e9, 2) if cuda else None,
        "warmup_peak_gpu_gb": round(decoder.warmup_peak / 1e9, 2) if cuda else None,
        "alloc_retries": [prefill_retries - retries, decode_retries - prefill_retries] if cuda else None,
    }
    if case.ours:
        stats = cache.summary()
        steps = case.warmup + case.gen_len
        per_step = (stats["bytes_host_to_device"] - prefill_bytes) / steps
        result |= {
            "reuse": stats["reuse_rows"],  # what reuse_rows (auto by default) did, and why
            "fraction_fetched": stats["fraction_fetched"],
            "fraction_moved": stats["fraction_moved"],
            "fraction_attended": stats["fraction_attended"],
            "resident_extra_applied": stats["resident_extra"],
            "kv_bits_applied": stats["kv_bits"],  # the row format that ran (kv_bits: as asked)
            "resident_bits_applied": stats["resident_bits"],
            "fraction_bytes": stats["fraction_bytes"],
            "h2d_mb_per_step": round(per_step / 1e6, 3),
            "h2d_gb_s": round(per_step / step_s / 1e9, 1),
            # the compute stream's waits for rows: of the last replayed step where steps replay a graph
            "wait_ms_per_step": round(stats["prefetch_wait_ms"] / steps, 2)
            if stats["last_replay_wait_ms"] is None
            else round(stats["last_replay_wait_ms"], 2),
            "cpu_pool_gb": round(stats["cpu_pool_bytes"] / 1e9, 2),
            "host_block_wait_s": round(cache.host_blocks.waited_s, 3),  # for blocks being pinned (a first cache)
        }
    result |= _chip_work(model, case, result.get("fraction_attended"))
    if (streamed := streamed_weights(model)) is not None:  # every streamed layer crosses at every step
        crossing = sum(layer_bytes(block) for block in streamed.blocks)
        result["streamed_weights_mb_per_step"] = round(crossing / 1e6, 3)
    if case.ours:
        cache.close()  # its KV let go before weights it streamed go back to the GPU
    return result


def _chip_work(model: PreTrainedModel, case: BenchCase, attended: float | None) -> dict:
    """What the chip must do for the case's step and prefill (``bounds``): the step's device bytes and FLOP,
    the prefill's TFLOP."""
    dtype = next(model.parameters()).dtype
    subject = memory.model_of(model.config, dtype)
    policy = POLICIES.get(case.policy)
    dense_layers = case.config.dense_layers if policy is not None and policy.offloads else None
    work = bounds.step_work(subject, dtype, case.batch, case.prompt_len, dense_layers, attended or 1.0)
    return work | {"prefill_tflop": bounds.prefill_flop(subject, dtype, case.batch, case.prompt_len) / 1e12}


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
    for pool, *arguments in gathers:
        pool.gather(*arguments)
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


def case_label(case: BenchCase) -> str:
    """A bench case for a progress bar: policy (budget), batch x context."""
    budget = case.runtime.get("budget")
    return f"{case.policy}{'' if budget is None else f' {budget}'}, {case.batch} x {case.prompt_len}"


@dataclass
class Subject:
    """What a benchmark runs on: random weights of a known shape (their artifacts are calibrated per
    ratio on random tokens), or real weights with their checked artifact and prompts cut from a text."""

    model: PreTrainedModel
    shape: str | None  # random weights of this shape; None: real weights
    artifact: Artifact | None = None  # real weights: their checked artifact
    text_ids: torch.Tensor | None = None  # (T,) the text's tokens; None: random prompts


def load_subject(
    shape: str,
    model: str | None,
    artifact: str | None,
    text: str | None,
    device: str,
    dtype: str | None,
    layers: int | None = None,
    streamed: RuntimeConfig | None = None,
) -> Subject:
    """The model of a sweep: random weights of ``shape``, or ``model`` with its artifact and text; with
    ``streamed``, its streamed layers kept in host memory from the start."""
    from infinigen.artifacts import open_artifact, read_artifact
    from infinigen.bench.shapes import random_model
    from infinigen.eval.decoding import read_text
    from infinigen.models import load_model, parse_dtype

    if model is None:
        if artifact is not None or text is not None:
            raise InfinigenError("--artifact and --text go with --model (random shapes calibrate their own artifacts)")
        return Subject(random_model(shape, device, parse_dtype(dtype, device), layers, streamed), shape)
    if layers is not None:
        raise InfinigenError("--layers goes with --shape (a real model has its own layers)")
    read = read_artifact(artifact)  # refused before the weights load
    loaded = load_model(model, device=device, dtype=dtype, before_weights=lambda *_: streamed)
    checked = open_artifact(read, loaded.model) if read is not None else None
    text_ids = loaded.tokenizer(read_text(text), return_tensors="pt").input_ids[0] if text is not None else None
    return Subject(loaded.model, None, checked, text_ids)


def subject_artifacts(subject: Subject, cases: list[BenchCase]) -> dict[float, Artifact | None]:
    """The artifact of each ratio the cases run: calibrated for random weights, the checked one else."""
    from infinigen.bench.shapes import random_artifact

    ratios = sorted({case.ratio for case in cases})
    if subject.shape is not None:
        return {ratio: random_artifact(subject.model, subject.shape, ratio) for ratio in ratios}
    if subject.artifact is None and any(POLICIES[c.policy].speculates for c in cases if c.ours):
        raise InfinigenError("speculating policies need the model's artifact: pass --artifact")
    return dict.fromkeys(ratios, subject.artifact)
