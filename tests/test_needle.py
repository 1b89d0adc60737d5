"""Needle in a haystack: the prompt generator puts the needle where it says; greedy decoding through the runtime."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXACT, tiny_setup

from infinigen.errors import InfinigenError
from infinigen.eval.decoding import greedy_after
from infinigen.eval.needle import (
    NEEDLE,
    QUESTION,
    SENTENCE_END,
    needle_accuracy,
    needle_prompt,
    needle_prompts,
    passages,
    secret_code,
)
from infinigen.prepare.calibration import bundled_text
from infinigen.runtime import cache_for

DEPTHS = [0.0, 0.3, 0.5, 1.0]


def encoded(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("depth", DEPTHS)
def test_needle_is_where_the_prompt_says(tokenizer, depth):
    book = encoded(tokenizer, bundled_text())
    prompt = needle_prompt(tokenizer, book[300:600], 300, depth, trial=1)
    needle, question = encoded(tokenizer, NEEDLE.format(code=prompt.code)), encoded(tokenizer, QUESTION)
    assert len(prompt.ids) == 300 and prompt.ids[prompt.needle_start : prompt.needle_end] == needle
    assert prompt.ids[prompt.question_start :] == question and prompt.question_start == 300 - len(question)
    passage = prompt.question_start - len(needle)
    assert (
        prompt.ids[: prompt.needle_start] + prompt.ids[prompt.needle_end : prompt.question_start]
        == book[300 : 300 + passage]
    )  # trial 1: the book's second passage, needle removed
    assert abs(prompt.needle_start - depth * passage) <= 0.1 * passage
    if 0 < prompt.needle_start < passage:
        assert SENTENCE_END.search(tokenizer.decode(prompt.ids[prompt.needle_start - 1]))
    assert (prompt.needle_start == 0) == (depth == 0) and (prompt.needle_end == prompt.question_start) == (depth == 1)


def test_needle_text_with_a_real_tokenizer(smollm2):
    tokenizer = smollm2.tokenizer
    prompts = needle_prompts(tokenizer, [bundled_text()], [512], [0.5], trials=1)
    (prompt,) = prompts
    assert tokenizer.decode(prompt.ids[prompt.needle_start : prompt.needle_end]) == NEEDLE.format(code=prompt.code)
    assert tokenizer.decode(prompt.ids[prompt.question_start :]) == QUESTION
    before = tokenizer.decode(prompt.ids[: prompt.needle_start]).rstrip()
    assert SENTENCE_END.search(before) and abs(prompt.needle_start - 0.5 * 512) < 60


def test_trials_take_the_passages_book_after_book(tokenizer):
    books = [list(range(10)), list(range(100, 107)), list(range(200, 203))]
    assert passages(books, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [100, 101, 102], [103, 104, 105], [200, 201, 202]]
    texts = [bundled_text()[:3000], bundled_text()[3000:6000]]
    first = encoded(tokenizer, texts[0])
    per_book = len(first) // 128
    prompts = needle_prompts(tokenizer, texts, [128], [0.5], trials=per_book + 1)
    second_book = encoded(tokenizer, texts[1])
    assert prompts[0].ids[: prompts[0].needle_start] == first[: prompts[0].needle_start]
    assert (
        prompts[-1].trial == per_book
        and prompts[-1].ids[: prompts[-1].needle_start] == second_book[: prompts[-1].needle_start]
    )  # the first book's passages are spent: the last trial starts the second book


def test_secret_codes_are_deterministic():
    codes = {secret_code(length, depth, trial) for length in (2048, 4096) for depth in DEPTHS for trial in (0, 1)}
    assert len(codes) == 16 and all(len(code) == 5 and code.isdigit() for code in codes)
    assert secret_code(2048, 0.5, 0) == secret_code(2048, 0.5, 0)


def test_too_short_text_and_bad_depth(tokenizer):
    book = encoded(tokenizer, "One sentence. Two sentences. " * 20)
    with pytest.raises(InfinigenError, match="too few for a prompt of 512"):
        needle_prompt(tokenizer, book, 512, 0.5)
    held = len(book) // 64
    with pytest.raises(InfinigenError, match=f"holds {held} passages of 64 tokens: too few for {held + 1} trials"):
        needle_prompts(tokenizer, ["One sentence. Two sentences. " * 20], [64], [0.5], trials=held + 1)
    with pytest.raises(InfinigenError, match=r"depths must be in \[0, 1\]"):
        needle_prompt(tokenizer, book, 64, 1.5)


@pytest.mark.parametrize(
    "settings",
    [{"policy": "dense"}, {"policy": "infinigen", **EXACT}, {"exact": True, "budget": 0.1, "min_tokens": 2}],
    ids=["dense", "infinigen at budget 1", "exact at budget 0.1"],
)
def test_greedy_after_equals_generate(tokenizer, settings):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1)[:, 40:]
    assert torch.equal(greedy_after(model, cache_for(model, artifact, **settings), ids, 30, 6), expected)


def test_needle_accuracy_report(tokenizer):
    model, artifact = tiny_setup(tokenizer, "qwen3", "cpu")
    prompts = needle_prompts(tokenizer, [bundled_text()], [96, 128], [0.0, 1.0], trials=2)
    answered = []
    report = needle_accuracy(
        model, tokenizer, artifact, prompts, on_answer=answered.append, policy="infinigen", budget=0.25
    )
    by_cell = sorted(answered, key=lambda a: (a["length"], a["depth"], a["trial"]))
    assert by_cell == report["answers"] and len(answered) == 8 and 0 <= report["accuracy"] <= 1
    assert [(c["length"], c["depth"], c["trials"]) for c in report["cells"]] == [
        (96, 0.0, 2),
        (96, 1.0, 2),
        (128, 0.0, 2),
        (128, 1.0, 2),
    ]
    assert 0 < report["fraction_fetched"] <= 0.25 + 8 / 96 and report["policy"] == "infinigen"
    assert 0.1 < report["memory_plan"]["planned_peak_gpu_gb"] < 0.11  # cuBLAS workspaces: 0.1
    json.dumps(report)
    with pytest.raises(InfinigenError, match="does not fit: 1 x .* the weights alone do not fit"):
        needle_accuracy(model, tokenizer, artifact, prompts, policy="infinigen", gpu_memory_gb=0.5)


def test_prompts_of_one_length_answered_together_answer_as_one_at_a_time(tokenizer):
    """--batch: prompts of one length go through one cache together (no padding); each answer is the one it
    gets alone, in the same order; 0 takes as many as the plan admits, here every prompt of a length."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    prompts = needle_prompts(tokenizer, [bundled_text()], [96, 128], [0.0, 0.5, 1.0], trials=2)
    settings = {"policy": "infinigen", "budget": 0.25}
    alone = needle_accuracy(model, tokenizer, artifact, prompts, **settings)
    for batch, rows in ((4, 4), (0, 6)):
        together = needle_accuracy(model, tokenizer, artifact, prompts, batch=batch, **settings)
        assert together["batch"] == rows and alone["batch"] == 1
        keys = ("length", "depth", "trial", "code", "output", "correct")
        assert [[a[k] for k in keys] for a in together["answers"]] == [[a[k] for k in keys] for a in alone["answers"]]
    with pytest.raises(InfinigenError, match="batch must be >= 0"):
        needle_accuracy(model, tokenizer, artifact, prompts, batch=-1, **settings)


def test_a_passage_serves_its_shallower_needles_the_text_before_them(tokenizer):
    """One at a time with kept prompts, a passage's prompts run deepest needle first: each is served the passage
    up to its needle (the prefix it shares with the one before) and answers as it does computed whole."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    prompts = needle_prompts(tokenizer, [bundled_text()], [96, 128], [0.0, 0.5, 1.0], trials=2)
    settings = {"policy": "infinigen", "budget": 0.25, "kv_bits": 16}  # 8-bit rows: cut past the first chunk only
    kept = needle_accuracy(model, tokenizer, artifact, prompts, **settings)
    whole = needle_accuracy(model, tokenizer, artifact, prompts, prompt_cache_gb=0, **settings)
    assert [a["output"] for a in kept["answers"]] == [a["output"] for a in whole["answers"]]
    assert whole["cached_tokens"] == 0 and kept["cached_tokens"] == sum(a["cached_tokens"] for a in kept["answers"])
    for a in kept["answers"]:
        if a["depth"] == 0.5:  # served the passage before its needle by the depth-1 prompt of its passage
            assert a["cached_tokens"] >= a["needle_start"] > 16
        else:  # the first of its passage (1), or a needle at the start (0)
            assert a["cached_tokens"] == 0
