"""The ``infinigen`` command line: prepare, inspect, push, models."""

from __future__ import annotations

import functools
import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict
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


def command(fn: Callable) -> Callable:
    """Register a command whose user-facing errors become one red line and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InfinigenError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return app.command()(wrapper)


@command
def prepare(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact folder to write.")] = Path("skewed"),
    ratio: Annotated[float, typer.Option(help="Share of head_dim kept as partial channels.")] = 0.3,
    tokens: Annotated[int, typer.Option(help="Calibration tokens per text.")] = 2048,
    calibration: Annotated[
        list[Path] | None, typer.Option(help="Calibration text file (repeatable). Default: a bundled PG-19 excerpt.")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32 | float16 | bfloat16 (default: fp16 on CUDA, fp32 on CPU).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact folder.")] = False,
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

        artifact = prepare_artifact(loaded, ratio=ratio, tokens=tokens, calibration=calibration, progress=report)

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
    if as_json:
        print(json.dumps(summary, indent=2))
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
    if as_json:
        print(json.dumps(asdict(manifest), indent=2))
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

    if as_json:
        print(json.dumps({"aliases": ALIASES, "architectures": list(SUPPORTED)}, indent=2))
        return
    table = Table("alias", "resolves to", title="model aliases")
    for alias, target in ALIASES.items():
        table.add_row(alias, target)
    console.print(table)
    console.print(
        f"supported architectures: {', '.join(SUPPORTED)}; any local folder, GGUF file or Hub id of these works too."
    )


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
        str, typer.Option(help="Random-weight model shape: opt-6.7b, opt-13b, llama-2-7b, llama-3-8b, tiny-llama.")
    ] = "llama-3-8b",
    policies: Annotated[
        str, typer.Option(help="Comma-separated: dense, full, infinigen, hf-dynamic, hf-offloaded.")
    ] = "dense,full,infinigen",
    batch: Annotated[int, typer.Option(help="Batch size.")] = 8,
    prompt_len: Annotated[int, typer.Option(help="Context length before decoding.")] = 16384,
    gen_len: Annotated[int, typer.Option(help="Timed decode steps (after 3 warm-up steps).")] = 16,
    budget: Annotated[float, typer.Option(help="infinigen: fraction of the context fetched per step.")] = 0.2,
    dtype: Annotated[str, typer.Option(help="Model dtype.")] = "bfloat16",
    device: Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Decode throughput of each policy on one random-weight model, in one run, with the pinned
    host->device bandwidth measured in the same process. Random weights make attention near
    uniform, so infinigen fetches a fixed budget (alpha = inf).

    Example:\n
      infinigen bench --shape llama-3-8b --batch 8 --prompt-len 16384 --policies dense,full,infinigen
    """
    import torch

    from infinigen.bench import BenchCase, pinned_bandwidth, random_model, run_case
    from infinigen.models import LoadedModel, ModelSource, parse_dtype, resolve_device
    from infinigen.prepare import prepare_artifact
    from infinigen.prepare.calibration import CalibrationSample

    device = resolve_device(device)
    model = random_model(shape, device, parse_dtype(dtype, device))
    calibration = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    artifact = prepare_artifact(
        LoadedModel(model, None, ModelSource(shape, None, "random")),
        samples=[CalibrationSample("random tokens", "", calibration)],
    )
    bandwidth = pinned_bandwidth(device)
    rows = []
    for policy in policies.split(","):
        rows.append(run_case(model, artifact, BenchCase(policy.strip(), batch, prompt_len, gen_len, budget=budget)))
        if not as_json:
            console.print(rows[-1])
    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    report = {"shape": shape, "dtype": dtype, "device": card, "pinned_h2d_gb_s": round(bandwidth, 1), "results": rows}
    if as_json:
        print(json.dumps(report, indent=2))
        return
    table = Table(
        "policy",
        "ms/step",
        "tok/s",
        "fetched",
        "H2D MB/step",
        "H2D GB/s",
        "% of pinned BW",
        "wait ms/step",
        "prefill s",
        "peak GPU GB",
        title=f"{shape} {dtype}, batch {batch}, context {prompt_len}, on {card} (pinned H2D {bandwidth:.1f} GB/s)",
    )
    for row in rows:
        share = row.get("h2d_gb_s", 0) / bandwidth * 100 if bandwidth == bandwidth else float("nan")
        table.add_row(
            row["policy"],
            str(row["ms_per_step"]),
            str(row["decode_tok_s"]),
            str(row.get("fraction_fetched", "")),
            str(row.get("h2d_mb_per_step", "")),
            str(row.get("h2d_gb_s", "")),
            f"{share:.0f}%" if "h2d_gb_s" in row else "",
            str(row.get("wait_ms_per_step", "")),
            str(row["prefill_s"]),
            str(row["peak_gpu_gb"]),
        )
    console.print(table)
