"""``infinigen generate --input requests.jsonl --output results.jsonl``: a batch job with a progress bar,
resumable, stopped cleanly by Ctrl-C (``infinigen.batch``)."""

from __future__ import annotations

import signal
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


def batch_job(job, requests, bad, input_path: Path, output: Path, as_json: bool) -> None:
    """Run ``requests`` (``job_requests``) into ``output``; print the job's summary."""
    from infinigen.batch import run_job

    speed = TextColumn("{task.fields[tokens]} tokens, {task.fields[rate]} tok/s")
    with progress(as_json, speed, TimeRemainingColumn()) as bar, _stop_on_interrupt() as stopping:
        task = bar.add_task("requests", total=None, tokens=0, rate="-")

        def advance(done) -> None:
            rate = "-" if not done.seconds else f"{done.tokens / done.seconds:.1f}"
            bar.update(task, total=done.pending, completed=done.written, tokens=done.tokens, rate=rate)

        report = run_job(job, requests, bad, output, on_batch=advance, stop=stopping)
        advance(report)
    summary = {"input": str(input_path), "output": str(output), **report.report()}
    if not printed_json(summary, as_json):
        print_pairs(f"{job.config.policy} on {job.model.device}", summary)
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
