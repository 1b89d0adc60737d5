"""``infinigen bench``: decode speed of every policy in one process, and micro-benchmarks."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from infinigen.bench import HF_BASELINES
from infinigen.cli.app import command
from infinigen.cli.options import DECODE_ONLY, DeviceOpt, JsonOpt, parse_list, runtime_options
from infinigen.cli.render import note, print_pairs, print_rows, printed_json, progress, stream_row
from infinigen.errors import InfinigenError

ShapeOpt = Annotated[
    str,
    typer.Option(
        help="Random-weight model shape: opt-6.7b, opt-13b, opt-30b, llama-2-7b, llama-3-8b, tiny-llama; under "
        "torchrun llama-3-70b, qwen2.5-72b (llama-3-70b-tp2-rank / -tp4-rank: one rank's share, for one GPU)."
    ),
]
LayersOpt = Annotated[
    int | None,
    typer.Option(help="--shape: this many decoder layers of the shape's size instead of all (a step grows by layer)."),
]
RealModelOpt = Annotated[
    str | None, typer.Option(help="Real weights instead of --shape: alias, Hub id, checkpoint folder or GGUF file.")
]
RealArtifactOpt = Annotated[str | None, typer.Option(help="With --model: its artifact folder or Hub id.")]
PromptTextOpt = Annotated[
    Path | None, typer.Option(help="With --model: prompts cut from this text, row after row. Default: random.")
]
RepeatOpt = Annotated[int, typer.Option(help="Runs of each case (own cache and prefill); the median is reported.")]
BatchOpt = Annotated[str, typer.Option(help="Batch sizes, comma-separated (a sweep).")]
PromptLenOpt = Annotated[str, typer.Option(help="Context lengths before decoding, comma-separated.")]
SizesOpt = Annotated[
    str | None,
    typer.Option(
        help="Batch x context pairs, comma-separated (8x16384,1x131072): instead of every --batch with every "
        "--prompt-len, each pair in one run (one model load). autoxN: the batch with the most tokens/s the plan "
        "estimates for the first policy of ours within the GPU budget (throughput mode); accelerate's baselines at "
        "the largest batch their cache leaves weights room for (their best)."
    ),
]
GenLenOpt = Annotated[int, typer.Option(help="Timed decode steps (after 3 warm-up steps).")]
RatioOpt = Annotated[
    str, typer.Option(help="--shape: partial channels as a share of head_dim, comma-separated (an artifact each).")
]
GraphsOpt = Annotated[
    str,
    typer.Option(
        help="CUDA graphs: step (whole decode steps), selection (transformers' loop, selections only), off; "
        "or a comma-separated sweep."
    ),
]
BreakdownOpt = Annotated[
    bool, typer.Option(help="Also time each offloaded step compute-only, transfer-only, without selecting.")
]
MicroOpt = Annotated[
    bool, typer.Option(help="Micro-benchmarks instead: the gather vs the bulk copy, speculation vs a layer.")
]
MicroContextsOpt = Annotated[str, typer.Option(help="Context lengths of --micro.")]
ReserveHostOpt = Annotated[
    float,
    typer.Option(
        help="Pin this many GB of host memory for the pools while the model loads (as a server would at "
        "start-up): the first cache's prefill then takes its blocks from it. 0: each prefill pins its own."
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        help="After the sweep, profile each case (CUDA): kernels (GPU time by kernel), timeline (each stream's "
        "kernels, the transfer stream's idle gaps), memory (what the GPU holds by allocating line); comma-separated."
    ),
]
PrefillChunkOpt = Annotated[
    int,
    typer.Option(
        help="Prefill in chunks of this many tokens, as `generate` does (the plan may halve it); 0: one pass."
    ),
]
PlotOpt = Annotated[Path | None, typer.Option(help="Write a PNG: tokens/s vs context and vs batch (or --micro's).")]


@command
@runtime_options(sweep=True, defaults={"policy": "dense,full,infinigen"}, more_policies=HF_BASELINES, omits=DECODE_ONLY)
def bench(
    runtime: dict,
    shape: ShapeOpt = "llama-3-8b",
    layers: LayersOpt = None,
    model: RealModelOpt = None,
    artifact: RealArtifactOpt = None,
    text: PromptTextOpt = None,
    repeat: RepeatOpt = 1,
    batch: BatchOpt = "8",
    prompt_len: PromptLenOpt = "16384",
    sizes: SizesOpt = None,
    gen_len: GenLenOpt = 16,
    ratio: RatioOpt = "0.5",
    graphs: GraphsOpt = "step",
    breakdown: BreakdownOpt = False,
    micro: MicroOpt = False,
    micro_contexts: MicroContextsOpt = "4096,16384,32768,131072",
    reserve_host_gb: ReserveHostOpt = 0.0,
    profile: ProfileOpt = None,
    prefill_chunk: PrefillChunkOpt = 4096,
    plot: PlotOpt = None,
    dtype: Annotated[str, typer.Option(help="Model dtype.")] = "bfloat16",
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decode throughput of each policy on one model, in one process, with the pinned host->device
    bandwidth measured in the same process. Random weights make attention near uniform, so
    budgeted policies fetch their budget's share of the cached tokens.

    Examples:\n
      infinigen bench --shape llama-3-8b --batch 8 --prompt-len 16384 --policy dense,full,infinigen\n
      infinigen bench --prompt-len 4096,16384,32768 --batch 1,8 --budget 0.1,0.2 --plot bench.png\n
      infinigen bench --sizes 8x16384 --policy infinigen --kv-bits 8 --profile timeline,memory\n
      infinigen bench --micro
    """
    import torch

    from infinigen.bench import auto_batch, bounds
    from infinigen.bench.micro import micro_report
    from infinigen.bench.plots import plot_bench, plot_micro
    from infinigen.bench.profiles import parse_profiles
    from infinigen.bench.runs import bench_cases, load_subject, pinned_bandwidth, subject_artifacts
    from infinigen.bench.shapes import shape_config
    from infinigen.models import model_config, resolve_device
    from infinigen.prepare import DEFAULT_RATIO
    from infinigen.runtime.memory import host_memory
    from infinigen.runtime.memory import plan as memory
    from infinigen.runtime.selection.policies import settings_grid
    from infinigen.tensor_parallel import summed, weight_bytes, world_size

    if repeat < 1 or gen_len < 1:
        raise InfinigenError(f"--repeat and --gen-len must be at least 1, got {repeat} and {gen_len}")
    if model is not None and ratio != str(DEFAULT_RATIO):
        raise InfinigenError("--ratio sweeps random artifacts (--shape); with --model the artifact sets it")
    batches, lengths = parse_list(batch, "--batch", int), parse_list(prompt_len, "--prompt-len", int)
    pairs = auto_batch.parse_sizes(sizes) if sizes is not None else [(batches, lengths)]
    modes, ratios = parse_list(graphs, "--graphs", str), parse_list(ratio, "--ratio")
    contexts = parse_list(micro_contexts, "--micro-contexts", int)
    device = resolve_device(device)
    gpu_memory_gb = _one(runtime.pop("gpu_memory_gb"), "--gpu-memory-gb")
    occupier = _occupied(gpu_memory_gb, device)  # before anything here touches the device
    profiles = parse_profiles(profile) if profile is not None else ()
    if profiles and not device.startswith("cuda"):
        raise InfinigenError(
            f"--profile needs a CUDA device: it reads CUDA kernels, streams and allocations, got {device}"
        )
    if reserve_host_gb < 0:
        raise InfinigenError(f"--reserve-host-gb must be at least 0, got {reserve_host_gb}")
    start = time.perf_counter()
    reserved = []
    if reserve_host_gb:
        reserved = host_memory.reserve_host_memory(int(reserve_host_gb * 1e9), torch.device(device))
    budget = memory.budget_bytes(gpu_memory_gb, torch.device(device))
    grid = settings_grid(runtime)
    chunk = prefill_chunk or None
    subject_config = model_config(model) if model is not None else shape_config(shape, layers)
    pairs, throughput = auto_batch.resolve(pairs, grid, subject_config, dtype, device, budget, chunk)
    cases = [
        case
        for b, n in pairs
        for case in bench_cases(grid, b, n, gen_len, graphs=modes, ratios=ratios, prefill_chunk=chunk)
    ]
    cases = auto_batch.baselines_at_their_batch(cases, throughput, subject_config, dtype, device, budget)
    cases, streamed = _with_streamed_layers(cases, throughput, subject_config, dtype, device, budget)
    text = None if text is None else str(text)
    subject = load_subject(shape, model, artifact, text, device, dtype, layers, streamed)
    loaded_s = time.perf_counter() - start
    if as_json:
        note(f"[{loaded_s:.0f} s] model ready ({subject.shape or model})")
    for region in reserved:  # pinned before anything is timed
        region.result()
    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    weights_gb = weight_bytes(subject.model) / 1e9  # under torchrun: this rank's shards
    report = {
        "shape": subject.shape,
        "layers": subject.model.config.num_hidden_layers,
        "model": model,
        "dtype": dtype,
        "device": card,
        "weights_gb": round(weights_gb, 2),
        "gpu_memory_gb": gpu_memory_gb,  # the card's usable memory, the rest held by another process
        "gpu_held_by_another_process_gb": round(occupier.held_bytes / 1e9, 2) if occupier else None,
        "gpu_budget_gb": memory.gb(budget) if budget is not None else None,
    }
    if throughput:
        report["throughput_plan"] = throughput
    if reserved:  # beside the loading; what was left of it waited for before the first case
        reserved_s = time.perf_counter() - start
        report |= {"host_reserve_gb": reserve_host_gb, "host_reserved_s": round(reserved_s, 2)}
        report |= {"load_s": round(loaded_s, 2), "host_reserve_wait_s": round(max(0.0, reserved_s - loaded_s), 2)}
    if micro:
        from infinigen.runtime.config import RuntimeConfig
        from infinigen.runtime.selection.policies import row_bits

        formats = [bits or row_bits(RuntimeConfig()) for bits in runtime["kv_bits"]]
        report |= micro_report(subject.model, contexts, runtime["budget"][0], formats)
        if plot is not None:
            report["plot"] = str(plot_micro(report, plot))
        if not printed_json(report, as_json):
            _print_micro(report)
        return
    artifacts = subject_artifacts(subject, cases)
    bandwidth = pinned_bandwidth(device)
    report["pinned_h2d_gb_s"] = round(bandwidth, 1) if bandwidth is not None else None
    if world_size() > 1:  # the physical limit: every rank's link in use at once (each rank's rows are its own)
        report["ranks"] = world_size()
        report["pinned_h2d_all_ranks_gb_s"] = round(summed(bandwidth, device), 1) if bandwidth is not None else None
    rates = bounds.measured(subject.model.device, subject.model.dtype, bandwidth)  # the bounds' (``bench.bounds``)
    report |= {"matmul_tflop_s": round(rates.matmul_tflop_s, 2), "device_gb_s": round(rates.memory_gb_s, 1)}
    results, split_rows = _run(subject, artifacts, cases, repeat, breakdown, as_json, budget, rates)
    report |= {"results": results, "breakdown": split_rows}
    if throughput:
        report["throughput_plan"] = [auto_batch.measured_run(plan, results) for plan in throughput]
    if profiles:
        report["profiles"] = _profiled(subject, artifacts, cases, profiles, as_json, budget)
    if plot is not None:
        report["plot"] = str(plot_bench(report, plot))
    if not printed_json(report, as_json):
        _print_bench(report)
        _print_profiles(report.get("profiles", []))


