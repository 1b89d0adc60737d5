"""PNG plots of `infinigen bench` and `infinigen eval` reports (their --json output).
Needs matplotlib: ``pip install "infinigen[plot]"``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from infinigen.errors import InfinigenError


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InfinigenError('plots need matplotlib: pip install "infinigen[plot]"') from exc
    return plt


def _label(row: dict) -> str:
    budget = row.get("budget")
    return row["policy"] if budget in (None, 1.0) else f"{row['policy']} {budget:g}"


def _lines(rows: list[dict], x: str, y: str) -> dict[str, tuple[list[float], list[float]]]:
    """One (xs, ys) series per policy label, sorted by x."""
    series = defaultdict(list)
    for row in rows:
        if row.get(x) is not None and row.get(y) is not None:
            series[_label(row)].append((row[x], row[y]))
    return {label: ([p[0] for p in sorted(ps)], [p[1] for p in sorted(ps)]) for label, ps in series.items()}


def _widest_sweep(rows: list[dict], fixed: str, swept: str):
    """The value of ``fixed`` whose rows sweep the most values of ``swept`` (the largest on ties):
    a report joining a context sweep at one batch and a batch sweep at one context plots both."""
    values = defaultdict(set)
    for row in rows:
        values[row[fixed]].add(row[swept])
    return max(values, key=lambda value: (len(values[value]), value))


def plot_bench(report: dict, path: str | Path) -> Path:
    """Decode tokens/s vs context length and vs batch, one line per policy (and budget)."""
    plt = _pyplot()
    rows = report["results"]
    batch, context = _widest_sweep(rows, "batch", "prompt_len"), _widest_sweep(rows, "prompt_len", "batch")
    figure, (by_context, by_batch) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in _lines([r for r in rows if r["batch"] == batch], "prompt_len", "decode_tok_s").items():
        by_context.plot(*points, marker="o", label=label)
    for label, points in _lines([r for r in rows if r["prompt_len"] == context], "batch", "decode_tok_s").items():
        by_batch.plot(*points, marker="o", label=label)
    by_context.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode tokens/s")
    by_context.set_title(f"batch {batch}")
    by_batch.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s")
    by_batch.set_title(f"context {context}")
    _tick_at(by_context, sorted({r["prompt_len"] for r in rows if r["batch"] == batch}), _tokens)
    _tick_at(by_batch, sorted({r["batch"] for r in rows if r["prompt_len"] == context}), str)
    by_batch.legend(fontsize=8)
    figure.suptitle(f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}")
    return _save(figure, plt, path)


def plot_micro(report: dict, path: str | Path) -> Path:
    """`bench --micro`: the selective gather's GB/s vs MB per call, one line per context, beside the
    same run's pinned bulk copy (and 80% of it); speculation per layer vs our dense layer per context."""
    plt = _pyplot()
    figure, (gather, speculation) = plt.subplots(1, 2, figsize=(11, 4.2))
    for context in sorted({row["context"] for row in report["gather"]}):
        rows = sorted((r for r in report["gather"] if r["context"] == context), key=lambda r: r["bytes"])
        gather.plot([r["bytes"] / 1e6 for r in rows], [r["gb_s"] for r in rows], marker="o", label=_tokens(context))
    bulk = report.get("pinned_h2d_gb_s")
    if bulk:
        gather.axhline(bulk, color="black", linewidth=1, label=f"pinned copy {bulk:g} GB/s")
        gather.axhline(0.8 * bulk, color="gray", linestyle="--", linewidth=1, label="80% of it")
    gather.set(xscale="log", xlabel="MB per gather (one layer)", ylabel="GB/s")
    gather.set_title("selective gather, by context")
    gather.legend(fontsize=8)
    rows = sorted(report["speculation"], key=lambda r: r["context"])
    contexts = [r["context"] for r in rows]
    speculation.plot(contexts, [r["speculation_ms"] for r in rows], marker="o", label="speculation (one layer)")
    speculation.plot(contexts, [r["dense_layer_ms"] for r in rows], marker="o", label="dense decode layer")
    speculation.set(xscale="log", xlabel="context tokens", ylabel="ms per layer (batch 1)")
    _tick_at(speculation, contexts, _tokens)
    speculation.legend(fontsize=8)
    figure.suptitle(f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}")
    return _save(figure, plt, path)


