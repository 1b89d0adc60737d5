"""Needle in a haystack through the runtime: a secret code hidden in a long book passage, asked for at the end.

A prompt of ``length`` tokens is a passage of the book with the needle sentence inserted at a sentence
boundary near a token depth (0: the start, 1: just before the question), then the question. The
passage is prefilled densely; the question is fed one token per decode step and the answer decoded
greedily, step by step, so the needle has to be fetched back from the CPU pool to be answered.
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
from infinigen.evaluate import greedy_after
from infinigen.runtime import cache_for

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
    tokenizer: PreTrainedTokenizerBase, book_ids: list[int], length: int, depth: float, trial: int = 0
) -> NeedlePrompt:
    """The prompt of one cell and trial. Trial ``t`` takes its passage from token ``t * length`` of the
    book (``book_ids``: the book tokenised without special tokens)."""
    if not 0 <= depth <= 1:
        raise InfinigenError(f"depths must be in [0, 1], got {depth}")
    code = secret_code(length, depth, trial)
    lead = tokenizer("").input_ids  # the special tokens the tokenizer puts before a text (BOS), if any
    needle = tokenizer(NEEDLE.format(code=code), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    passage_tokens = length - len(lead) - len(needle) - len(question)
    start = trial * length
    if passage_tokens < 1 or start + passage_tokens > len(book_ids):
        raise InfinigenError(f"the text has {len(book_ids)} tokens: too few for trial {trial} at length {length}")
    passage = book_ids[start : start + passage_tokens]
    target = depth * passage_tokens
    cut = min(sentence_starts(tokenizer, passage), key=lambda position: abs(position - target))
    ids = lead + passage[:cut] + needle + passage[cut:] + question
    needle_start = len(lead) + cut
    return NeedlePrompt(
        length, depth, trial, code, ids, needle_start, needle_start + len(needle), length - len(question)
    )


def needle_prompts(
    tokenizer: PreTrainedTokenizerBase, text: str, lengths: list[int], depths: list[float], trials: int
) -> list[NeedlePrompt]:
    """One prompt per length, depth and trial, from a book's text."""
    book_ids = tokenizer(text, add_special_tokens=False).input_ids
    return [
        needle_prompt(tokenizer, book_ids, length, depth, trial)
        for length in lengths
        for depth in depths
        for trial in range(trials)
    ]


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    prompt: NeedlePrompt,
    settings: dict,
) -> dict:
    """One prompt through a fresh cache: the greedy answer, whether it holds the code, the fraction fetched."""
    cache = cache_for(model, artifact, **settings)
    ids = torch.tensor([prompt.ids], device=model.device)
    output = tokenizer.decode(greedy_after(model, cache, ids, prompt.question_start, ANSWER_TOKENS)[0])
    return {
        "length": prompt.length,
        "depth": prompt.depth,
        "trial": prompt.trial,
        "needle_start": prompt.needle_start,
        "code": prompt.code,
        "output": output,
        "correct": prompt.code in output,
        "fraction_fetched": cache.summary()["fraction_fetched"],
    }


def needle_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    prompts: list[NeedlePrompt],
    *,
    advance: Callable[[], None] = lambda: None,
    **settings,
) -> dict:
    """Accuracy per (length, depth) cell and overall; ``settings`` are ``RuntimeConfig`` fields.
    ``advance`` is called after each prompt."""
    answers = []
    for prompt in prompts:
        answers.append(answer(model, tokenizer, artifact, prompt, settings))
        advance()
    cells: dict[tuple[int, float], list[bool]] = {}
    for a in answers:
        cells.setdefault((a["length"], a["depth"]), []).append(a["correct"])
    return {
        **settings,
        "accuracy": round(sum(a["correct"] for a in answers) / len(answers), 4),
        "fraction_fetched": round(sum(a["fraction_fetched"] for a in answers) / len(answers), 4),
        "cells": [
            {"length": length, "depth": depth, "accuracy": round(sum(hits) / len(hits), 4), "trials": len(hits)}
            for (length, depth), hits in cells.items()
        ],
        "answers": answers,
    }
