"""Options shared by the commands. Runtime options are not declared here: ``runtime_options`` builds
them from ``RuntimeConfig``'s fields, where each is defined once with its help text."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import Field
from pathlib import Path
from typing import Annotated, Any

import typer

from infinigen.errors import InfinigenError
from infinigen.runtime.config import RUNTIME_FIELDS, field_type, parse_value

ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Alias (see `infinigen models`), Hub id, checkpoint folder or GGUF file. "
        "Default: the embedded smollm2-135m."
    ),
]
ArtifactOpt = Annotated[str | None, typer.Option(help="Artifact folder or Hub id.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
DtypeOpt = Annotated[
    str | None, typer.Option(help="float32 | float16 | bfloat16 (default: float16 on CUDA, float32 on CPU).")
]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu | cuda[:N] (default: cuda if present).")]
TextOpt = Annotated[Path, typer.Option(help="Text file (Project Gutenberg headers are stripped).")]
ReportOutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        help="Keep each setting's finished row in this file (JSON lines); a rerun with it runs only the missing ones.",
    ),
]

# A sweep's plural spelling, kept from earlier versions of the command line.
_PLURALS = {"policy": "--policies", "budget": "--budgets"}


def cli_fields() -> list[Field]:
    """The ``RuntimeConfig`` fields the command line sets."""
    return [f for f in RUNTIME_FIELDS if f.metadata["cli"]]


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_list(text: str, option: str, kind: type = float) -> list:
    """A comma-separated option's values (not a runtime field: batch sizes, lengths, depths)."""
    try:
        values = [kind(value) for value in text.split(",")]
    except ValueError:
        raise InfinigenError(f"{option} takes comma-separated {kind.__name__} values, got {text!r}") from None
    if kind is float and any(math.isnan(v) for v in values):
        raise InfinigenError(f"{option} takes numbers, got {text!r}")
    return values


def _parameter(field: Field, sweep: bool, default: str | None) -> inspect.Parameter:
    help_text = field.metadata["help"]
    names = [option_name(field.name)] + ([_PLURALS[field.name]] if sweep and field.name in _PLURALS else [])
    if sweep:
        shown = default if default is not None else _shown(field.default)
        annotation = Annotated[str, typer.Option(*names, help=help_text + " A comma-separated list is a sweep.")]
        return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=shown)
    kind, optional, _ = field_type(field.name)
    if kind is bool:
        flag = names[0]
        names = [f"{flag}/--no-{flag[2:]}"]
    annotation = Annotated[kind | None if optional else kind, typer.Option(*names, help=help_text)]
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=field.default)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


# fields of decoding by ``infinigen.decode`` (``exact``): no option of commands that time single steps or score
# teacher-forced (``bench``, ``eval ppl``, ``eval tasks``), where they would change nothing
DECODE_ONLY = ("exact", "draft_tokens")


def runtime_options(
    *, sweep: bool, defaults: dict[str, str] | None = None, more_policies: tuple = (), omits: tuple[str, ...] = ()
) -> Callable:
    """Give a command one option per ``RuntimeConfig`` field (``cli_fields``, less ``omits``), built from the field.

    The command receives them as one argument, ``runtime``: the settings (``sweep`` False: field ->
    value), or, with ``sweep``, each field's values (field -> list; a comma-separated option is a
    sweep). ``defaults``: the command's own default strings for a sweep (e.g. the policies compared);
    ``more_policies``: names beside the runtime's policies that the command runs (transformers' caches).
    """
    defaults = defaults or {}
    offered = [f for f in cli_fields() if f.name not in omits]

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "runtime"]
        added = [_parameter(f, sweep, defaults.get(f.name)) for f in offered]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            given = {f.name: kwargs.pop(f.name) for f in offered}
            if sweep:
                names = {f.name: _PLURALS.get(f.name, option_name(f.name)) for f in offered}
                more = {"policy": more_policies}
                given = {
                    name: [parse_value(name, part, names[name], more.get(name, ())) for part in text.split(",")]
                    for name, text in given.items()
                }
            return fn(*args, runtime=given, **kwargs)

        wrapper.__signature__ = inspect.Signature(own + added)
        return wrapper

    return decorate
