"""Accuracy through the real runtime: teacher-forced decoding scored token by token.

A window's prefix is prefilled densely; the rest is fed one true token at a time through the same
decode path that serves tokens (speculation, fetch, eviction), and each next token is scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infinigen.errors import InfinigenError
from infinigen.runtime import InfinigenCache, StepGraph, cache_argument, decode
from infinigen.runtime.cache.kept import keep
from infinigen.runtime.config import config_from
from infinigen.runtime.generation import served_prefill
from infinigen.runtime.memory import plan as memory

# Prefill in chunks of this many tokens: with a padding mask, SDPA materialises the scores of a
# chunk against the whole cache, (batch, heads, chunk, T) floats (a 16K window of 13 rows of a
# 14-head model unchunked: 139 GiB).
PREFILL_CHUNK = 2048
GUTENBERG = re.compile(r"\*\*\* ?START OF.*?\*\*\*(.*)\*\*\* ?END OF", re.S)


def read_text(path: str | Path) -> str:
    """A text file; a Project Gutenberg book loses its header and licence."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise InfinigenError(f"cannot read {path}: {exc}") from exc
    body = GUTENBERG.search(text)
    return body.group(1) if body else text


def windows(tokenizer: PreTrainedTokenizerBase, text: str, window: int, count: int) -> torch.Tensor:
    """The first ``count`` non-overlapping windows of ``window`` tokens: (count, window)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    available = ids.numel() // window
    if available == 0:
        raise InfinigenError(f"the text has {ids.numel()} tokens, fewer than one {window}-token window")
    count = min(count, available)
    return ids[: count * window].view(count, window)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


@torch.no_grad()
def dense_forward_nll(model: PreTrainedModel, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Reference: one full forward without a cache. (B, T - prefix) NLL of tokens prefix .. T-1."""
    logits = model(ids, use_cache=False).logits[:, prefix - 1 : -1]
    return _nll(logits, ids[:, prefix:])


def stepwise_logits(
    model: PreTrainedModel,
    cache,
    ids: torch.Tensor,
    prefix: int,
    attention_mask: torch.Tensor | None = None,
    step: StepGraph | None = None,
    chunk: int = PREFILL_CHUNK,
) -> Iterator[torch.Tensor]:
    """Prefill ids[:, :prefix] densely (in chunks of ``chunk`` tokens), then feed ids[:, prefix:]
    one token per decode step (a ``StepGraph``: CUDA graphs on CUDA); yields the next-token logits
    (B, V) after the prefill and after every step. ``attention_mask`` (B, T): 0 at left padding
    (positions then count real tokens only, as ``generate`` does)."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if isinstance(cache, InfinigenCache):  # as ``infinigen.decode`` tells it: the run's length
        cache.expect(ids.shape[1])
    logits, keeps = served_prefill(model, cache, ids[:, :prefix], mask[:, :prefix], chunk)
    if keeps:  # the prefilled prompt, for a later one that starts with it
        cache.prompts.add(keep(cache, ids[0, :prefix]))
    yield logits
    step = step or StepGraph(model, cache)
    for t in range(prefix, ids.shape[1]):
        yield step(ids[:, t : t + 1], positions[:, t : t + 1]).clone()  # the graph's buffer is reused


@torch.no_grad()
def teacher_forced_nll(
    model: PreTrainedModel,
    cache,
    ids: torch.Tensor,
    prefix: int,
    attention_mask: torch.Tensor | None = None,
    on_step: Callable[[], None] = lambda: None,
    chunk: int = PREFILL_CHUNK,
) -> torch.Tensor:
    """Through the runtime: prefill ids[:, :prefix] (in chunks of ``chunk``), then one true token per step
    (``on_step`` after each). (B, T - prefix)."""
    mask = None if attention_mask is None else attention_mask[:, :-1]
    nll = []  # each step's (B,) at once: the logits of a whole decode are (B, T - prefix, V), 32 GiB
    # for 16 rows of 2,048 steps over Gemma 3's 262K-token vocabulary
    steps = stepwise_logits(model, cache, ids[:, :-1], prefix, mask, chunk=chunk)
    for t, step_logits in enumerate(steps, start=prefix):
        nll.append(_nll(step_logits[:, None], ids[:, t : t + 1])[:, 0])
        on_step()
    return torch.stack(nll, dim=1)


Pairs = list[tuple[list[int], list[int]]]  # (context ids, continuation ids)


def continuation_logprobs(
    model: PreTrainedModel, cache, pairs: Pairs, pad: int, chunk: int = PREFILL_CHUNK
) -> list[float]:
    """log p(continuation | context) of each (context, continuation) pair (``continuation_scores``)."""
    return [logprob for logprob, _ in continuation_scores(model, cache, pairs, pad, chunk)]


def scoring_layout(pairs: Pairs) -> tuple[int, int, int]:
    """(prefix, offset, width) of ``pairs`` scored together (``continuation_scores``): the tokens
    prefilled, the column of each continuation's first scored token, the tokens of every row."""
    if not pairs or any(not context or not continuation for context, continuation in pairs):
        raise InfinigenError("scoring needs non-empty contexts and continuations")
    longest = max(len(context) for context, _ in pairs)
    # offset: the scored column of continuation_i's first token (column 0 predicts ids[:, prefix])
    offset = 1 if longest > 1 else 0
    if offset and any(len(context) < 2 for context, _ in pairs):
        raise InfinigenError(
            "next to longer contexts, a context needs at least 2 tokens (one-token contexts: a batch of their own)"
        )
    prefix = max(longest - 1, 1)
    return prefix, offset, prefix + offset + max(len(continuation) for _, continuation in pairs)


