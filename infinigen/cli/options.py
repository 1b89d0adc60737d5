"""Options shared by the commands. Runtime options are not declared here: ``runtime_options`` builds
them from ``RuntimeConfig``'s fields, where each is defined once with its help text."""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable
from dataclasses import Field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import typer

from infinigen.errors import InfinigenError
from infinigen.runtime.config import RUNTIME_FIELDS, RuntimeConfig

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

_TYPES = get_type_hints(RuntimeConfig)
# A sweep's plural spelling, kept from earlier versions of the command line.
_PLURALS = {"policy": "--policies", "budget": "--budgets"}
_SWITCHES = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def cli_fields() -> list[Field]:
    """The ``RuntimeConfig`` fields the command line sets."""
    return [f for f in RUNTIME_FIELDS if f.metadata["cli"]]


def _value_type(name: str) -> tuple[type, bool, tuple]:
    """A field's value type (str, int, float, bool), whether it may be None, and its choices (Literal)."""
    hint = _TYPES[name]
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if optional:
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return type(choices[0]), optional, choices
    return hint, optional, ()


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_value(name: str, text: str, option: str | None = None, more_choices: tuple = ()) -> Any:
    """One value of the field ``name`` from the command line (``none``: None where the field allows it;
    ``more_choices``: values a command accepts beyond the field's own)."""
    kind, optional, choices = _value_type(name)
    choices = choices + more_choices if choices else ()
    option = option or option_name(name)
    text = text.strip()
    if optional and text.lower() in ("none", "default"):
        return None
    if kind is bool:
        if text.lower() not in _SWITCHES:
            raise InfinigenError(f"{option} takes off or on, got {text!r}")
        return _SWITCHES[text.lower()]
    try:
        value = kind(text)
    except ValueError:
        raise InfinigenError(f"{option} takes {kind.__name__} values, got {text!r}") from None
    if kind is float and math.isnan(value):
        raise InfinigenError(f"{option} takes a number, got {text!r}")
    if choices and value not in choices:
        raise InfinigenError(f"{option} takes {', '.join(map(str, choices))}, got {text!r}")
    return value


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
    kind, optional, _ = _value_type(field.name)
    if kind is bool:
        flag = names[0]
        names = [f"{flag}/--no-{flag[2:]}"]
    annotation = Annotated[kind | None if optional else kind, typer.Option(*names, help=help_text)]
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=field.default)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def runtime_options(*, sweep: bool, defaults: dict[str, str] | None = None, more_policies: tuple = ()) -> Callable:
    """Give a command one option per ``RuntimeConfig`` field (``cli_fields``), built from the field.

    The command receives them as one argument, ``runtime``: the settings (``sweep`` False: field ->
    value), or, with ``sweep``, each field's values (field -> list; a comma-separated option is a
    sweep). ``defaults``: the command's own default strings for a sweep (e.g. the policies compared);
    ``more_policies``: names beside the runtime's policies that the command runs (transformers' caches).
    """
    defaults = defaults or {}

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "runtime"]
        added = [_parameter(f, sweep, defaults.get(f.name)) for f in cli_fields()]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            given = {f.name: kwargs.pop(f.name) for f in cli_fields()}
            if sweep:
                names = {f.name: _PLURALS.get(f.name, option_name(f.name)) for f in cli_fields()}
                more = {"policy": more_policies}
                given = {
                    name: [parse_value(name, part, names[name], more.get(name, ())) for part in text.split(",")]
                    for name, text in given.items()
                }
            return fn(*args, runtime=given, **kwargs)

        wrapper.__signature__ = inspect.Signature(own + added)
        return wrapper

    return decorate
