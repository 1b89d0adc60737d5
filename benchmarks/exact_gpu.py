"""Exact decoding's cycle on a GPU (issue: exact answers): ``--draft-tokens`` draft steps of the policy and one
verifying forward over every cached row, against ``full`` (every row every step) in the same process.

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``), random prompts,
16-bit rows for every path (exact decoding's). Random weights make acceptance meaningless (their logits are
near-tied): the cycle's time is measured here, the acceptance on real text (``benchmarks/exact_acceptance.py``),
and tokens/s = batch x (acceptance x drafts + 1) / cycle time at the ``--acceptance`` given for that batch (a batch
advances by the smallest run any row accepted: its acceptance is measured at its batch). Each path warmed up once at
its size; prints a table, ``--out`` writes JSON.

    python benchmarks/exact_gpu.py --gpu-memory-gb 24 --sizes 8x16384 1x131072 --acceptance 8=0.882 8@8=0.6
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from serve_gpu import Timer

import infinigen
from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.runtime import cache_argument


def timed(model, artifact, ids: torch.Tensor, new_tokens: int, **settings) -> dict:
    timer = Timer()
    with infinigen.cache_for(model, artifact, kv_bits=16, **settings) as cache, torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            custom_generate=infinigen.decode,
            decode_streamer=timer,
            **{cache_argument(model): cache},
        )
        counts = cache.verified.summary() if cache.verified is not None else {}
        ran = cache.config  # the plan's choices applied
        counts["ran"] = {k: getattr(ran, k) for k in ("resident_extra", "prefill_fetch_ahead", "prefill_block_tokens")}
    times = timer.times[1:]  # the new tokens (the prompt came first), from the prefill's
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"decode_s": times[-1] - times[0], "median_gap_ms": statistics.median(gaps) * 1e3, **counts}


class Profiled:
    """A streamer that runs torch.profiler over the new tokens only (the prompt's put comes first): where a cycle
    goes, as operator tables and a Chrome trace (``trace``)."""

    def __init__(self, trace: str | None) -> None:
        self.puts, self.trace = 0, trace
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.profiler = torch.profiler.profile(activities=activities)

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.profiler.start()

    def end(self) -> None:
        torch.cuda.synchronize()
        self.profiler.stop()
        table = self.profiler.key_averages().table
        print(table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50), flush=True)
        print(table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50), flush=True)
        if self.trace:
            self.profiler.export_chrome_trace(self.trace)


def profiled(model, artifact, ids: torch.Tensor, trace: str | None, **settings) -> None:
    with infinigen.cache_for(model, artifact, kv_bits=16, **settings) as cache, torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=17,
            min_new_tokens=17,
            do_sample=False,
            pad_token_id=0,
            custom_generate=infinigen.decode,
            decode_streamer=Profiled(trace),
            **{cache_argument(model): cache},
        )
        print(json.dumps(cache.verified.summary()), flush=True)


def settings_of(variant: str) -> dict:
    """KEY=VALUE[,KEY=VALUE] as runtime settings: JSON values (numbers, true), the rest as text."""
    settings = {}
    for pair in filter(None, variant.split(",")):
        key, value = pair.split("=")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--sizes", nargs="+", default=["1x32768", "8x16384"])
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument(
        "--acceptance",
        nargs="+",
        default=["4=0.907"],
        help="DRAFTS=ACCEPTANCE (batch 1) or DRAFTS@BATCH=ACCEPTANCE, each measured on real text at that batch "
        "(benchmarks/exact_acceptance.py --batch): one exact run per draft count",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="KEY=VALUE[,KEY=VALUE] runtime settings: each an exact run per draft count beside the plan's own",
    )
    parser.add_argument("--profile", action="store_true", help="the first size's exact runs under torch.profiler")
    parser.add_argument("--trace", default=None, help="with --profile: write the Chrome trace here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model(args.shape, "cuda", torch.bfloat16)
    artifact = random_artifact(model, args.shape, 0.5)
    acceptance = {}  # (drafts, batch) -> acceptance
    for pair in args.acceptance:
        key, value = pair.split("=")
        drafts, _, at = key.partition("@")
        acceptance[int(drafts), int(at or 1)] = float(value)
    counts = sorted({n for n, _ in acceptance})
    paths = {"full": {"policy": "full"}}
    for variant in ["", *args.variants]:
        for n in counts:
            paths[f"exact {n} {variant}".strip()] = {"exact": True, "draft_tokens": n, **settings_of(variant)}
    rows = []
    for i, size in enumerate(args.sizes):
        batch, context = map(int, size.split("x"))
        ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
        ids = ids.cuda()
        for name, settings in paths.items():
            if name in ("full", f"exact {counts[0]}"):  # warm-up at the size: Triton's compilation, captures
                timed(model, artifact, ids, 8, **settings)
            if args.profile and i == 0 and name != "full":
                profiled(model, artifact, ids, args.trace, **settings)
            run = timed(model, artifact, ids, args.new_tokens, **settings)
            row = {"size": size, "path": name} | run
            if name == "full":
                row["tokens_per_s"] = batch * 1e3 / run["median_gap_ms"]
            else:
                drafts = settings["draft_tokens"]
                row["variant"] = {k: v for k, v in settings.items() if k not in ("exact", "draft_tokens")}
                cycle = run["decode_s"] / run["verifications"]
                used = acceptance.get((drafts, batch))  # None: not measured at this batch
                row |= {"cycle_ms": cycle * 1e3, "acceptance_used": used}
                row["tokens_per_s"] = None if used is None else batch * (used * drafts + 1) / cycle
            rows.append(row)
            print(json.dumps(row), flush=True)
    occupier.release()
    print(f"\n{args.shape}, {args.gpu_memory_gb:g} GB held, {torch.cuda.get_device_name()}, 16-bit rows")
    for size in args.sizes:
        full = next(r for r in rows if r["size"] == size and r["path"] == "full")
        print(f"{size}: full {full['median_gap_ms']:.2f} ms a step ({full['tokens_per_s']:.1f} tok/s)")
        for exact in (r for r in rows if r["size"] == size and r["path"] != "full"):
            rate = exact["tokens_per_s"]
            at = "no acceptance given at this batch"
            if rate is not None:
                times = rate / full["tokens_per_s"]
                at = f"at acceptance {exact['acceptance_used']} {rate:.1f} tok/s ({times:.2f}x full)"
            print(
                f"  {exact['path']}: a cycle {exact['cycle_ms']:.2f} ms (drafts {exact['draft_ms']:.2f}, verification "
                f"{exact['verify_ms']:.2f}), {at}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args) | {"device": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