def _tick_at(axes, values: list[int], label) -> None:
    """x ticks at the swept values only (a log axis would tick at powers of ten)."""
    axes.set_xticks(values, [label(v) for v in values])
    axes.minorticks_off()


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_tasks(report: dict, path: str | Path) -> Path:
    """An `eval tasks` report: the mean of the tasks' acc vs fraction of the KV fetched, one line per policy."""
    rows = [{**row, **row["average"]} for row in report["results"]]
    return plot_accuracy({**report, "results": rows}, path, metric="acc")


def plot_accuracy(report: dict, path: str | Path, metric: str = "perplexity") -> Path:
    """``metric`` vs fraction of the KV fetched (16-bit equivalent bytes), one line per policy."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    rows = [dict(r, fraction=r.get("fraction_bytes", r.get("fraction_fetched"))) for r in report["results"]]
    for row in rows:  # one line per policy and setting other than the budget
        alpha = row.get("alpha", 1e9)
        setting = ""
        if row["policy"] == "infinigen" and (alpha is None or alpha < 1e6):
            setting = " α default" if alpha is None else f" α {alpha:g}"
        if row.get("pool_fraction"):
            setting += f" pool {row['pool_fraction']:g} {row.get('eviction', '')}"
        row.update(policy=row["policy"] + setting, budget=None)
    for policy, points in _lines(rows, "fraction", metric).items():
        if policy == "dense":
            axes.axhline(points[1][0], color="black", linestyle="--", label="dense")
        else:
            axes.plot(*points, marker="o", label=policy)
    scale = "log" if metric == "perplexity" else "linear"
    axes.set(xlabel="fraction of the KV moved per step (16-bit equivalent)", ylabel=metric, yscale=scale)
    axes.set_title(f"{report.get('model', '')}: {metric} vs KV fetched")
    axes.legend(fontsize=8)
    return _save(figure, plt, path)


def plot_needle(report: dict, path: str | Path) -> Path:
    """An `eval needle` report: accuracy vs the needle's depth, one panel per prompt length, one line
    per policy (and budget, and lookahead settings other than the defaults)."""
    plt = _pyplot()
    lengths = sorted({cell["length"] for row in report["results"] for cell in row["cells"]})
    figure, panels = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.8), sharey=True, squeeze=False)
    for panel, length in zip(panels[0], lengths, strict=True):
        for row in report["results"]:
            points = sorted((c["depth"], c["accuracy"]) for c in row["cells"] if c["length"] == length)
            if points:
                panel.plot(*zip(*points, strict=True), marker="o", label=_needle_label(row))
        panel.set(xlabel="needle depth (0: start of the text)", title=f"{length} tokens", ylim=(-0.05, 1.05))
    panels[0][0].set_ylabel("accuracy")
    panels[0][-1].legend(fontsize=8)
    figure.suptitle(f"{report.get('model', '')}: needle retrieval, {report.get('trials', '?')} trial(s) per cell")
    return _save(figure, plt, path)


def _needle_label(row: dict) -> str:
    label = _label(row)
    if row["policy"] != "dense" and row.get("lookahead_from", "input") != "input":
        label += f", lookahead from {row['lookahead_from']}"
    if row["policy"] != "dense" and row.get("attention_lookahead_layers", 1) != 1:
        label += f", {row['attention_lookahead_layers']} layers after attention"
    return label


def _save(figure, plt, path: str | Path) -> Path:
    path = Path(path)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
