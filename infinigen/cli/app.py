"""The ``infinigen`` application: its command groups, and the promise that every error a user can fix
is one line and exit code 2 (ours, and the command-line parser's), never a traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from infinigen import __version__
from infinigen.cli.render import console
from infinigen.errors import InfinigenError
from infinigen.tensor_parallel import leave_group, rank, world_size

_errors = Console(stderr=True)  # never quiet: under torchrun each rank says what failed on it


def fail(message: str) -> None:
    where = f"rank {rank()}: " if world_size() > 1 else ""
    _errors.print(f"[bold red]error:[/] {where}{escape(message)}", highlight=False, soft_wrap=True)


# typer >= 0.2x carries its own copy of click: its parser raises that copy's UsageError
_VENDORED = getattr(getattr(typer, "_click", None), "exceptions", click)
USAGE_ERRORS = tuple({click.UsageError, getattr(_VENDORED, "UsageError", click.UsageError)})


class OneLineErrors(TyperGroup):
    """A command group whose parser errors (unknown option, bad value) print as one line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USAGE_ERRORS as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as click shows it
                raise
            command = exc.ctx.command_path if exc.ctx is not None else "infinigen"
            fail(f"{exc.format_message()} (see {command} --help)")
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=OneLineErrors,
    help="InfiniGen for Hugging Face transformers: long-context decoding with the KV cache in CPU memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
eval_app = typer.Typer(cls=OneLineErrors, help="Accuracy through the real runtime.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


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
    from infinigen.runtime.memory import allocator

    allocator.before_cuda()  # PyTorch's allocator as the memory plan assumes it (a user's own setting wins)


def command(fn: Callable | None = None, *, on: typer.Typer = app) -> Callable:
    """Register a command whose user-facing errors become one red line and exit code 2."""
    if fn is None:
        return functools.partial(command, on=on)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except InfinigenError as exc:
            fail(str(exc))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            fail("interrupted")
            sys.exit(130)
        leave_group()  # after the last collective of every rank: not on an error, which one rank may meet alone
        return result

    on.command()(wrapper)
    return wrapper
