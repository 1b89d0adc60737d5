"""``infinigen plot``: a PNG of any saved ``bench`` or ``eval`` report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from infinigen.cli.app import command
from infinigen.cli.render import console
from infinigen.errors import InfinigenError


@command
def plot(
    report: Annotated[
        Path, typer.Argument(help="A --json report of `infinigen bench`, `eval ppl`, `eval tasks` or `eval needle`.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write.")],
) -> None:
    """Plot a saved report: bench -> tokens/s vs context and batch (--micro: its curves); eval ppl ->
    perplexity vs KV fetched; eval tasks -> mean accuracy vs KV fetched; eval needle -> accuracy vs depth."""
    from infinigen.bench.plots import plot_bench, plot_micro
    from infinigen.eval.plots import plot_accuracy, plot_needle, plot_tasks

    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise InfinigenError(f"cannot read the report {report}: {exc}") from exc
    rows = data.get("results") if isinstance(data, dict) else None
    if isinstance(data, dict) and "gather" in data:
        draw = plot_micro
    elif not rows or not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise InfinigenError(f"{report} is not a report of `infinigen bench` or `infinigen eval`")
    elif "shape" in data:
        draw = plot_bench
    elif "cells" in rows[0]:
        draw = plot_needle
    else:
        draw = plot_tasks if "tasks" in rows[0] else plot_accuracy
    try:
        draw(data, out)
    except (KeyError, TypeError, ValueError) as exc:
        raise InfinigenError(f"{report} is not a complete report: {type(exc).__name__} {exc}") from exc
    console.print(f"wrote {out}")
