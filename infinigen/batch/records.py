"""A batch job's files: requests in (JSON lines), results out (JSON lines, appended a batch at a time).

An input line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [{"role", "content"}, ...]}``,
optionally with ``"max_new_tokens"``. An output line is ``{"id", "text", "tokens", "finish_reason", "stats"}``
or ``{"id", "error"}`` (a line that is not a request: ``{"id": null, "line": n, "error"}``). Each id is
written once: a rerun with the same output skips what is there, so a job killed at any point loses at
most the batch it was running.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from infinigen.errors import InfinigenError

Id = str | int


@dataclass(frozen=True)
class Request:
    id: Id
    line: int  # 1-based line of the input file
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_new_tokens: int | None = None  # None: the job's


@dataclass(frozen=True)
class BadLine:
    """An input line that is no request: an error row of its own, the job goes on."""

    line: int
    id: Id | None
    error: str

    def row(self) -> dict:
        return {"id": self.id, "line": self.line, "error": self.error}


@dataclass(frozen=True)
class Work:
    """A job's files: its requests and bad input lines (``read_requests``), and where the results go."""

    requests: list[Request]
    bad: list[BadLine]
    output: Path


def read_requests(path: Path) -> tuple[list[Request], list[BadLine]]:
    """The requests of a JSON-lines file and its lines that are none (blank lines skipped). Refuses the
    file (``InfinigenError``) where it cannot be read or two requests share an id: nothing has run yet."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InfinigenError(f"cannot read {path}: {exc}") from exc
    requests, bad, lines_of = [], [], {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parsed = _request(line, number)
        if parsed.id in lines_of:
            first = lines_of[parsed.id]
            raise InfinigenError(f"{path}: id {parsed.id!r} on lines {first} and {number}: ids must be unique")
        if parsed.id is not None:
            lines_of[parsed.id] = number
        (bad if isinstance(parsed, BadLine) else requests).append(parsed)
    if not requests and not bad:
        raise InfinigenError(f"{path} holds no request")
    return requests, bad


def _request(line: str, number: int) -> Request | BadLine:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return BadLine(number, None, f"not JSON: {exc.msg} (column {exc.colno})")
    if not isinstance(record, dict):
        return BadLine(number, None, "not a JSON object")
    rid = record.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        return BadLine(number, None, "needs an id (a string or an integer)")
    unknown = sorted(set(record) - {"id", "prompt", "messages", "max_new_tokens"})
    if unknown:
        return BadLine(number, rid, f"unknown field {unknown[0]!r} (id, prompt or messages, max_new_tokens)")
    prompt, messages, new = record.get("prompt"), record.get("messages"), record.get("max_new_tokens")
    if (prompt is None) == (messages is None):
        return BadLine(number, rid, "needs exactly one of prompt and messages")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        return BadLine(number, rid, "the prompt is empty or not a string")
    if messages is not None and not _chat(messages):
        return BadLine(number, rid, 'messages must be a non-empty list of {"role": str, "content": str}')
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        return BadLine(number, rid, "max_new_tokens must be an integer >= 1")
    return Request(rid, number, prompt, tuple(messages) if messages is not None else None, new)


def _chat(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def read_done(path: Path) -> tuple[set[Id], set[int]]:
    """The ids of the requests, and the input lines that were none, an earlier run wrote to ``path``
    (``whole_lines``)."""
    ids, lines = set(), set()
    for number, line in enumerate(whole_lines(path), start=1):
        try:
            row = json.loads(line)
            rid = row["id"]
        except (json.JSONDecodeError, TypeError, KeyError):
            message = "not a result of infinigen (delete it or choose another --output)"
            raise InfinigenError(f"{path}, line {number}: {message}") from None
        if "line" in row:  # an input line that was no request
            lines.add(row["line"])
        elif rid is not None:
            ids.add(rid)
    return ids, lines


def whole_lines(path: Path) -> list[str]:
    """The lines of a file of appended rows (none where it does not exist), cut back to its last whole line
    first: a run killed while writing leaves at most a part of one."""
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InfinigenError(f"cannot read {path}: {exc}") from exc
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as file:
            file.truncate(len(whole))
    return whole.decode("utf-8", errors="replace").splitlines()


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append rows to ``path`` in one write, flushed to the disk: a batch lands whole or (killed while
    writing) as a last line ``read_done`` cuts."""
    if not rows:
        return
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as exc:
        raise InfinigenError(f"cannot write {path}: {exc}") from exc
