"""``infinigen plan``: what a run takes on the GPU and in host memory, before anything loads."""

from __future__ import annotations

from typing import Annotated

import typer

from infinigen.cli.app import command
from infinigen.cli.options import JsonOpt, ModelArg, runtime_options
from infinigen.cli.render import print_pairs, print_rows, printed_json
from infinigen.errors import InfinigenError

CAPACITY_POLICIES = ("dense", "full", "infinigen", "hf-dynamic", "hf-offloaded")  # the capacity table's rows
SHAPE_POSITIONS = 1 << 21  # a random shape's positions: its capacity is the memory's, not a number's


@command
@runtime_options(sweep=False)
def plan(
    runtime: dict,
    model: ModelArg = None,
    shape: Annotated[
        str | None, typer.Option(help="A random-weight shape instead of MODEL (see `infinigen bench --help`).")
    ] = None,
    batch: Annotated[int, typer.Option(help="Sequences decoded together.")] = 1,
    context: Annotated[int, typer.Option(help="Prompt tokens per sequence.")] = 32768,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per sequence.")] = 128,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill chunk in tokens; 0: the prompt in one pass.")] = 4096,
    dtype: Annotated[str, typer.Option(help="The weights' and KV's dtype.")] = "bfloat16",
    bus_gb_s: Annotated[
        float | None,
        typer.Option(help="The host link's GB/s to predict the step at (PCIe Gen4: about 25); default: measured."),
    ] = None,
    padded: Annotated[
        bool, typer.Option(help="Prompts of different lengths (left-padded): the prefill's attention takes a mask.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """The memory plan of a run: each part's bytes on the GPU and in host memory, the settings the GPU
    budget (--gpu-memory-gb, default: this device's free memory) leaves, the largest batch and context
    each policy fits, the decode step's floor at this machine's host->device bandwidth (or --bus-gb-s), and (throughput
    mode, on a GPU) the batch at this context, with the layers streamed for it, of the most tokens/s.

    Examples:\n
      infinigen plan --shape llama-3-8b --gpu-memory-gb 24 --batch 1 --context 131072\n
      infinigen plan smollm2-135m --gpu-memory-gb 2 --context 8192 --json\n
      infinigen plan --shape llama-3-8b --gpu-memory-gb 24 --context 131072 --bus-gb-s 25
    """
    import torch

    from infinigen.models import parse_dtype
    from infinigen.runtime.config import RuntimeConfig
    from infinigen.runtime.memory import plan as memory
    from infinigen.runtime.memory.streaming import prefill_bytes
    from infinigen.runtime.memory.throughput import step_floor_ms

    if min(batch, context) < 1 or new_tokens < 0 or prefill_chunk < 0:
        raise InfinigenError("--batch and --context must be at least 1, --new-tokens and --prefill-chunk at least 0")
    if bus_gb_s is not None and not bus_gb_s > 0:
        raise InfinigenError(f"--bus-gb-s must be a positive rate in GB/s, got {bus_gb_s}")
    config = RuntimeConfig(**runtime)
    torch_dtype = parse_dtype(dtype, "cuda")
    model_config = _config(model, shape, SHAPE_POSITIONS)
    subject = memory.model_of(model_config, torch_dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    budget = memory.budget_bytes(config.gpu_memory_gb, device)
    work = memory.Workload(batch, context, new_tokens, prefill_chunk or None, padded and batch > 1)
    found = memory.plan(subject, torch_dtype, work, config, budget)
    bandwidth = bus_gb_s or _bandwidth(device)
    report = {
        "model": model or shape or "smollm2-135m",
        "dtype": dtype,
        "budget_gb": memory.gb(budget) if budget is not None else None,
        "budget_from": "--gpu-memory-gb" if config.gpu_memory_gb is not None else "free memory" if budget else None,
        **_plan_report(found),
        "step_floor_ms": _rounded(step_floor_ms(found, subject, torch_dtype, bandwidth)),
        # what a chunked prefill moves: each chunk's streamed layers, the earlier chunks' rows read again
        "prefill_moved_gb": _gb(prefill_bytes(found)),
        "prefill_floor_s": None if bandwidth is None else _rounded(prefill_bytes(found) / (bandwidth * 1e9)),
        "pinned_h2d_gb_s": _rounded(bandwidth),
        "bus_from": "--bus-gb-s" if bus_gb_s else "measured" if bandwidth else None,
        "capacity": _capacity(subject, torch_dtype, work, config, budget),
        "throughput": _throughput(subject, torch_dtype, work, config, budget, device, bandwidth),
    }
    available = memory.host_available_bytes()
    report["host_available_gb"] = None if available is None else _gb(available)
    report["fits_host"] = memory.fits_host(found)  # the host memory this machine has now
    if why := memory.why_not(found):
        report["refusal"] = why
    if printed_json(report, as_json):
        return
    _print(report)


def _config(model: str | None, shape: str | None, positions: int):
    if model is not None and shape is not None:
        raise InfinigenError("give MODEL or --shape, not both")
    if shape is not None:
        from infinigen.bench.shapes import shape_config

        return shape_config(shape, positions=positions)
    from infinigen.models import model_config

    return model_config(model)


def _plan_report(found) -> dict:
    from infinigen.runtime.selection.policies import row_bits

    config, work = found.config, found.workload
    return {
        "policy": found.policy,
        "batch": work.batch,
        "context": work.context,
        "new_tokens": work.new_tokens,
        "fits": found.fits,
        "peak_gpu_gb": _gb(found.peak_gpu),
        "needed_gpu_gb": _gb(found.needed_gpu),
        "host_gb": _gb(found.host),
        "shed": list(found.shed),
        "settings": {
            "reuse_rows": "on" if found.reuse else "off",
            "resident_extra": config.resident_extra_or_default if found.reuse else 0.0,
            "resident_bits": (config.resident_bits or 16) if found.reuse else None,
            "dense_layers": config.dense_layers,
            "prefill_chunk": work.prefill_chunk,
            "kv_bits": row_bits(config),
            "streamed_layers": config.streamed_layers or 0,
        },
        "parts": [{"part": p.name, "where": p.where, "when": p.phase, "gb": _gb(p.nbytes)} for p in found.parts],
    }


def _capacity(subject, dtype, work, config, budget) -> list[dict]:
    """Per policy, the largest context at this batch and the largest batch at this context within the
    budget and the host memory available now (a pool or streamed weights it cannot hold do not run; the
    plan's own shedding allowed), by bisection over the plan."""
    from dataclasses import replace

    from infinigen.bench.hf_memory import hf_plan
    from infinigen.runtime.memory import plan as memory

    if budget is None:
        return []
    rows = []
    limit = subject.spec.max_positions
    for name in CAPACITY_POLICIES:

        def fits(batch: int, context: int, name=name) -> bool:
            workload = replace(work, batch=batch, context=context)
            if name.startswith("hf-"):  # transformers' caches: an estimate of what they take
                found = hf_plan(subject, dtype, workload, name, budget)
            else:
                found = memory.plan(subject, dtype, workload, replace(config, policy=name), budget)
            return found.fits and memory.fits_host(found)

        context = memory.largest(lambda n, fits=fits: fits(work.batch, n), 1, limit)
        batch = memory.largest(lambda n, fits=fits: fits(n, work.context), 1, 4096)
        tokens = max(context, batch * work.context if batch else 0)
        rows.append({"policy": name, "largest_context": context or None, "largest_batch": batch or None})
        rows[-1]["largest_tokens"] = tokens or None
    return rows


def _throughput(subject, dtype, work, config, budget, device, bandwidth) -> dict | None:
    """Throughput mode's choice at this context (``memory.throughput``), or None off a GPU (its estimate
    needs the device's measured rates) or where no row fits."""
    from infinigen.runtime.memory.throughput import best_batch, measured_rates

    rates = measured_rates(device, dtype, bandwidth)
    best = None if rates is None or budget is None else best_batch(subject, dtype, work, config, budget, rates)[0]
    if best is None:
        return None
    return best.estimates()


def _bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    from infinigen.bench.runs import pinned_bandwidth

    return pinned_bandwidth(str(device))


def _gb(nbytes: int) -> float:
    return round(nbytes / 1e9, 3)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _print(report: dict) -> None:
    title = f"{report['model']} {report['dtype']}: {report['batch']} x {report['context']} tokens"
    title += f" (+{report['new_tokens']} new), {report['policy']}"
    print_rows(title, {"part": "part", "where": "where", "when": "when", "GB": "gb"}, report["parts"])
    settings = report["settings"]
    summary = {
        "GPU budget": "none" if report["budget_gb"] is None else f"{report['budget_gb']} GB ({report['budget_from']})",
        "GPU peak": f"{report['peak_gpu_gb']} GB (with the allocator's slack {report['needed_gpu_gb']} GB)",
        "fits": "no: the GPU" if not report["fits"] else "no: host memory" if not report["fits_host"] else "yes",
        "host": f"{report['host_gb']} GB"
        + ("" if report["host_available_gb"] is None else f" ({report['host_available_gb']} GB available now)")
        + ("" if report["fits_host"] else ": does not fit"),
        "settings": ", ".join(f"{key} {value}" for key, value in settings.items()),
        "given up": "; ".join(report["shed"]) or "nothing",
        "decode step floor": "n/a (no GPU)"
        if report["step_floor_ms"] is None
        else f"{report['step_floor_ms']} ms at {report['pinned_h2d_gb_s']} GB/s ({report['bus_from']})",
        "prefill over the bus": f"{report['prefill_moved_gb']} GB (streamed layers, earlier chunks' rows read again)"
        + ("" if report["prefill_floor_s"] is None else f": at least {report['prefill_floor_s']} s"),
    }
    best = report["throughput"]
    summary["most tokens/s"] = (
        "n/a (no GPU or nothing fits)"
        if best is None
        else f"batch {best['batch']} with {best['streamed_layers']} layers streamed: about "
        f"{best['tokens_per_s_estimate']} tokens/s over the run ({best['prefill_s_estimate']} s prefill, "
        f"{best['step_ms_estimate']} ms a step, estimated)"
    )
    print_pairs("memory plan", summary)
    if report["capacity"]:
        columns = {"policy": "policy", "largest context": "largest_context", "largest batch": "largest_batch"}
        columns["tokens (batch x context)"] = "largest_tokens"
        host = "" if report["host_available_gb"] is None else f" and {report['host_available_gb']} GB of host memory"
        print_rows(f"within {report['budget_gb']} GB of GPU{host}", columns, report["capacity"])
    if "refusal" in report:
        print_pairs("does not fit", {"why": report["refusal"]})