def scoring_plan(model: PreTrainedModel, settings: dict, pairs: Pairs, keeps: bool = False) -> memory.MemoryPlan:
    """The memory plan of scoring ``pairs`` together under ``settings``' GPU budget (``keeps``: the prompt
    kept); refuses in one line (``InfinigenError``) where it does not fit."""
    prefix, _, width = scoring_layout(pairs)
    found = planned(model, settings, len(pairs), prefix, width - 1 - prefix, keeps=keeps)
    if why := memory.why_not(found):
        raise InfinigenError(why)
    return found


@torch.no_grad()
def continuation_scores(
    model: PreTrainedModel, cache, pairs: Pairs, pad: int, chunk: int = PREFILL_CHUNK
) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding yields the continuation) of each
    (context, continuation) pair, all decoded together as one batch through the runtime. Row i: left
    padding, context_i but its last token (prefilled densely), then its last token and continuation_i
    (one decode step each, so a sparse step predicts every continuation token), then right padding
    (after the scored tokens: it changes none of them).

    Contexts of one token are scored in batches of their own (the prefill is then that token): a row
    of padding alone in a prefill would attend to nothing."""
    prefix, offset, width = scoring_layout(pairs)
    rows, masks = [], []
    for context, continuation in pairs:
        left = prefix + offset - len(context)
        rows.append([pad] * left + context + continuation + [pad] * (width - left - len(context) - len(continuation)))
        masks.append([0] * left + [1] * (width - left))
    ids, mask = (torch.tensor(t, device=model.device) for t in (rows, masks))
    targets = ids[:, prefix:]
    # one step's log-probabilities at a time: (B, V) per step, never (B, T, V)
    logprobs, greedy = [], []
    for logits in stepwise_logits(model, cache, ids[:, :-1], prefix, mask[:, :-1], chunk=chunk):
        column = len(logprobs)
        logits = logits.float()
        logprobs.append(logits.log_softmax(-1).gather(-1, targets[:, column : column + 1])[:, 0])
        greedy.append(logits.argmax(-1) == targets[:, column])
    logprob, matches = torch.stack(logprobs, dim=1).cpu(), torch.stack(greedy, dim=1).cpu()
    scores = []
    for i, (_, continuation) in enumerate(pairs):
        scored = slice(offset, offset + len(continuation))
        scores.append((float(logprob[i, scored].sum()), bool(matches[i, scored].all())))
    return scores


@torch.no_grad()
def greedy_after(model: PreTrainedModel, cache, ids: torch.Tensor, prefix: int, new_tokens: int) -> torch.Tensor:
    """Through the runtime: prefill ids[:, :prefix], feed the rest one token per decode step, then
    decode ``new_tokens`` greedy tokens one per step. (B, new_tokens). Under ``exact`` decoding the whole of
    ids is the prompt and the tokens are drafted and verified (``infinigen.decode``): dense decoding's."""
    if cache.config.exact:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,  # every token, as the steps below give them
            pad_token_id=0,
            custom_generate=decode,
            **{cache_argument(model): cache},
        )
        return out[:, ids.shape[1] :]
    step = StepGraph(model, cache)  # one graph for the fed and the generated tokens
    cache.expect(ids.shape[1] + new_tokens)
    *_, logits = stepwise_logits(model, cache, ids, prefix, step=step)
    tokens = [logits.argmax(-1, keepdim=True)]
    position = torch.full_like(tokens[0], ids.shape[1] - 1)
    for _ in range(new_tokens - 1):
        position = position + 1
        tokens.append(step(tokens[-1], position).argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def auto_batch(model: PreTrainedModel, settings: dict, most: int, prefix: int, new_tokens: int) -> int:
    """The rows to decode together with ``settings`` (``--batch 0``), at most ``most``: on a GPU under a budget,
    throughput mode's (the most estimated tokens a second, ``memory.throughput``) at the layers the model streams
    as loaded; elsewhere the most the memory plan (GPU and host) admits; 1 where none fits (its row says why)."""
    from infinigen.runtime.memory.throughput import best_batch, measured_rates

    param = next(model.parameters())
    config = config_from(settings)
    budget = memory.budget_bytes(config.gpu_memory_gb, param.device)
    rates = measured_rates(param.device, param.dtype) if budget is not None else None
    if rates is not None:
        subject, work = memory.loaded_model(model), memory.Workload(1, prefix, new_tokens, PREFILL_CHUNK)
        best, _ = best_batch(subject, param.dtype, work, config, budget, rates, most)
        return 1 if best is None else best.batch

    def admitted(batch: int) -> bool:
        return memory.why_not(planned(model, settings, batch, prefix, new_tokens)) is None

    return max(1, memory.largest(admitted, 1, most))


def planned(
    model: PreTrainedModel,
    settings: dict,
    batch: int,
    prefix: int,
    new_tokens: int,
    chunk: int | None = PREFILL_CHUNK,
    keeps: bool = False,
) -> memory.MemoryPlan:
    """The memory plan of ``batch`` rows prefilled with ``prefix`` tokens (in chunks of ``chunk``; None: at
    once), then ``new_tokens`` decode steps, with ``settings`` (``RuntimeConfig`` fields), under their
    GPU budget; ``keeps``: their prompts are kept (``Workload.keeps``)."""
    config = config_from(settings)
    budget = memory.budget_bytes(config.gpu_memory_gb, next(model.parameters()).device)
    return memory.plan_for(model, config, memory.Workload(batch, prefix, new_tokens, chunk, keeps=keeps), budget)