def _one(values: list, option: str):
    """A setting of the whole process, not of a case: one value."""
    if len(values) != 1:
        raise InfinigenError(f"{option} takes one value in a benchmark (the card it simulates), got {len(values)}")
    return values[0]


def _occupied(gpu_memory_gb: float | None, device: str):
    """With --gpu-memory-gb on CUDA: another process holding the rest of the device (``bench.occupy``)."""
    if gpu_memory_gb is None or not device.startswith("cuda"):
        return None
    from infinigen.bench.occupy import Occupier

    return Occupier(gpu_memory_gb, device)


def _with_streamed_layers(cases: list, throughput: list[dict], subject_config, dtype: str, device: str, budget):
    """``cases`` with the layers each case of ours streams, and the settings the model loads with (``_streamed``):
    an auto batch streams as many layers as the throughput plan chose it with (the host memory the plan
    admitted is its pool beside those layers' weights; with more layers in host memory its pool may not fit)."""
    streamed = _streamed(subject_config, dtype, device, budget, cases)
    planned = {(e["batch"], e["context"]): e["streamed_layers"] for e in throughput}
    for i, c in enumerate(cases):
        if c.ours and c.config.streamed_layers is None and (c.batch, c.prompt_len) in planned:
            cases[i] = replace(c, runtime=c.runtime | {"streamed_layers": planned[(c.batch, c.prompt_len)]})
    if streamed is None:  # the weights fit: each case's layers move out for its run alone
        return cases, None
    streamed = _streamed(subject_config, dtype, device, budget, cases)  # one load: the auto batch's count
    for i, c in enumerate(cases):  # every case of ours runs with its layers (its plan counts them)
        if c.ours:
            cases[i] = replace(c, runtime=c.runtime | {"streamed_layers": streamed.streamed_layers})
    return cases, streamed


