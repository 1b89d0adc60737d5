"""Decode steps as CUDA graphs, and the decoding loop that runs them for transformers' ``generate``
(text in, text out on top of it: ``runtime.text``).

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

import torch
from transformers import PreTrainedModel

from infinigen.errors import InfinigenError
from infinigen.runtime import exact
from infinigen.runtime.cache import InfinigenCache
from infinigen.runtime.cache.graphs import capture
from infinigen.runtime.cache.kept import keep, restorable_rows, restore, restore_rows
from infinigen.runtime.cache.planning import plan_run
from infinigen.runtime.config import KEPT_CHUNK
from infinigen.runtime.memory.plan import Workload
from infinigen.runtime.streams import side_stream


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
    model: PreTrainedModel, cache, ids: torch.Tensor, mask: torch.Tensor, chunk: int | None = None, start: int = 0
) -> torch.Tensor:
    """Feed the prompt ids (B, T), left-padded where ``mask`` (B, T) is 0, from token ``start`` on (the cache
    holds the earlier ones), in chunks ending at multiples of ``chunk`` tokens (None: at once): the next-token
    logits (B, vocab). A prompt that starts from a kept one thus has the chunk boundaries a cold run has, after
    its first."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    chunk, argument = chunk or ids.shape[1], cache_argument(model)
    ends = [*range((start // chunk + 1) * chunk, ids.shape[1], chunk), ids.shape[1]]
    for begin, end in zip([start, *ends[:-1]], ends, strict=True):
        inputs = {"attention_mask": mask[:, :end], "position_ids": positions[:, begin:end], "logits_to_keep": 1}
        logits = model(ids[:, begin:end], **{argument: cache}, use_cache=True, **inputs).logits[:, -1]
    return logits


def served_prefill(
    model: PreTrainedModel, cache, ids: torch.Tensor, mask: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, bool]:
    """``prefill`` into the empty ``cache``, which, where it keeps prompts (``cache.prompts``) and ``ids`` is one
    unpadded row, first takes the longest kept prompt ``ids`` starts with (only the rest is computed): the
    next-token logits (B, vocab), and whether the prompt is to be kept (``keep(cache, ids[0])`` before any step;
    not where the prompts are read-only). A batch there is prefilled a row at a time (``rows_alone``), each row
    served and kept alone."""
    prompts = getattr(cache, "prompts", None)  # None: another cache (transformers' own, a baseline's)
    if rows_alone(model, cache, ids.shape[0]) and not cache.get_seq_length():
        return _rows_prefilled_alone(model, cache, ids, mask, chunk), False
    kept_here = prompts is not None and ids.shape[0] == 1 and bool(mask.all()) and not cache.get_seq_length()
    if kept_here:
        kept, served = prompts.match(cache.prompt_key, ids[0])
        if kept is not None:
            restore(cache, kept, served)
    logits = prefill(model, cache, ids, mask, chunk, start=cache.get_seq_length())
    return logits, kept_here and not prompts.read_only


def rows_alone(model: PreTrainedModel, cache, batch: int) -> bool:
    """Whether a batch's prompts are prefilled one row at a time (``_rows_prefilled_alone``): where ``cache`` keeps
    prompts and its policy and layers let kept rows start where a left-padded batch's do."""
    prompts = getattr(cache, "prompts", None)  # None: another cache (transformers' own, a baseline's)
    return batch > 1 and prompts is not None and restorable_rows(cache.config.policy, model.config)


def _rows_prefilled_alone(model: PreTrainedModel, cache, ids: torch.Tensor, mask: torch.Tensor, chunk) -> torch.Tensor:
    """Each row of ``ids`` (B, T), left-padded where ``mask`` is 0, prefilled alone in a cache of its own (served
    from a kept prompt, and kept unless the prompts are read-only), then all restored into ``cache`` as its rows
    (``kept.restore_rows``): each row's state and next-token logits (B, vocab) are those it has alone, whatever
    its batch-mates (padding moves no chunk boundary), and every row's prompt serves the next question. The
    prefill's workspace is one row's; the memory plan counts each row's kept copy on the host beside the pool."""
    rows, logits, served = [], [], []
    for row in range(ids.shape[0]):
        tokens = ids[row][mask[row].bool()]  # (n,): the row's own tokens
        with InfinigenCache(model, cache.config, cache.artifact, cache.memory_plan, cache.prompts) as alone:
            alone.expect(tokens.numel())
            row_logits, keeps = served_prefill(model, alone, tokens[None], torch.ones_like(tokens)[None], chunk)
            rows.append(keep(alone, tokens))
            served.append(alone.reused_tokens)
        if keeps:
            cache.prompts.add(rows[-1])
        logits.append(row_logits)
    restore_rows(cache, rows)
    cache.reused_rows, cache.reused_tokens = served, sum(served)
    return torch.cat(logits)


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
    if cache.config.exact:
        exact.check(model, cache, generation_config)
    cache.expect(generation_config.max_length)  # the prompt and every new token (generate has set it)
    # the whole run planned before the prefill: its chunk the plan's where none or a larger one is asked (with
    # kept prompts, whose key holds it, the one its plan has, else ``KEPT_CHUNK``)
    asked = getattr(generation_config, "prefill_chunk_size", None)
    if asked is None and cache.prompts is not None:  # the chunk its plan has, as the prompt key says
        asked = (cache.memory_plan.workload.prefill_chunk if cache.memory_plan is not None else None) or KEPT_CHUNK
    batch, context = input_ids.shape
    padded, keeps = not bool(mask.all()), cache.prompts is not None
    rowwise = rows_alone(model, cache, batch)
    work = Workload(batch, context, generation_config.max_length - context, asked, padded, keeps=keeps, rowwise=rowwise)
    chunk = plan_run(cache, work).workload.prefill_chunk
    cache.prefill_chunks = (asked, chunk)
    logits, keeps = served_prefill(model, cache, input_ids, mask, chunk)
    emit = Emitter(input_ids, logits_processor, stopping_criteria, generation_config, streamer)
    token = emit(logits)
    if keeps:  # after the first token is out (its copies are not on its path)
        cache.prompts.add(keep(cache, input_ids[0]))
    step = StepGraph(model, cache)
    position = (mask.long().sum(-1, keepdim=True) - 1).clamp(min=0)  # (B, 1) of the last prompt token
    if cache.config.exact and token is not None:  # drafted by the policy, verified over every row
        mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)  # the prompt's and the token's
        exact.cycles(model, cache, cache_argument(model), step, emit, mask, position, token)
    while not cache.config.exact and token is not None:
        position = position + 1
        token = emit(step(token[:, None], position))
    if streamer is not None:
        streamer.end()
    return emit.input_ids


class Emitter:
    """The decoding loop's work for each new token: ``emit(logits)`` (B, vocab) processes the scores, samples or
    takes the best, pads finished rows, appends, streams and asks the stopping criteria; the token (B,), or None
    once every row is done. ``live`` (B,): the rows unfinished before the latest token."""

    def __init__(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer) -> None:
        self.input_ids, self.processor, self.criteria = input_ids, logits_processor, stopping_criteria
        self.streamer = streamer
        self.sample, self.pad = generation_config.do_sample, generation_config.pad_token_id
        self.max_length = generation_config.max_length
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.live = self.unfinished

    def __call__(self, logits: torch.Tensor) -> torch.Tensor | None:
        scores = self.processor(self.input_ids, logits.float())
        tokens = torch.multinomial(scores.softmax(dim=-1), num_samples=1)[:, 0] if self.sample else scores.argmax(-1)
        if self.pad is not None:
            tokens = torch.where(self.unfinished, tokens, self.pad)
        self.input_ids = torch.cat([self.input_ids, tokens[:, None]], dim=-1)
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        self.live = self.unfinished  # replaced, not changed in place, below: no copy needed
        self.unfinished = self.unfinished & ~self.criteria(self.input_ids, scores)
        return tokens if bool(self.unfinished.any()) else None
