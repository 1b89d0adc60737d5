"""PNG plots of `infinigen eval` reports (their --json output). Needs matplotlib."""

from __future__ import annotations

from pathlib import Path

from infinigen.plotting import lines, policy_label, pyplot, save


def plot_tasks(report: dict, path: str | Path) -> Path:
    """An `eval tasks` report: the mean of the tasks' acc vs fraction of the KV fetched, one line per policy."""
    rows = [{**row, **row["average"]} for row in report["results"]]
    return plot_accuracy({**report, "results": rows}, path, metric="acc")


def plot_accuracy(report: dict, path: str | Path, metric: str = "perplexity") -> Path:
    """``metric`` vs fraction of the KV fetched (16-bit equivalent bytes), one line per policy."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    rows = [dict(r, fraction=r.get("fraction_bytes", r.get("fraction_fetched"))) for r in report["results"]]
    allocations = {row.get("allocation") for row in rows} - {None}
    for row in rows:  # one line per policy and setting other than the budget
        alpha = row.get("alpha")  # "inf" in JSON: the budget alone
        finite = isinstance(alpha, (int, float)) and alpha < 1e6
        setting = f" α {alpha:g}" if row["policy"] == "infinigen" and finite else ""
        if len(allocations) > 1 and row.get("allocation"):
            setting += f" {row['allocation']}"
        if row.get("pool_fraction"):
            setting += f" pool {row['pool_fraction']:g} {row.get('eviction', '')}"
        row.update(policy=row["policy"] + setting, budget=None)
    for policy, points in lines(rows, "fraction", metric).items():
        if policy == "dense":
            axes.axhline(points[1][0], color="black", linestyle="--", label="dense")
        else:
            axes.plot(*points, marker="o", label=policy)
    scale = "log" if metric == "perplexity" else "linear"
    axes.set(xlabel="fraction of the KV moved per step (16-bit equivalent)", ylabel=metric, yscale=scale)
    axes.set_title(f"{report.get('model', '')}: {metric} vs KV fetched")
    axes.legend(fontsize=8)
    return save(figure, plt, path)


def plot_needle(report: dict, path: str | Path) -> Path:
    """An `eval needle` report: accuracy vs the needle's depth, one panel per prompt length, one line
    per policy (and budget, and lookahead settings other than the defaults)."""
    plt = pyplot()
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
    return save(figure, plt, path)


def _needle_label(row: dict) -> str:
    label = policy_label(row)
    if row["policy"] != "dense" and row.get("lookahead_from", "input") != "input":
        label += f", lookahead from {row['lookahead_from']}"
    if row["policy"] != "dense" and row.get("attention_lookahead_layers", 1) != 1:
        label += f", {row['attention_lookahead_layers']} layers after attention"
    return label
