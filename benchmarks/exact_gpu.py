"""Exact decoding's cycle on a GPU (issue: exact answers): ``--draft-tokens`` draft steps of the policy and one
verifying forward over every cached row, against ``full`` (every row every step) in the same process.

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``), random prompts,
16-bit rows for every path (exact decoding's). Random weights make acceptance meaningless (their logits are
near-tied): the cycle's time is measured here, the acceptance on real text (``benchmarks/exact_acceptance.py``),
and tokens/s = (acceptance x drafts + 1) / cycle time at the ``--acceptance`` given. Each path warmed up once at
its size; prints a table, ``--out`` writes JSON.

    python benchmarks/exact_gpu.py --gpu-memory-gb 24 --sizes 1x32768 8x16384 --acceptance 0.907
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--sizes", nargs="+", default=["1x32768", "8x16384"])
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--acceptance", type=float, default=0.907, help="measured on real text")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model(args.shape, "cuda", torch.bfloat16)
    artifact = random_artifact(model, args.shape, 0.5)
    paths = {"full": {"policy": "full"}, "exact": {"exact": True, "draft_tokens": args.draft_tokens}}
    rows = []
    for size in args.sizes:
        batch, context = map(int, size.split("x"))
        ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
        ids = ids.cuda()
        for name, settings in paths.items():
            timed(model, artifact, ids, 8, **settings)  # warm-up: Triton's compilation, the captures
            run = timed(model, artifact, ids, args.new_tokens, **settings)
            row = {"size": size, "path": name} | run
            if name == "full":
                row["tokens_per_s"] = batch * 1e3 / run["median_gap_ms"]
            else:
                cycle = run["decode_s"] / run["verifications"]
                row |= {"cycle_ms": cycle * 1e3, "draft_tokens": args.draft_tokens, "acceptance_used": args.acceptance}
                row["tokens_per_s"] = batch * (args.acceptance * args.draft_tokens + 1) / cycle
            rows.append(row)
            print(json.dumps(row), flush=True)
    occupier.release()
    print(f"\n{args.shape}, {args.gpu_memory_gb:g} GB held, {torch.cuda.get_device_name()}, 16-bit rows")
    for size in args.sizes:
        full, exact = (next(r for r in rows if r["size"] == size and r["path"] == p) for p in paths)
        print(
            f"{size}: full {full['median_gap_ms']:.2f} ms a step ({full['tokens_per_s']:.1f} tok/s); exact: a cycle of "
            f"{args.draft_tokens} drafts + 1 verification {exact['cycle_ms']:.2f} ms, at acceptance {args.acceptance} "
            f"{exact['tokens_per_s']:.1f} tok/s ({exact['tokens_per_s'] / full['tokens_per_s']:.2f}x full)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args) | {"device": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
