"""An evaluation's finished rows on disk (``eval ... --output FILE``), as a batch job keeps its results: one
JSON line per setting of the sweep, appended whole and flushed as each finishes. A rerun with the same file
and the same run (model, data, options: the first line) takes the rows already there and runs only the
settings still missing; a file of another run is refused, never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from infinigen.batch.records import append_rows, whole_lines
from infinigen.errors import InfinigenError


def setting_key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


class Journal:
    """The rows of ``run`` (a JSON-able description of what is evaluated) in ``path``; None: kept nowhere."""

    def __init__(self, path: Path | None, run: dict) -> None:
        self.path, self.run = path, json.loads(json.dumps(run))  # as it reads back
        self.rows: dict[str, dict] = {}
        if path is None:
            return
        lines = whole_lines(path)
        if not lines:
            append_rows(path, [{"run": self.run}])
            return
        try:
            records = [json.loads(line) for line in lines]
            found = records[0]["run"]
            self.rows = {setting_key(r["settings"]): r["row"] for r in records[1:]}
        except (json.JSONDecodeError, TypeError, KeyError):
            raise InfinigenError(f"{path} is not an evaluation's --output (delete it or choose another)") from None
        if found != self.run:
            changed = sorted(k for k in found.keys() | self.run.keys() if found.get(k) != self.run.get(k))
            raise InfinigenError(
                f"{path} holds the rows of another run (it differs in {', '.join(changed)}): choose another --output"
            )

    def done(self, settings: dict) -> dict | None:
        """The row an earlier run finished for ``settings``, if any."""
        return self.rows.get(setting_key(settings))

    def add(self, settings: dict, row: dict) -> None:
        self.rows[setting_key(settings)] = row
        if self.path is not None:
            append_rows(self.path, [{"settings": settings, "row": row}])
