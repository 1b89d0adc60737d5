"""Artifact commands: ``prepare`` (offline skew), ``inspect``, ``push`` to the Hub, and ``models``."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Annotated

import typer

from infinigen.cli.app import command
from infinigen.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelArg
from infinigen.cli.render import console, print_pairs, print_rows, printed_json, progress
from infinigen.errors import InfinigenError


@command
def prepare(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact folder to write.")] = Path("skewed"),
    ratio: Annotated[float, typer.Option(help="Share of head_dim kept as partial channels.")] = 0.5,
    tokens: Annotated[int, typer.Option(help="Calibration tokens per text.")] = 2048,
    calibration: Annotated[
        list[Path] | None, typer.Option(help="Calibration text file (repeatable). Default: a bundled PG-19 excerpt.")
    ] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact folder.")] = False,
    skew: Annotated[str, typer.Option(help="svd (InfiniGen) | identity (ablation: no skewing).")] = "svd",
    channels: Annotated[str, typer.Option(help="top (InfiniGen) | random (ablation: random kept channels).")] = "top",
    save_model: Annotated[
        bool, typer.Option(help="OPT only: also write the skewed checkpoint (same outputs) to OUT/skewed-model.")
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
    from infinigen.prepare import check_options, prepare_artifact
    from infinigen.prepare.fold import skew_model_in_place

    if out.exists() and not force:
        raise InfinigenError(f"{out} already exists: pass --force to replace it")
    check_options(ratio, tokens, calibration, skew, channels)
    start = time.perf_counter()
    loaded = load_model(model, device=device, dtype=dtype)
    if save_model and loaded.model.config.model_type != "opt":
        raise InfinigenError("--save-model works for OPT only: RoPE models cannot carry the skew in their weights")
    with progress(disable=as_json) as bar:
        stages: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in stages:  # one bar per stage, made at its first report
                stages[stage] = bar.add_task(stage, total=total)
            bar.update(stages[stage], completed=done)

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
    summary = (
        _summary(artifact.manifest)
        | {"unskewed_heads": sum(_unskewed_heads(artifact))}
        | {
            "out": str(out),
            "seconds": round(seconds, 1),
            "peak_rss_gb": round(peak_rss_gb, 2),
        }
    )
    if printed_json(summary, as_json):
        return
    _print_energy(artifact)
    console.print(f"wrote [bold]{out}[/] in {seconds:.1f} s (peak RSS {peak_rss_gb:.2f} GB)")


@command
def inspect(
    artifact: Annotated[str, typer.Argument(help="Artifact folder or Hub id, or a prompt file (--prompt-cache).")],
    as_json: JsonOpt = False,
) -> None:
    """Check an artifact and show its summary and per-layer energy table; or check a prompt file (every
    checksum) and show what it holds.

    Example:\n
      infinigen inspect skewed/ --json\n
      infinigen inspect doc.prompt
    """
    from infinigen.artifacts import artifact_folder, load_artifact

    if Path(artifact).is_file():
        _inspect_prompt_file(Path(artifact), as_json)
        return
    checked = load_artifact(artifact_folder(artifact))
    if printed_json(checked.manifest.as_json(), as_json):
        return
    print_pairs(f"artifact {artifact}", _summary(checked.manifest))
    _print_energy(checked)


def _inspect_prompt_file(path: Path, as_json: bool) -> None:
    from infinigen.runtime.cache.prompt_file import load_prompt, read_manifest

    manifest, _, _ = read_manifest(path)
    kept = load_prompt(path, "cpu")  # every checksum
    kinds = [layer["kind"] for layer in manifest["layers"]]
    shown = {
        "tokens": kept.length,
        "bytes": path.stat().st_size,
        "serves": "any common prefix" if kept.cuttable else "prompts that extend it whole",
        "layer kinds": ", ".join(f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)),
        **kept.key,
        "format_version": manifest["version"],
    }
    if printed_json(shown, as_json):
        return
    print_pairs(f"prompt file {path}", shown)


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

    if printed_json({"aliases": ALIASES, "architectures": list(SUPPORTED)}, as_json):
        return
    print_rows(
        "model aliases",
        {"alias": "alias", "resolves to": "target"},
        [{"alias": a, "target": t} for a, t in ALIASES.items()],
    )
    console.print(
        f"supported architectures: {', '.join(SUPPORTED)}; any local folder, GGUF file or Hub id of these works too."
    )


def _summary(manifest) -> dict:
    spec, base = manifest.spec, manifest.base_model
    before, after = manifest.mean_energy()
    return {
        "base_model": base.model_id,
        "fingerprint": base.fingerprint,
        "architecture": f"{spec.model_type} ({spec.n_layers} layers, {spec.n_heads} heads, "
        f"{spec.n_kv_heads} KV heads, head_dim {spec.head_dim})",
        "channels": f"{manifest.n_channels} of {spec.head_dim} (ratio {manifest.ratio})",
        "calibration_tokens": manifest.calibration.tokens,
        "energy_before": round(before, 4),
        "energy_after": round(after, 4),
        "created": manifest.created,
    }


def _unskewed_heads(artifact) -> list[int]:
    """Per layer, the KV heads that ship the identity (prepare keeps no skew that carries less score
    energy than none)."""
    import torch

    layers = artifact.manifest.spec.n_layers
    eye = torch.eye(artifact.manifest.spec.head_dim)
    return [sum(bool(torch.equal(a, eye)) for a in artifact.skew_matrix(i)) for i in range(layers)]


def _print_energy(artifact) -> None:
    unskewed = _unskewed_heads(artifact)
    rows = [
        {"layer": e.layer, "before": f"{e.before:.3f}", "after": f"{e.after:.3f}", "unskewed": unskewed[e.layer]}
        for e in artifact.manifest.energy
    ]
    columns = {"layer": "layer", "energy before": "before", "energy after": "after", "heads left unskewed": "unskewed"}
    print_rows("score energy in the kept channels", columns, rows)
