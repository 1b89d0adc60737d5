"""What every command prints: tables for people, ``--json`` for machines, progress on stderr."""

from __future__ import annotations

import json
import math
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infinigen.tensor_parallel import rank

# Under torchrun every rank runs the command: rank 0 alone prints (errors come from every rank: ``app.fail``).
console = Console(quiet=rank() > 0)
err_console = Console(stderr=True, quiet=rank() > 0)


def strict(value):
    """``value`` with every non-finite float as text ("inf"): strict JSON has no Infinity or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def printed_json(report, as_json: bool) -> bool:
    """With --json, print ``report`` for machines (and the caller stops); else do nothing."""
    if as_json and rank() == 0:
        print(json.dumps(strict(report), indent=2))
    return as_json


def stream_row(row: dict) -> None:
    """A finished row on stderr, as JSON: a run cut off by a time limit keeps the rows it finished."""
    if rank() == 0:
        print(json.dumps(strict(row)), file=sys.stderr, flush=True)


def note(line: str) -> None:
    """A progress line on stderr where the bar is off (--json): plain text, which readers of the JSON rows
    skip, so that a run cut off by a time limit still says how far it got."""
    if rank() == 0:
        print(line, file=sys.stderr, flush=True)


def print_rows(title: str, columns: dict[str, str], rows: list[dict]) -> None:
    """A table of ``rows``: one column per header, showing that row key (blank where missing); a
    column no row has a value for is left out (on the CPU, the GPU's columns)."""
    if rows:
        columns = {header: key for header, key in columns.items() if any(row.get(key) is not None for row in rows)}
    table = Table(title=title)
    for header in columns:
        table.add_column(header, overflow="fold")  # narrow terminals wrap values, never cut them
    for row in rows:
        table.add_row(*("" if row.get(key) is None else str(row[key]) for key in columns.values()))
    console.print(table)


def print_pairs(title: str, pairs: dict) -> None:
    """A two-column table of ``key: value`` pairs (keys with underscores shown as words)."""
    table = Table(show_header=False, title=title)
    for key, value in pairs.items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)


def progress(disable: bool, *extra) -> Progress:
    """A progress bar on stderr (off with --json, whose callers stream rows instead), with ``extra``
    columns after the elapsed time."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        *extra,
        console=err_console,
        disable=disable,
        transient=False,
    )


def human_bytes(value: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"
