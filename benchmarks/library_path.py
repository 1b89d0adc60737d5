"""The Python path under the memory plan (issue: every caller under the plan), in one process under one GPU
budget: for each size, ``model.generate`` with a fresh ``infinigen.cache_for(model)`` two ways,

- ``decode``: ``custom_generate=infinigen.decode`` (the plan's prefill chunk; decode steps as CUDA graphs);
- ``plain``: transformers' own loop, the prompt in one forward; ``plain:N`` with ``prefill_chunk_size=N``,
  ``plain:N:expect`` with the run's length said first (``cache.expect``);

each row: ran, refused (the one line) or out of memory, the first token and the median ms a token after it
(each path warmed up first at 1 x 4096), the measured peak against the plan's. A budget (``--gpu-memory-gb``)
is held for the whole process as ``bench --gpu-memory-gb`` holds it. Prints a table; ``--out`` writes JSON.

    python benchmarks/library_path.py --shape llama-3-8b --gpu-memory-gb 24 \\
        --sizes 1x131072,4x32768,8x16384 --paths decode,plain,plain:4096:expect --new-tokens 32 --out library.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import infinigen
from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument


class Timer:
    """A streamer: the time of the first new token and of the last."""

    def __init__(self) -> None:
        self.start, self.times = time.perf_counter(), []

    def put(self, value) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(model, artifact, batch: int, context: int, new_tokens: int, path: str) -> dict:
    row = {"path": path, "batch": batch, "context": context}
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    timer = Timer()
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    if path == "decode":
        kwargs |= {"custom_generate": infinigen.decode, "decode_streamer": timer}
    else:
        chunk = (path.split(":") + [""])[1]
        kwargs |= {"streamer": timer} | ({"prefill_chunk_size": int(chunk)} if chunk else {})
    failure, retries = None, torch.cuda.memory_stats().get("num_alloc_retries", 0)
    try:
        with infinigen.cache_for(model, artifact) as cache, torch.no_grad():
            if path.endswith(":expect"):
                cache.expect(context + new_tokens)
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **{cache_argument(model): cache})
            said = cache.summary()["memory_plan"]
    except InfinigenError as exc:
        return row | {"result": "refused", "line": str(exc)}
    except torch.OutOfMemoryError as exc:
        failure = str(exc).splitlines()[0][:200]
    if failure is not None:
        return row | {"result": "out of memory", "line": failure}
    first = timer.times[1] - timer.start  # times[0]: the prompt
    steps = zip(timer.times[1:], timer.times[2:], strict=False)
    gaps = sorted(b - a for a, b in steps)  # a decode step each (the first ones capture their graphs)
    return row | {
        "result": "ran",
        "first_token_s": round(first, 2),
        "ms_per_token": round(gaps[len(gaps) // 2] * 1e3, 2) if gaps else None,  # the median step
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
        "planned_peak_gpu_gb": said["planned_peak_gpu_gb"],
        "prefill_chunk": said.get("prefill_chunk"),
        "given_up": said["given_up"],
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--sizes", default="1x131072,4x32768,8x16384")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--paths", default="decode,plain,plain:4096:expect")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")  # before this process touches the device
    model = random_model(args.shape, "cuda", torch.bfloat16)
    artifact = random_artifact(model, args.shape, 0.5)
    for path in args.paths.split(","):  # warm-up: Triton's compilation and the first captures, once a process
        run(model, artifact, 1, 4096, 8, path)
    rows = []
    for size in args.sizes.split(","):
        batch, context = map(int, size.split("x"))
        for path in args.paths.split(","):
            rows.append(run(model, artifact, batch, context, args.new_tokens, path))
            print(json.dumps(rows[-1]), flush=True)
    occupier.release()
    print(f"\n{args.shape}, {args.gpu_memory_gb:g} GB held for this process, {torch.cuda.get_device_name()}")
    head = f"{'size':>10} {'path':>10} {'result':>14} {'first s':>8} {'ms/tok':>7} {'peak':>7} {'plan':>7}"
    print(head + " retries chunk")
    for r in rows:
        size = f"{r['batch']}x{r['context']}"
        if r["result"] != "ran":
            print(f"{size:>10} {r['path']:>10} {r['result']:>14}  {r['line'][:150]}")
            continue
        print(
            f"{size:>10} {r['path']:>10} {r['result']:>14} {r['first_token_s']:>8} {r['ms_per_token']!s:>7} "
            f"{r['peak_gpu_gb']:>7} {r['planned_peak_gpu_gb']:>7} {r['alloc_retries']:>7} {r['prefill_chunk']}"
        )
    if args.out:
        meta = {"shape": args.shape, "gpu_memory_gb": args.gpu_memory_gb, "device": torch.cuda.get_device_name()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