def _streamed(subject_config, dtype: str, device: str, budget, cases: list):
    """The settings whose decoder layers stay in host memory for the whole sweep, or None: the cases of ours
    as ``streaming.streamed_for`` weighs runs (each case as asked, or as its plan streams)."""
    from infinigen.models import parse_dtype
    from infinigen.runtime.memory import plan as memory
    from infinigen.runtime.memory import streaming

    torch_dtype = parse_dtype(dtype, device)
    runs = [
        (memory.Workload(case.batch, case.prompt_len, case.warmup + case.gen_len, case.prefill_chunk), case.config)
        for case in cases
        if case.ours
    ]
    return streaming.streamed_for(memory.model_of(subject_config, torch_dtype), torch_dtype, runs, budget)


def _run(
    subject, artifacts: dict, cases: list, repeat: int, breakdown: bool, as_json: bool, budget: int | None, rates
) -> tuple[list, list]:
    """The sweep, with a progress bar for people or each row on stderr as JSON for machines, each row with its
    bounds at ``rates``."""
    from infinigen.bench.bounds import with_bound
    from infinigen.bench.sweep import run_sweep

    splits = sum(breakdown and case.policy in ("full", "infinigen") for case in cases)
    started = time.perf_counter()
    with progress(disable=as_json) as bar:
        running = bar.add_task("cases", total=len(cases) + splits)
        done = iter(range(len(cases) + splits))

        def on_case(label: str) -> None:
            bar.update(running, description=label, completed=next(done))
            if as_json:
                note(f"[{time.perf_counter() - started:.0f} s into the cases] {label}")

        rows = run_sweep(
            subject.model,
            artifacts,
            cases,
            repeat=repeat,
            text_ids=subject.text_ids,
            split=breakdown,
            on_case=on_case,
            on_row=(lambda row: stream_row(with_bound(row, rates))) if as_json else lambda row: None,
            budget=budget,
        )
        bar.update(running, completed=len(cases) + splits)
    return [with_bound(row, rates) for row in rows[0]], rows[1]


