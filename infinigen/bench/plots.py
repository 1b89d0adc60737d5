"""PNG plots of `infinigen bench` reports (their --json output). Needs matplotlib."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from infinigen.plotting import lines, pyplot, save, tick_at, tokens


def widest_sweep(rows: list[dict], fixed: str, swept: str):
    """The value of ``fixed`` whose rows sweep the most values of ``swept`` (the largest on ties):
    a report joining a context sweep at one batch and a batch sweep at one context plots both."""
    values = defaultdict(set)
    for row in rows:
        values[row[fixed]].add(row[swept])
    return max(values, key=lambda value: (len(values[value]), value))


def plot_bench(report: dict, path: str | Path) -> Path:
    """Decode tokens/s vs context length and vs batch, one line per policy (and budget)."""
    plt = pyplot()
    rows = report["results"]
    batch, context = widest_sweep(rows, "batch", "prompt_len"), widest_sweep(rows, "prompt_len", "batch")
    figure, (by_context, by_batch) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in lines([r for r in rows if r["batch"] == batch], "prompt_len", "decode_tok_s").items():
        by_context.plot(*points, marker="o", label=label)
    for label, points in lines([r for r in rows if r["prompt_len"] == context], "batch", "decode_tok_s").items():
        by_batch.plot(*points, marker="o", label=label)
    by_context.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode tokens/s")
    by_context.set_title(f"batch {batch}")
    by_batch.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s")
    by_batch.set_title(f"context {context}")
    tick_at(by_context, sorted({r["prompt_len"] for r in rows if r["batch"] == batch}), tokens)
    tick_at(by_batch, sorted({r["batch"] for r in rows if r["prompt_len"] == context}), str)
    by_batch.legend(fontsize=8)
    figure.suptitle(f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}")
    return save(figure, plt, path)


def plot_micro(report: dict, path: str | Path) -> Path:
    """`bench --micro`: the selective gather's GB/s vs MB per call, one line per context (dashed for
    8-bit rows), beside the same run's pinned bulk copy (and 80% of it); speculation per layer vs our
    dense layer per context."""
    plt = pyplot()
    figure, (gather, speculation) = plt.subplots(1, 2, figsize=(11, 4.2))
    for context, bits in sorted({(row["context"], row["kv_bits"]) for row in report["gather"]}):
        rows = [r for r in report["gather"] if (r["context"], r["kv_bits"]) == (context, bits)]
        rows.sort(key=lambda r: r["bytes"])
        label, style = (tokens(context), "-") if bits == 16 else (f"{tokens(context)}, {bits}-bit", "--")
        gather.plot([r["bytes"] / 1e6 for r in rows], [r["gb_s"] for r in rows], style, marker="o", label=label)
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
    tick_at(speculation, contexts, tokens)
    speculation.legend(fontsize=8)
    figure.suptitle(f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}")
    return save(figure, plt, path)
