"""What the bench and eval plots share (matplotlib, loaded on demand: ``pip install "infinigen[plot]"``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from infinigen.errors import InfinigenError


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InfinigenError('plots need matplotlib: pip install "infinigen[plot]"') from exc
    return plt


def policy_label(row: dict) -> str:
    budget = row.get("budget")
    return row["policy"] if budget in (None, 1.0) else f"{row['policy']} {budget:g}"


def lines(rows: list[dict], x: str, y: str) -> dict[str, tuple[list[float], list[float]]]:
    """One (xs, ys) series per policy label, sorted by x."""
    series = defaultdict(list)
    for row in rows:
        if row.get(x) is not None and row.get(y) is not None:
            series[policy_label(row)].append((row[x], row[y]))
    return {name: ([p[0] for p in sorted(ps)], [p[1] for p in sorted(ps)]) for name, ps in series.items()}


def tick_at(axes, values: list[int], shown) -> None:
    """x ticks at the swept values only (a log axis would tick at powers of ten)."""
    axes.set_xticks(values, [shown(v) for v in values])
    axes.minorticks_off()


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def save(figure, plt, path: str | Path) -> Path:
    path = Path(path)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