def _profiled(subject, artifacts: dict, cases: list, profiles: tuple[str, ...], as_json: bool, budget) -> list[dict]:
    """Each case profiled as the sweep ran it: under its memory plan (its prefill chunk, its settings)."""
    import dataclasses
    import functools

    from infinigen.bench.profiles import STEPS, profile_case
    from infinigen.bench.runs import case_label, unless_out_of_memory
    from infinigen.bench.sweep import planned_case

    rows = []
    with progress(disable=as_json) as bar:
        running = bar.add_task("profiles", total=len(cases))
        for done, asked in enumerate(cases):
            bar.update(running, description=f"{case_label(asked)}, profile", completed=done)
            # planned for the steps profiled after the timed ones too: the cache must not outgrow its plan
            longer = dataclasses.replace(asked, gen_len=asked.gen_len + STEPS)
            planned, refused, _ = planned_case(subject.model, longer, budget)
            if refused is not None:
                rows.append(refused)
                continue
            case = dataclasses.replace(planned, gen_len=asked.gen_len)
            run = functools.partial(
                profile_case, subject.model, artifacts[case.ratio], case, profiles, subject.text_ids
            )
            rows.append(unless_out_of_memory(run, case, subject.model.device))
        bar.update(running, completed=len(cases))
    return rows


def _print_profiles(profiles: list[dict]) -> None:
    for report in profiles:
        name = report.get("case") or f"{report['policy']}, {report['batch']} x {report['prompt_len']}"
        if "error" in report:
            print_rows(f"profile of {name}", {"error": "error"}, [report])
            continue
        title = f"{name}: {report['ms_per_step']} ms a step"
        if "kernels" in report:
            columns = {"kernel": "kernel", "ms/step": "ms_per_step", "calls/step": "calls_per_step"}
            print_rows(f"{title}, GPU time by kernel", columns, report["kernels"])
        if "timeline" in report:
            streams = [
                row | {"most time": "; ".join(f"{k['ms_per_step']} {k['kernel'][:40]}" for k in row["top"][:3])}
                for row in report["timeline"]["streams"]
            ]
            columns = {"stream": "stream", "role": "role", "kernels/step": "kernels_per_step"}
            columns |= {"ms/step": "ms_per_step", "most time (ms/step)": "most time"}
            print_rows(f"{title}, streams", columns, streams)
            columns = {"step": "step", "boundary ms": "boundary_ms", "gaps inside ms": "gaps_inside_ms"}
            print_rows("transfer stream idle", columns | {"gathers ms": "gathers_ms"}, report["timeline"]["steps"])
        if "memory" in report:
            memory = report["memory"]
            title += (
                f", GPU beyond the weights: live {memory['live_gb']} GB, peak {memory['peak_gb']} GB"
                f" (dense KV {memory['dense_kv_gb']} GB)"
            )
            columns = {"allocated at": "site", "MB": "mb", "of dense KV": "share"}
            sites = [row | {"share": _percent(row["share_of_dense_kv"])} for row in memory["sites"]]
            print_rows(title, columns, sites)


