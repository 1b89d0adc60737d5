"""``infinigen generate --input requests.jsonl --output results.jsonl``: a batch job with a progress bar,
resumable, stopped cleanly by Ctrl-C (``infinigen.batch``)."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.progress import TextColumn, TimeRemainingColumn

from infinigen.cli.render import err_console, print_pairs, printed_json, progress
from infinigen.errors import InfinigenError


def job_requests(input_path: Path, output: Path | None):
    """The requests and bad lines of ``input_path``, read before the model loads (every file problem is
    one line then)."""
    from infinigen.batch import read_requests
    from infinigen.batch.records import read_done

    if output is None:
        raise InfinigenError("--input needs --output (the results file; a rerun continues it)")
    if output.resolve() == input_path.resolve():
        raise InfinigenError("--output must not be the --input file")
    read_done(output)  # a foreign or unreadable output file is refused now
    return read_requests(input_path)


def run_batch_job(loading: dict, settings: dict, sampling, options: dict, ray, requests, input_path, output, as_json):
    """``--input``: the job in this process, or on Ray's workers (``ray``: (None | "local" | ADDRESS,
    workers); the driver then loads no weights). ``loading``: ``load_model``'s model, device, dtype and
    the artifact."""
    from infinigen.models import load_model, resolve_device

    address, workers = ray
    if address is None:
        from infinigen.artifacts import open_artifact, read_artifact
        from infinigen.batch import Job, Work, run_job
        from infinigen.batch.runner import weights_plan
        from infinigen.runtime.weights import streamed_weights

        placing = weights_plan(settings, requests[0], **options)
        read = read_artifact(loading["artifact"])  # refused before the weights load
        loaded = load_model(loading["model"], device=loading["device"], dtype=loading["dtype"], before_weights=placing)
        artifact = open_artifact(read, loaded.model) if read is not None else None
        if (streamed := streamed_weights(loaded.model)) is not None:  # every batch plans with them
            settings = settings | {"streamed_layers": len(streamed.order)}
        job = Job.of(loaded.model, loaded.tokenizer, artifact, settings, sampling=sampling, **options)
        run = functools.partial(run_job, job, Work(*requests, output))
        title = f"{settings['policy']} on {loaded.model.device}"
    else:
        from infinigen.batch import Work
        from infinigen.batch.distributed import Cluster, Loading, driver_planner, run_on_ray

        where = Loading(loading["model"], loading["artifact"], resolve_device(loading["device"]), loading["dtype"])
        planner = driver_planner(where, settings, **options)
        gpus = 1 if where.device.startswith("cuda") else 0
        cluster = Cluster(None if address == "local" else address, workers, gpus)
        run = functools.partial(run_on_ray, cluster, where, planner, sampling, Work(*requests, output))
        title = f"{settings['policy']} on Ray ({address})"
    batch_job(run, title, input_path, output, as_json)


def batch_job(run: Callable, title: str, input_path: Path, output: Path, as_json: bool) -> None:
    """Run a job (``run(on_batch=, stop=)``: ``runner.run_job`` or ``distributed.run_on_ray`` with its
    arguments bound) with a progress bar; print its summary."""
    speed = TextColumn("{task.fields[tokens]} tokens, {task.fields[rate]} tok/s")
    with progress(as_json, speed, TimeRemainingColumn()) as bar, _stop_on_interrupt() as stopping:
        task = bar.add_task("requests", total=None, tokens=0, rate="-")

        def advance(done) -> None:
            rate = "-" if not done.seconds else f"{done.tokens / done.seconds:.1f}"
            bar.update(task, total=done.pending, completed=done.written, tokens=done.tokens, rate=rate)

        report = run(on_batch=advance, stop=stopping)
        advance(report)
    summary = {"input": str(input_path), "output": str(output), **report.report()}
    if not printed_json(summary, as_json):
        print_pairs(title, summary)
    if report.interrupted:
        err_console.print(f"stopped: {report.written} of {report.pending} written; the same command continues")
        raise typer.Exit(130)


@contextmanager
def _stop_on_interrupt():
    """Yields ``stopping()``: True once Ctrl-C was pressed, after which the job ends with its current
    batch; a second Ctrl-C stops at once (the batch's results lost, every earlier one kept)."""
    pressed = []

    def handler(signum, frame) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)
        err_console.print("stopping after this batch (Ctrl-C again: now)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)
