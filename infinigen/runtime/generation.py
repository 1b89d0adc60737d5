"""Decode steps as CUDA graphs, the decoding loop that runs them for transformers' ``generate``, and
text in, text out (``generate_text``, what ``infinigen generate`` runs).

A decode step of a transformers model is a few thousand small kernels launched from Python: on a
fast GPU the host, not the GPU, sets the pace (BENCHMARKS.md, "Method"). ``StepGraph`` captures a
whole step (every layer, the selections, the prefetches on the transfer stream) once and replays
it: nothing in a step depends on the host while no buffer grows, because every layer writes its
token at the cache's device-side ``slot`` and attends through validity masks over fixed-size
buffers. When a buffer grows (once per pool block), the step runs eagerly and the next is captured
again.

    cache = infinigen.cache_for(model, budget=0.2)
    model.generate(**inputs, past_key_values=cache, custom_generate=infinigen.decode, max_new_tokens=64)
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from infinigen.errors import InfinigenError
from infinigen.runtime.cache import InfinigenCache
from infinigen.runtime.graphs import capture
from infinigen.runtime.streams import side_stream
from infinigen.tensor_parallel import weight_bytes


def cache_argument(model: PreTrainedModel) -> str:
    """The name ``model.forward`` / ``generate`` take a cache under: ``cache`` in newer transformers,
    ``past_key_values`` before (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StepGraph:
    """Runs decode steps (one token per row) of ``model`` with ``cache``; on CUDA, each step whose
    buffers have the capacities of the previous one replays that step's CUDA graph."""

    def __init__(self, model: PreTrainedModel, cache: InfinigenCache) -> None:
        self.model, self.cache = model, cache
        self.argument = cache_argument(model)
        self.signature: tuple | None = None  # the cache's step_signature the graph was captured at
        self.graph: torch.cuda.CUDAGraph | None = None
        # the graph's static inputs (B, 1), refilled before each replay, and its output (B, vocab)
        self.tokens: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.slot_range: torch.Tensor | None = None  # the shared arange the graph reads, kept alive with it
        self.stream = side_stream(cache.device, "capture") if cache.device.type == "cuda" else None

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions (B, 1) -> the next-token logits (B, vocab). On CUDA the logits are the
        graph's output buffer: read them before the next step."""
        cache = self.cache
        cache.driven = True
        try:
            cache.begin_decode_step()
            signature = cache.step_signature()
            if signature is None or signature != self.signature:
                self.graph, self.signature = None, signature  # a new capacity: run eagerly, capture next time
                return self._eager(tokens, positions)
            cached = cache.cached_tokens()
            captured = self.graph is None
            if captured:
                self.tokens, self.positions = tokens.clone(), positions.clone()
                self.graph, self.logits = self._capture()
            else:
                self.tokens.copy_(tokens)
                self.positions.copy_(positions)
            self.graph.replay()
            cache.replayed(cached, captured)
            return self.logits
        finally:
            cache.driven = False

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {self.argument: self.cache, "position_ids": positions, "use_cache": True, "logits_to_keep": 1}
        return self.model(tokens, **kwargs).logits[:, -1]

    def _eager(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return self._forward(tokens, positions)
        # on the capture stream, so that its lazy initialisation (cuBLAS workspaces) is done for the capture
        self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(self.stream):
            logits = self._forward(tokens, positions)
        torch.cuda.current_stream(self.cache.device).wait_stream(self.stream)
        return logits

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.cache.capturing, self.cache.step_wait_events = True, []
        self.slot_range = self.cache.slot_range
        try:
            return capture(lambda: self._forward(self.tokens, self.positions), self.stream)
        finally:
            self.cache.capturing = False


def prefill(
    model: PreTrainedModel, cache, ids: torch.Tensor, mask: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Feed the prompt ids (B, T), left-padded where ``mask`` (B, T) is 0, in chunks of ``chunk``
    tokens (None: at once): the next-token logits (B, vocab)."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    chunk, argument = chunk or ids.shape[1], cache_argument(model)
    for start in range(0, ids.shape[1], chunk):
        end = min(start + chunk, ids.shape[1])
        inputs = {"attention_mask": mask[:, :end], "position_ids": positions[:, start:end], "logits_to_keep": 1}
        logits = model(ids[:, start:end], **{argument: cache}, use_cache=True, **inputs).logits[:, -1]
    return logits


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    decode_streamer=None,
    **model_kwargs,
) -> torch.Tensor:
    """A ``custom_generate`` for transformers' ``generate``: greedy or sampled decoding with an
    ``InfinigenCache``, each decode step a ``StepGraph`` step. Returns the token ids (B, T + new).

    transformers (5.17 to 5.24 at least) hands a callable ``custom_generate`` only the prompt's
    ``streamer.put``, not the streamer: pass it as ``decode_streamer`` to stream the new tokens too."""
    cache = model_kwargs.get("past_key_values", model_kwargs.get("cache"))
    if not isinstance(cache, InfinigenCache):
        raise InfinigenError("infinigen.decode needs an InfinigenCache: pass the cache of infinigen.cache_for(model)")
    if generation_config.return_dict_in_generate:
        raise InfinigenError("infinigen.decode returns token ids only: leave return_dict_in_generate off")
    if decode_streamer is not None:
        streamer = decode_streamer
        streamer.put(input_ids.cpu())  # as generate does for its own loop
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    logits = prefill(model, cache, input_ids, mask, getattr(generation_config, "prefill_chunk_size", None))
    step = StepGraph(model, cache)
    position = (mask.long().sum(-1, keepdim=True) - 1).clamp(min=0)  # (B, 1) of the last prompt token
    pad = generation_config.pad_token_id
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    while True:
        scores = logits_processor(input_ids, logits.float())
        if generation_config.do_sample:
            tokens = torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0]
        else:
            tokens = scores.argmax(dim=-1)
        if pad is not None:
            tokens = torch.where(unfinished, tokens, pad)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(tokens.cpu())
        unfinished &= ~stopping_criteria(input_ids, scores)
        if not bool(unfinished.any()):
            break
        position = position + 1
        logits = step(tokens[:, None], position)
    if streamer is not None:
        streamer.end()
    return input_ids


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
    if max_new_tokens < 1:
        raise InfinigenError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompts or not all(p.strip() for p in prompts):
        raise InfinigenError("the prompt is empty")
    pad = pad_token_id(tokenizer)
    inputs = left_padded(tokenizer(prompts)["input_ids"], pad, model.device)  # the tokenizer left as it was
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
        raise InfinigenError(out_of_memory(model, cache, len(prompts), prompt_len + max_new_tokens)) from None
    texts = tokenizer.batch_decode(output[:, prompt_len:], skip_special_tokens=True)
    return texts, run_stats(cache, timer, len(prompts), prompt_len, output.shape[1] - prompt_len, model)


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
        "new_tokens": new_tokens,
        "prefill_tok_s": round(batch * prompt_len / prefill_s, 1) if prefill_s > 0 else None,
        "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 1) if decode_s > 0 else None,
        "budget": cache.config.budget if cache.policy_type.budgeted else None,
        "allocation": summary["allocation"],
        "reuse_rows": summary["reuse_rows"],  # whether rows stayed on the GPU, and why
        "fraction_fetched": summary["fraction_fetched"],
        "fraction_fetched_p95": max((v["fraction_p95"] for v in summary["per_layer"].values()), default=0.0),
        "fraction_moved": summary["fraction_moved"],  # below fraction_fetched where rows stay on the GPU
        "fraction_attended": summary["fraction_attended"],  # above it with rows of earlier steps (resident_extra)
        "resident_extra": summary["resident_extra"],
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
    }
