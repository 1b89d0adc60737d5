"""Exact decoding's cycle on a GPU (issue: exact answers): ``--draft-tokens`` draft steps of the policy and one
verifying forward over every cached row, against ``full`` (every row every step) in the same process.

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``), random prompts,
16-bit rows for every path (exact decoding's). Random weights make acceptance meaningless (their logits are
near-tied): the cycle's time is measured here, the acceptance on real text (``benchmarks/exact_acceptance.py``),
and tokens/s = (acceptance x drafts + 1) / cycle time at the ``--acceptance`` given. Each path warmed up once at
its size; prints a table, ``--out`` writes JSON.

    python benchmarks/exact_gpu.py --gpu-memory-gb 24 --sizes 1x32768 8x16384 1x131072 --acceptance 4=0.907 8=0.882
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
        help="DRAFT_TOKENS=ACCEPTANCE, each measured on real text (benchmarks/exact_acceptance.py): one exact run each",
    )
    parser.add_argument("--profile", action="store_true", help="the first size's exact runs under torch.profiler")
    parser.add_argument("--trace", default=None, help="with --profile: write the Chrome trace here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model(args.shape, "cuda", torch.bfloat16)
    artifact = random_artifact(model, args.shape, 0.5)
    acceptance = {int(n): float(a) for n, a in (pair.split("=") for pair in args.acceptance)}
    paths = {"full": {"policy": "full"}} | {f"exact {n}": {"exact": True, "draft_tokens": n} for n in acceptance}
    rows = []
    for i, size in enumerate(args.sizes):
        batch, context = map(int, size.split("x"))
        ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
        ids = ids.cuda()
        for name, settings in paths.items():
            timed(model, artifact, ids, 8, **settings)  # warm-up: Triton's compilation, the captures
            if args.profile and i == 0 and name != "full":
                profiled(model, artifact, ids, args.trace, **settings)
            run = timed(model, artifact, ids, args.new_tokens, **settings)
            row = {"size": size, "path": name} | run
            if name == "full":
                row["tokens_per_s"] = batch * 1e3 / run["median_gap_ms"]
            else:
                drafts = settings["draft_tokens"]
                cycle = run["decode_s"] / run["verifications"]
                row |= {"cycle_ms": cycle * 1e3, "acceptance_used": acceptance[drafts]}
                row["tokens_per_s"] = batch * (acceptance[drafts] * drafts + 1) / cycle
            rows.append(row)
            print(json.dumps(row), flush=True)
    occupier.release()
    print(f"\n{args.shape}, {args.gpu_memory_gb:g} GB held, {torch.cuda.get_device_name()}, 16-bit rows")
    for size in args.sizes:
        full = next(r for r in rows if r["size"] == size and r["path"] == "full")
        print(f"{size}: full {full['median_gap_ms']:.2f} ms a step ({full['tokens_per_s']:.1f} tok/s)")
        for exact in (r for r in rows if r["size"] == size and r["path"] != "full"):
            print(
                f"  {exact['path']}: a cycle {exact['cycle_ms']:.2f} ms (drafts {exact['draft_ms']:.2f}, verification "
                f"{exact['verify_ms']:.2f}), at acceptance {exact['acceptance_used']} "
                f"{exact['tokens_per_s']:.1f} tok/s "
                f"({exact['tokens_per_s'] / full['tokens_per_s']:.2f}x full)"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args) | {"device": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
