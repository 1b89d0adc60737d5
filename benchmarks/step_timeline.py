"""Where the transfer stream idles inside captured decode steps: torch.profiler's trace of replayed
``StepGraph`` steps, random-weight Llama-3-8B shape, bfloat16, ``infinigen`` at the given budgets.
Per step: the gap between the last gather of one step and the first of the next (the step boundary:
the last layer's compute, the LM head, the dense layers and the first selection, when no selection
is known yet), the gaps between gathers inside the step, and the gathers' total time (compare with
``bench --breakdown``'s transfer-only time); per stream, kernels and their time. Needs CUDA.

    python benchmarks/step_timeline.py 1 32768 0.1,0.2          # batch, context, budgets
    python benchmarks/step_timeline.py 1 32768 0.1 --chain      # and one layer's kernels, in order
    python benchmarks/step_timeline.py 8 16384 0.1 kv_bits=8 resident_extra=2 reuse_rows=on  # RuntimeConfig fields
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from profiling import profiled_steps, settings_from

from infinigen.bench.shapes import random_artifact, random_model

STEPS = 6
TOP = 6  # kernels listed per stream
SELECTION = {"_quantized_scores_kernel", "_histogram_kernel"}  # kernels only the selection stream runs


def kernels(batch: int, context: int, budget: float, model, artifact, settings: dict) -> tuple[float, list[dict]]:
    """The median step (ms) and the kernel events of ``STEPS`` profiled steps."""
    step_ms, profiler = profiled_steps(model, artifact, batch, context, budget, STEPS, **settings)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    profiler.export_chrome_trace(str(trace))
    return step_ms, [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]


def row_moves(events: list[dict]) -> list[dict]:
    """The row gathers (``transfer._gather_kernel``), not PyTorch's own gather kernels of the selection."""
    return [e for e in events if e["name"] == "_gather_kernel"]


def report(batch: int, context: int, budget: float, step_ms: float, events: list[dict]) -> None:
    gathers = sorted(row_moves(events), key=lambda e: e["ts"])
    per_step = len(gathers) // STEPS
    print(f"\n{batch} x {context}, infinigen {budget}: step {step_ms:.2f} ms (median), {per_step} gathers a step")
    for s in range(1, STEPS):  # step 0 starts with the profiler
        chunk = gathers[s * per_step - 1 : (s + 1) * per_step]  # the previous step's last gather, then this step's
        gaps = [(b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in zip(chunk, chunk[1:], strict=False)]
        busy = sum(g["dur"] for g in chunk[1:]) / 1e3
        print(f"  step {s}: boundary {gaps[0]:.3f} ms, gaps inside {sum(gaps[1:]):.3f} ms, gathers {busy:.3f} ms")
    streams: dict = {}
    for e in events:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    for stream, kernels in streams.items():
        names = {e["name"] for e in kernels}
        role = "transfer" if "_gather_kernel" in names else "selection" if SELECTION & names else "compute"
        per_step_ms = sum(e["dur"] for e in kernels) / 1e3 / STEPS
        print(f"  stream {stream} ({role}): {len(kernels) // STEPS} kernels, {per_step_ms:.2f} ms a step; most time:")
        by_name: dict = {}
        for e in kernels:
            by_name[e["name"]] = by_name.get(e["name"], 0) + e["dur"]
        for name, total in sorted(by_name.items(), key=lambda item: -item[1])[:TOP]:
            print(f"    {total / 1e3 / STEPS:6.2f} ms  {name[:80]}")


def chain(events: list[dict]) -> None:
    """Every kernel from ~1.5 ms before a gather in the middle of step 3 to its end, in start order:
    T transfer, S selection, C compute stream (C kernels under 3 us left out)."""
    events = sorted(events, key=lambda e: e["ts"])
    gathers = row_moves(events)
    transfer = gathers[0]["args"]["stream"]
    selection = next((e["args"]["stream"] for e in events if e["name"] in SELECTION), None)
    middle = gathers[3 * (len(gathers) // STEPS) + len(gathers) // STEPS // 3]
    window = [e for e in events if middle["ts"] - 1500 <= e["ts"] <= middle["ts"] + middle["dur"] + 300]
    for e in window:
        stream = e["args"]["stream"]
        role = "T" if stream == transfer else "S" if stream == selection else "C"
        if role != "C" or e["dur"] >= 3:
            print(f"  {role} {e['ts'] - window[0]['ts']:8.1f} +{e['dur']:6.1f} us  {e['name'][:70]}")


def main(batch: int, context: int, budgets: list[float], show_chain: bool, settings: dict) -> None:
    model = random_model("llama-3-8b", "cuda", torch.bfloat16)
    artifact = random_artifact(model, "llama-3-8b", 0.5)
    for budget in budgets:
        step_ms, events = kernels(batch, context, budget, model, artifact, settings)
        report(batch, context, budget, step_ms, events)
        if show_chain:
            chain(events)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    budgets = [float(b) for b in sys.argv[3].split(",")]
    main(int(sys.argv[1]), int(sys.argv[2]), budgets, "--chain" in sys.argv, settings_from(sys.argv[4:]))
