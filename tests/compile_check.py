"""Imported first by the scripts ``run_in_interpreter`` runs: every Triton kernel those scripts launch
is also compiled for an NVIDIA H100/H200 (sm_90, with the ptxas Triton ships), with the argument types
of each launch. CI has no GPU, and Triton's interpreter runs code that its compiler refuses (types that
change across a loop, calls it cannot lower): this makes such a kernel fail CI rather than a GPU run.

The launches are recorded while the script runs and compiled when it exits, in a process of their own:
once the interpreter has run a kernel, ``triton.language`` is patched for it and cannot compile."""

from __future__ import annotations

import atexit
import inspect
import os
import pickle
import subprocess
import sys

_launches: dict[tuple, tuple] = {}  # (module, kernel, signature, constexprs, options) of each distinct launch
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")  # compiler options, not kernel arguments


def _record(fn, args: tuple, kwargs: dict) -> None:
    from triton.runtime.jit import JITFunction, mangle_type

    if fn.__module__ == "__main__":  # a kernel of the script's own cannot be imported again
        return
    options = {name: kwargs[name] for name in LAUNCH_OPTIONS if name in kwargs}
    kwargs = {name: value for name, value in kwargs.items() if name not in LAUNCH_OPTIONS}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for index, param in enumerate(JITFunction(fn).params):
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[index] = "constexpr", value
        else:
            signature[param.name] = mangle_type(value)
    launch = (fn.__module__, fn.__name__, signature, constexprs, options)
    _launches.setdefault(repr(launch), launch)


def _compile_launches() -> None:
    """At exit: compile what was launched in a fresh process; a failure fails the script."""
    if not _launches:
        return
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "compile_check"],
        input=pickle.dumps(list(_launches.values())),
        env=env,
        capture_output=True,
    )
    if result.returncode != 0:
        sys.stderr.write(result.stderr.decode(errors="replace")[-4000:])
        sys.stderr.flush()
        os._exit(1)


def _compile(launches: list[tuple]) -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for module, name, signature, constexprs, options in launches:
        kernel = getattr(importlib.import_module(module), name)
        source = ASTSource(fn=kernel, signature=signature, constexprs={(i,): v for i, v in constexprs.items()})
        triton.compile(source, target=target, options=options)


if __name__ == "__main__":
    _compile(pickle.loads(sys.stdin.buffer.read()))
else:
    from triton.runtime.interpreter import InterpretedFunction

    _interpreted_run = InterpretedFunction.run

    def _run(self, *args, grid, warmup, **kwargs):
        _record(self.fn, args, kwargs)
        return _interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = _run
    atexit.register(_compile_launches)
