"""``infinigen bench --profile``: where a case's decode step spends its GPU time and memory. Each case
runs as the sweep runs it (prefill, warm-up and timed steps), then:

- ``kernels``: kernel time per step by kernel name (torch.profiler over replayed steps). The transfer
  stream's gathers run beside the compute stream, so the times add up to more than the step.
- ``timeline``: per stream (compute, selection, transfer), its kernels and their time a step; and per
  step the transfer stream's idle time: the gap between one step's last row gather and the next step's
  first (the step boundary: the last layer, the LM head, the dense layers and the first selection, before
  any selection is known), the gaps between gathers inside the step, and the gathers' own time
  (compare with ``--breakdown``'s transfer-only time).
- ``memory``: what the GPU holds beyond what was allocated before the case (the weights): live and
  peak, against the dense KV cache's size, and the live blocks grouped by the line of this package
  that allocated them (PyTorch's allocation history).

Needs CUDA: it reads CUDA kernels, streams and allocations.
"""

from __future__ import annotations

import collections
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel

from infinigen.architectures import model_spec
from infinigen.artifacts import Artifact
from infinigen.bench.runs import BenchCase, Decoder, case_label, make_cache, release_cached_memory
from infinigen.errors import InfinigenError

PROFILES = ("kernels", "timeline", "memory")
STEPS = 6  # profiled steps after the timed ones
TOP_KERNELS = 30  # rows of the kernels table
TOP_PER_STREAM = 6
TOP_SITES = 12
GATHER = "_gather_kernel"  # the row gather (kernels.transfer), not PyTorch's gather kernels of a selection
SELECTION = {"_quantized_scores_kernel", "_histogram_kernel"}  # kernels only the selection stream runs


def parse_profiles(text: str) -> tuple[str, ...]:
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in PROFILES]
    if unknown or not kinds:
        raise InfinigenError(f"--profile takes {', '.join(PROFILES)} (comma-separated), got {text!r}")
    return kinds


@torch.no_grad()
def profile_case(
    model: PreTrainedModel,
    artifact: Artifact | None,
    case: BenchCase,
    kinds: tuple[str, ...],
    text_ids: torch.Tensor | None = None,
) -> dict:
    """The ``kinds`` of profile of one case (see the module's docstring)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise InfinigenError("--profile needs a CUDA device: it reads CUDA kernels, streams and allocations")
    release_cached_memory(device)
    report: dict = {"case": case_label(case), "policy": case.policy, "batch": case.batch, "context": case.prompt_len}
    before = torch.cuda.memory_allocated(device)
    if "memory" in kinds:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    cache = None
    try:
        cache = make_cache(model, artifact, case)
        decoder = Decoder(model, cache, case, text_ids)
        decoder.prefill_seconds()
        report["ms_per_step"] = round(decoder.step_seconds() * 1e3, 3)
        if "memory" in kinds:
            live = torch.cuda.memory_allocated(device) - before
            peak = max(decoder.warmup_peak, torch.cuda.max_memory_allocated(device)) - before
            report["memory"] = memory_report(torch.cuda.memory._snapshot(), live, peak, dense_kv_bytes(model, case))
        if "kernels" in kinds or "timeline" in kinds:
            events = kernel_events(decoder, STEPS)
            if "kernels" in kinds:
                report["kernels"] = kernel_rows(events, STEPS)
            if "timeline" in kinds:
                report["timeline"] = timeline(events, STEPS)
    finally:
        if "memory" in kinds:
            torch.cuda.memory._record_memory_history(enabled=None)
        if hasattr(cache, "close"):
            cache.close()
    return report


def kernel_events(decoder: Decoder, steps: int) -> list[dict]:
    """The CUDA kernels of ``steps`` more decode steps, as the profiler's trace events (name, stream, ts, dur in us)."""
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            decoder.forward(decoder.token)
        torch.cuda.synchronize(decoder.device)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


