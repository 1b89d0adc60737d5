"""The ``infinigen`` command line: one thin module per command group (parse, one library call,
render). Runtime options come from ``RuntimeConfig`` (``options``); output from ``render``."""

from infinigen.cli import artifacts, bench, evaluate, generate, plan, plot, serve  # noqa: F401  (each registers its commands)
from infinigen.cli.app import app

__all__ = ["app"]
