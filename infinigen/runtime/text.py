"""Text in, text out: ``generate_text`` (what ``infinigen generate`` runs) decodes a batch of prompts
through a cache with transformers' ``generate`` and ``runtime.generation.decode``, and reports the
run's speed and what the cache fetched; the padding helpers are shared with the evaluation clients."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from infinigen.errors import InfinigenError, OutOfMemory
from infinigen.runtime.cache import InfinigenCache
from infinigen.runtime.generation import cache_argument, decode
from infinigen.tensor_parallel import weight_bytes


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: greedy at temperature 0, else sampled."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise InfinigenError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InfinigenError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InfinigenError(f"top_k must be >= 0, got {self.top_k}")

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None}


class TokenTimer:
    """A generate() streamer: times the first token (end of prefill) and the last; optionally prints."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stream: bool) -> None:
        self.printer = TextStreamer(tokenizer, skip_prompt=True) if stream else None
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()
        self.last = time.perf_counter()
        if self.printer is not None:
            self.printer.put(value)

    def end(self) -> None:
        if self.printer is not None:
            self.printer.end()


def generate_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    cache: InfinigenCache,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    prefill_chunk: int = 4096,
    stream: bool = False,
) -> tuple[list[str], dict]:
    """Decode ``prompts`` as one batch (left-padded) through ``cache``: the new texts and the run's
    statistics. ``stream`` prints the tokens of a single prompt as they come."""
    if not prompts or not all(p.strip() for p in prompts):
        raise InfinigenError("the prompt is empty")
    new, stats = generate_ids(
        model,
        tokenizer,
        tokenizer(prompts)["input_ids"],  # the tokenizer left as it was: padding is ours
        cache,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        prefill_chunk=prefill_chunk,
        stream=stream,
    )
    return tokenizer.batch_decode(new, skip_special_tokens=True), stats


def generate_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    cache: InfinigenCache,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    prefill_chunk: int = 4096,
    stream: bool = False,
) -> tuple[torch.Tensor, dict]:
    """``generate_text`` on token ids: the new tokens (B, n <= max_new_tokens; a row that ended early is
    padded after its end of sequence) and the run's statistics."""
    if max_new_tokens < 1:
        raise InfinigenError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompts or not all(prompts):
        raise InfinigenError("the prompt is empty")
    pad = pad_token_id(tokenizer)
    inputs = left_padded(prompts, pad, model.device)
    prompt_len = inputs["input_ids"].shape[1]
    limit = model.config.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise InfinigenError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {limit} tokens"
        )
    pool_tokens = cache.pool_limit(len(prompts), model.dtype)
    if pool_tokens is not None and pool_tokens < prompt_len:
        raise InfinigenError(
            f"a CPU pool of {cache.config.cpu_pool_gb} GB holds {pool_tokens} tokens per sequence and layer, "
            f"fewer than the {prompt_len}-token prompt"
        )
    timer = TokenTimer(tokenizer, stream=stream and len(prompts) == 1)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    chunking = {"prefill_chunk_size": prefill_chunk} if 0 < prefill_chunk < prompt_len else {}
    output = None
    try:
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                **sampling.generate_kwargs(),
                custom_generate=decode,  # decode steps replayed as CUDA graphs
                decode_streamer=timer,
                pad_token_id=pad,
                **chunking,
                **{cache_argument(model): cache},
            )
    except torch.OutOfMemoryError:
        pass  # raised below, once the failed forward's tensors (its traceback's frames) are free
    if output is None:
        raise OutOfMemory(out_of_memory(model, cache, len(prompts), prompt_len + max_new_tokens))
    new = output[:, prompt_len:]
    return new, run_stats(cache, timer, len(prompts), prompt_len, new.shape[1], model)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads a batch: the tokenizer's pad token, else its end of sequence, else 0."""
    return next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)


def left_padded(ids: list[list[int]], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Token lists as one left-padded batch: ``input_ids`` and ``attention_mask`` (B, longest)."""
    longest = max(len(row) for row in ids)
    input_ids = torch.tensor([[pad] * (longest - len(row)) + row for row in ids], device=device)
    mask = torch.tensor([[0] * (longest - len(row)) + [1] * len(row) for row in ids], device=device)
    return {"input_ids": input_ids, "attention_mask": mask}


def out_of_memory(model: PreTrainedModel, cache: InfinigenCache, batch: int, tokens: int) -> str:
    """The one-line message for a device out-of-memory error, with the sizes involved."""
    spec = cache.spec  # under tensor parallelism, this rank's sizes: its KV heads, its weights' shards
    kv_per_layer = batch * cache.shard.kv_count * tokens * 2 * spec.head_dim * model.dtype.itemsize
    weights = weight_bytes(model)
    free, total = torch.cuda.mem_get_info(model.device) if model.device.type == "cuda" else (0, 0)
    gb = 1e9
    return (
        f"out of {model.device} memory: weights {weights / gb:.2f} GB, batch {batch} x {tokens} tokens, "
        f"KV {kv_per_layer / gb:.2f} GB per layer ({cache.n_offloaded} of {spec.n_layers} layers offloaded, "
        f"policy {cache.policy_type.name}); device free {free / gb:.2f} of {total / gb:.2f} GB: "
        "lower the batch, the prefill chunk or the budget, or use the infinigen policy"
    )


def run_stats(cache: InfinigenCache, timer: TokenTimer, batch: int, prompt_len: int, new_tokens: int, model) -> dict:
    prefill_s = (timer.first or timer.last) - timer.start
    decode_s = (timer.last - timer.first) if timer.first else 0.0
    summary = cache.summary()
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "cached_tokens": summary["cached_tokens"],  # of them, from a kept prompt (not computed)
        "new_tokens": new_tokens,
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "prefill_tok_s": round(batch * prompt_len / prefill_s, 1) if prefill_s > 0 else None,
        "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 1) if decode_s > 0 else None,
        "budget": cache.config.budget if cache.policy_type.budgeted else None,
        "allocation": summary["allocation"],
        "kv_bits": summary["kv_bits"],  # the rows' format in the CPU pool and over the bus
        "reuse_rows": summary["reuse_rows"],  # whether rows stayed on the GPU, and why
        "fraction_fetched": summary["fraction_fetched"],
        "fraction_fetched_p95": max((v["fraction_p95"] for v in summary["per_layer"].values()), default=0.0),
        "fraction_moved": summary["fraction_moved"],  # below fraction_fetched where rows stay on the GPU
        "fraction_attended": summary["fraction_attended"],  # above it with rows of earlier steps (resident_extra)
        "resident_extra": summary["resident_extra"],
        "resident_bits": summary["resident_bits"],  # of the rows kept on the GPU
        "bytes_host_to_device": summary["bytes_host_to_device"],
        "bytes_device_to_host": summary["bytes_device_to_host"],
        "prefetch_wait_ms": summary["prefetch_wait_ms"],  # eager steps only
        "graph_steps": summary["replayed_steps"],
        "last_graph_step_wait_ms": summary["last_replay_wait_ms"],
        "cpu_pool_bytes": summary["cpu_pool_bytes"],
        "evicted_tokens": summary["evicted_tokens"],
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated(model.device) / 1e9, 3)
        if model.device.type == "cuda"
        else None,
        "per_layer": summary["per_layer"],
    } | {k: v for k, v in summary.items() if k.startswith("exact_")}  # drafted, accepted, verifications