def kernel_rows(events: list[dict], steps: int) -> list[dict]:
    """Kernel time a step by name, most first."""
    time, calls = collections.Counter(), collections.Counter()
    for e in events:
        time[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    return [
        {"kernel": name[:100], "ms_per_step": round(total / 1e3 / steps, 3), "calls_per_step": calls[name] // steps}
        for name, total in time.most_common(TOP_KERNELS)
    ]


def timeline(events: list[dict], steps: int) -> dict:
    """Per stream its role, kernels and time a step; per step (the first, which starts with the profiler,
    left out) the transfer stream's boundary gap, gaps inside and gathers' time (ms)."""
    streams: dict = collections.defaultdict(list)
    for e in events:
        streams[e["args"].get("stream")].append(e)
    rows = []
    for stream, kernels in streams.items():
        names = {e["name"] for e in kernels}
        role = "transfer" if GATHER in names else "selection" if SELECTION & names else "compute"
        by_name = collections.Counter()
        for e in kernels:
            by_name[e["name"]] += e["dur"]
        top = [{"kernel": n[:80], "ms_per_step": round(t / 1e3 / steps, 3)} for n, t in by_name.most_common()]
        rows.append(
            {
                "stream": stream,
                "role": role,
                "kernels_per_step": len(kernels) // steps,
                "ms_per_step": round(sum(e["dur"] for e in kernels) / 1e3 / steps, 3),
                "top": top[:TOP_PER_STREAM],
            }
        )
    gathers = sorted((e for e in events if e["name"] == GATHER), key=lambda e: e["ts"])
    per_step = len(gathers) // steps
    step_rows = []
    for s in range(1, steps) if per_step else ():
        chunk = gathers[s * per_step - 1 : (s + 1) * per_step]  # the previous step's last gather, then this step's
        gaps = [(b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in zip(chunk, chunk[1:], strict=False)]
        step_rows.append(
            {
                "step": s,
                "boundary_ms": round(gaps[0], 3),
                "gaps_inside_ms": round(sum(gaps[1:]), 3),
                "gathers_ms": round(sum(g["dur"] for g in chunk[1:]) / 1e3, 3),
            }
        )
    return {"gathers_per_step": per_step, "steps": step_rows, "streams": rows}


def dense_kv_bytes(model: PreTrainedModel, case: BenchCase) -> int:
    """What a GPU-resident cache of the case's tokens takes (K and V of every layer)."""
    spec = model_spec(model.config)
    element = next(model.parameters()).element_size()
    return case.batch * case.prompt_len * spec.n_layers * spec.n_kv_heads * spec.head_dim * 2 * element


def allocation_site(frames: list[dict]) -> str:
    """The first frame inside this package (the line that asked for the memory), else the first three."""
    for frame in frames:
        name = frame["filename"].replace("\\", "/")
        if "/infinigen/" in name and "/infinigen/bench/" not in name:
            return f"{name.split('/infinigen/')[-1]}:{frame['line']} {frame['name']}"
    return "elsewhere: " + "; ".join(f"{f['filename'].split('/')[-1]}:{f['line']}" for f in frames[:3])


def memory_report(snapshot: dict, live: int, peak: int, dense_kv: int) -> dict:
    """Live and peak bytes beyond what was there before, against ``dense_kv``; the live blocks that the
    allocation history saw, by allocation site (blocks allocated before it started have no frames)."""
    sites = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):
                sites[allocation_site(block["frames"])] += block["size"]
    return {
        "dense_kv_gb": round(dense_kv / 1e9, 3),
        "live_gb": round(live / 1e9, 3),
        "live_share_of_dense_kv": round(live / dense_kv, 4),
        "peak_gb": round(peak / 1e9, 3),
        "peak_share_of_dense_kv": round(peak / dense_kv, 4),
        "sites": [
            {"site": site, "mb": round(size / 1e6, 1), "share_of_dense_kv": round(size / dense_kv, 4)}
            for site, size in sites.most_common(TOP_SITES)
        ],
    }
