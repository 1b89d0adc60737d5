"""Needle in a haystack through the runtime: a secret code hidden in a long book passage, asked for at the end.

A prompt of ``length`` tokens is a passage of a book with the needle sentence inserted at a sentence
boundary near a token depth (0: the start, 1: just before the question), then the question. Trial
``t`` of every cell takes the ``t``-th passage: the books cut into consecutive ``length``-token
slices, book after book, so more books give more trials. The
passage is prefilled densely; the question is fed one token per decode step and the answer decoded
greedily, step by step, so the needle has to be fetched back from the CPU pool to be answered. Where
prompts are kept and answered one at a time, a passage's prompts run deepest needle first, each served
the passage before its own needle by the one before (a cold run's state there, to rounding).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.eval.decoding import auto_batch, greedy_after, planned
from infinigen.runtime import cache_for
from infinigen.runtime.cache.prompts import PromptCache
from infinigen.runtime.config import config_from
from infinigen.runtime.memory import plan as memory

NEEDLE = " The secret code is {code}."
QUESTION = "\n\nQuestion: What is the secret code?\nAnswer: The secret code is"
ANSWER_TOKENS = 6
SENTENCE_END = re.compile(r"[.!?][\"'”’)]*$")


@dataclass(frozen=True)
class NeedlePrompt:
    length: int
    depth: float
    trial: int
    code: str
    ids: list[int]  # the whole prompt, ``length`` tokens
    needle_start: int  # position of the needle's first token
    needle_end: int  # position after its last token
    question_start: int  # position of the question's first token: the dense prefill stops before it


def secret_code(length: int, depth: float, trial: int) -> str:
    """A 5-digit number, the same for the same cell and trial."""
    return str(random.Random(f"{length}:{depth}:{trial}").randint(10_000, 99_999))


def sentence_starts(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """Positions in ``ids`` where a sentence may start: 0, after each token ending a sentence, len(ids)."""
    pieces = tokenizer.batch_decode([[token] for token in ids])
    after_ends = [i + 1 for i, piece in enumerate(pieces[:-1]) if SENTENCE_END.search(piece.rstrip())]
    return [0, *after_ends, len(ids)]


def needle_prompt(
    tokenizer: PreTrainedTokenizerBase, text_ids: list[int], length: int, depth: float, trial: int = 0
) -> NeedlePrompt:
    """The prompt of one cell and trial; its passage is the start of ``text_ids`` (text tokenised
    without special tokens)."""
    if not 0 <= depth <= 1:
        raise InfinigenError(f"depths must be in [0, 1], got {depth}")
    code = secret_code(length, depth, trial)
    lead = tokenizer("").input_ids  # the special tokens the tokenizer puts before a text (BOS), if any
    needle = tokenizer(NEEDLE.format(code=code), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    passage_tokens = length - len(lead) - len(needle) - len(question)
    if passage_tokens < 1 or passage_tokens > len(text_ids):
        raise InfinigenError(f"the text has {len(text_ids)} tokens: too few for a prompt of {length}")
    passage = text_ids[:passage_tokens]
    target = depth * passage_tokens
    cut = min(sentence_starts(tokenizer, passage), key=lambda position: abs(position - target))
    ids = lead + passage[:cut] + needle + passage[cut:] + question
    needle_start = len(lead) + cut
    return NeedlePrompt(
        length, depth, trial, code, ids, needle_start, needle_start + len(needle), length - len(question)
    )


def passages(books: list[list[int]], length: int) -> list[list[int]]:
    """Each book's consecutive ``length``-token slices, book after book (a shorter tail is left out)."""
    return [book[start : start + length] for book in books for start in range(0, len(book) - length + 1, length)]


def needle_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], lengths: list[int], depths: list[float], trials: int
) -> list[NeedlePrompt]:
    """One prompt per length, depth and trial, from books' texts; trial ``t`` is the ``t``-th passage."""
    books = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    prompts = []
    for length in lengths:
        haystacks = passages(books, length)
        if len(haystacks) < trials:
            raise InfinigenError(
                f"the text holds {len(haystacks)} passages of {length} tokens: too few for {trials} trials"
            )
        prompts += [needle_prompt(tokenizer, haystacks[t], length, depth, t) for depth in depths for t in range(trials)]
    return prompts


def answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    prompts: list[NeedlePrompt],
    found: memory.MemoryPlan,
    kept: PromptCache | None = None,
) -> list[dict]:
    """Prompts of one length (no padding) through one fresh cache under the plan ``found`` (of the longest
    prompts), a row each: the greedy answer, whether it holds the code, the share of the cached tokens a step
    fetched (the batch's), the prompt tokens a kept prompt (``kept``, for one prompt) served."""
    if len({len(prompt.ids) for prompt in prompts}) != 1:
        raise ValueError("prompts answered together must have one length")
    cache = cache_for(model, artifact, plan=found, prompts=kept)
    ids = torch.tensor([prompt.ids for prompt in prompts], device=model.device)
    outputs = tokenizer.batch_decode(greedy_after(model, cache, ids, prompts[0].question_start, ANSWER_TOKENS))
    summary = cache.summary()
    fetched, served = summary["fraction_fetched"], summary["cached_tokens"]
    return [
        {
            "length": prompt.length,
            "depth": prompt.depth,
            "trial": prompt.trial,
            "needle_start": prompt.needle_start,
            "code": prompt.code,
            "output": output,
            "correct": prompt.code in output,
            "fraction_fetched": fetched,
            "cached_tokens": served,
        }
        for prompt, output in zip(prompts, outputs, strict=True)
    ]


def reuse_order(prompts: list[NeedlePrompt]) -> list[int]:
    """The order in which a kept prompt serves most of each next one: a passage's prompts deepest needle first,
    so that each is served the passage up to its own needle by the one before (an earlier needle would end the
    prefix they share). Indices into ``prompts``."""
    return sorted(range(len(prompts)), key=lambda i: (len(prompts[i].ids), prompts[i].trial, -prompts[i].depth))


def needle_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    prompts: list[NeedlePrompt],
    *,
    batch: int = 1,
    on_answer: Callable[[dict], None] = lambda answered: None,
    **settings,
) -> dict:
    """Accuracy per (length, depth) cell and overall; ``settings`` are ``RuntimeConfig`` fields. Prompts of
    one length are answered ``batch`` at a time through one cache (0: as many as ``auto_batch`` says for the
    longest). One at a time, where prompts are kept (``keeps_prompts``), each is served the passage before its
    needle by the prompt answered before it (``reuse_order``; ``cached_tokens``). ``on_answer`` gets each
    prompt's answer as it comes; the report holds them in the order of ``prompts``."""
    if batch < 0:
        raise InfinigenError(f"batch must be >= 0, got {batch}")
    longest = max(prompts, key=lambda prompt: len(prompt.ids))
    fed = len(longest.ids) - longest.question_start  # the question, one token a step, then the answer
    by_length: dict[int, list[NeedlePrompt]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt.ids), []).append(prompt)
    most = max(len(group) for group in by_length.values())
    rows = batch or auto_batch(model, settings, most, longest.question_start, fed + ANSWER_TOKENS)
    kept = PromptCache.of(config_from(settings), most=1) if rows == 1 else None  # the one before serves the next
    found = planned(model, settings, rows, longest.question_start, fed + ANSWER_TOKENS, keeps=kept is not None)
    if why := memory.why_not(found):
        raise InfinigenError(why)
    order = reuse_order(prompts) if kept is not None else list(range(len(prompts)))
    by_index: dict[int, dict] = {}
    for length in dict.fromkeys(len(prompts[i].ids) for i in order):  # batches with the longest plan's settings
        group = [i for i in order if len(prompts[i].ids) == length]
        for start in range(0, len(group), rows):
            indices = group[start : start + rows]
            rows_answered = answers(model, tokenizer, artifact, [prompts[i] for i in indices], found, kept)
            for i, row in zip(indices, rows_answered, strict=True):
                by_index[i] = row
                on_answer(row)
    answered = [by_index[i] for i in range(len(prompts))]
    cells: dict[tuple[int, float], list[bool]] = {}
    for a in answered:
        cells.setdefault((a["length"], a["depth"]), []).append(a["correct"])
    return {
        **settings,
        "batch": rows,
        "memory_plan": memory.summary(found),
        "accuracy": round(sum(a["correct"] for a in answered) / len(answered), 4),
        "fraction_fetched": round(sum(a["fraction_fetched"] for a in answered) / len(answered), 4),
        "cached_tokens": sum(a["cached_tokens"] for a in answered),  # of the prompts', from the one before
        "cells": [
            {"length": length, "depth": depth, "accuracy": round(sum(hits) / len(hits), 4), "trials": len(hits)}
            for (length, depth), hits in cells.items()
        ],
        "answers": answered,
    }