def _percent(share: float | None) -> str:
    return "" if share is None else f"{share:.0%}"


def _print_micro(report: dict) -> None:
    gather = [
        row | {"mb": f"{row['bytes'] / 1e6:.2f}", "share": _percent(row["share_of_bulk"])} for row in report["gather"]
    ]
    columns = {"context": "context", "kv bits": "kv_bits", "fraction": "fraction", "MB": "mb", "ms": "ms"}
    columns |= {"GB/s": "gb_s"}
    print_rows("selective gather, one layer", columns | {"of bulk copy": "share"}, gather)
    speculation = [row | {"share": f"{row['speculation_share']:.0%}"} for row in report["speculation"]]
    columns = {"context": "context", "speculation ms": "speculation_ms", "dense layer ms": "dense_layer_ms"}
    print_rows("speculation vs a layer's compute", columns | {"share": "share"}, speculation)


BENCH_COLUMNS = {
    "policy": "policy",
    "budget": "budget",
    "graphs": "graphs",
    "batch": "batch",
    "context": "prompt_len",
    "ms/step": "ms_per_step",
    "tok/s": "decode_tok_s",
    "reuse": "reuse_shown",
    "fetched": "fraction_fetched",
    "attended": "fraction_attended",
    "H2D MB/step": "h2d_mb_per_step",
    "H2D GB/s": "h2d_gb_s",
    "% of pinned BW": "share_of_pinned",
    "wait ms/step": "wait_ms_per_step",
    "step / bound": "step_over_bound",  # where bytes cross the link every step (streamed weights, rows)
    "prefill s": "prefill_s",
    "peak GPU GB": "decode_peak_gpu_gb",
    "error": "error",  # a case that did not fit
}
NOT_SETTINGS = {"policy", "budget", "graphs", "batch", "prompt_len"}  # fixed columns, not sweep columns


def _swept(rows: list[dict]) -> dict[str, str]:
    """A column for each setting the rows differ in (beyond the fixed ones), and alpha where given."""
    from infinigen.cli.options import cli_fields

    names = ["ratio", *(f.name for f in cli_fields())]
    swept = {n: n for n in names if n not in NOT_SETTINGS and len({row.get(n) for row in rows} - {None}) > 1}
    return swept | {"alpha": "alpha"}  # where given (None, the budget alone, leaves the column out)


def _print_bench(report: dict) -> None:
    bandwidth = report["pinned_h2d_gb_s"]
    measured = bandwidth is not None  # None on CPU
    rows = [
        row | ({"share_of_pinned": f"{row['h2d_gb_s'] / bandwidth:.0%}"} if measured and "h2d_gb_s" in row else {})
        for row in report["results"]
    ]
    for row in rows:  # on / off in the table; why, in the JSON report
        row["reuse_shown"] = row["reuse"].split()[0] if row.get("reuse") else None
    title = f"{report.get('model') or report['shape']} {report['dtype']} on {report['device']}"
    if report.get("ranks"):
        title += f", rank 0 of {report['ranks']}"
    swept = _swept(rows)
    columns = dict(list(BENCH_COLUMNS.items())[:2]) | swept | BENCH_COLUMNS  # what the sweeps vary, after the budget
    rates = [f"pinned H2D {bandwidth:.1f} GB/s"] if measured else []
    if "matmul_tflop_s" in report:  # the bounds' rates
        rates += [f"matmul {report['matmul_tflop_s']} TFLOP/s", f"memory {report['device_gb_s']} GB/s"]
    print_rows(title + (f" ({', '.join(rates)})" if rates else ""), columns, rows)
    for plan in report.get("throughput_plan", []):  # the batch an autoxN size ran
        print_pairs(f"throughput plan at {plan['context']} tokens", {k: v for k, v in plan.items() if k != "rates"})
    if report["breakdown"]:
        columns = {"policy": "policy", "budget": "budget"} | swept | {"batch": "batch", "context": "prompt_len"}
        columns |= {"step ms": "step_ms", "compute-only ms": "compute_only_ms"}
        columns |= {"transfer-only ms": "transfer_only_ms", "step / max": "step_over_max"}
        columns |= {"no-selection ms": "without_selection_ms", "selection share": "selection_share"}
        columns |= {"selection ms/layer": "selection_ms_per_layer", "error": "error"}
        print_rows("where the step goes", columns, report["breakdown"])
