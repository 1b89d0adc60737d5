"""Where one server request's time goes (issue: the server): the gaps between the tokens of a fresh cache (its
first steps eager, then its step captured, then replays), and the phases before a kept prompt's next question
gets its first token (the plan, ``restore``, the prefill of what is new, ``keep``), each timed with the device
synchronised. A random-weight Llama-3-8B shape, all but ``--gpu-memory-gb`` held, one row of ``--context`` random
tokens; prints each run. ``--profile``: the kernels and host operations of the last warm question's prefill
(``torch.profiler``), the most costly first.

    python benchmarks/request_phases_gpu.py --context 131008 --profile
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from serve_gpu import Timer

import infinigen
from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.runtime import cache_argument, generation
from infinigen.runtime.cache.prompts import PromptCache

phases: dict[str, list[float]] = {}


def timed(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        phases.setdefault(name, []).append(round((time.perf_counter() - start) * 1e3, 1))
        return out

    return run


def run(model, artifact, ids: torch.Tensor, new: int, prompts: PromptCache | None = None) -> tuple[int, list[float]]:
    """First token (ms) and the gaps between the next ones (ms) of one ``generate`` with a fresh cache."""
    timer, start = Timer(), time.perf_counter()
    chunk = {"prefill_chunk_size": 4096} if prompts is not None else {}
    with infinigen.cache_for(model, artifact, prompts=prompts) as cache, torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            custom_generate=infinigen.decode,
            decode_streamer=timer,
            **{cache_argument(model): cache},
            **chunk,
        )
    times = timer.times[1:]  # times[0]: the prompt
    return round((times[0] - start) * 1e3), [round((b - a) * 1e3, 1) for a, b in zip(times, times[1:], strict=False)]


def profiled(*args):
    """``run(*args)`` under ``torch.profiler``: its result, and the top rows by device time and by host time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        out = run(*args)
    events = profile.key_averages()
    tables = [events.table(sort_by=key, row_limit=25) for key in ("self_cuda_time_total", "self_cpu_time_total")]
    return out, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model("llama-3-8b", "cuda", torch.bfloat16)
    artifact = random_artifact(model, "llama-3-8b", 0.5)
    for name in ("restore", "keep", "prefill", "plan_run"):
        setattr(generation, name, timed(name, getattr(generation, name)))
    generator = torch.Generator().manual_seed(0)
    doc = torch.randint(1, 128000, (1, args.context), generator=generator).cuda()
    print("warm", run(model, artifact, doc[:, :4096], 8)[0], run(model, artifact, doc, 8)[0])
    phases.clear()
    for _ in range(2):
        first, gaps = run(model, artifact, doc, 32)
        mean, median = sum(gaps) / len(gaps), sorted(gaps)[len(gaps) // 2]
        print(f"fresh: first {first} ms, gaps {gaps}, mean {mean:.2f}, median {median}", phases)
        phases.clear()
    kept = PromptCache(30)
    prompt = torch.cat([doc, torch.randint(1, 128000, (1, 95), generator=generator).cuda()], 1)
    print("kept cold", run(model, artifact, prompt, 32, kept)[0], phases)
    phases.clear()
    for extra in (95, 190, 64):
        prompt = torch.cat([prompt, torch.randint(1, 128000, (1, extra), generator=generator).cuda()], 1)
        tables: list[str] = []
        if args.profile and extra == 64:  # the prefill and the first steps only
            (first, gaps), tables = profiled(model, artifact, prompt, 2, kept)
        else:
            first, gaps = run(model, artifact, prompt, 32, kept)
        mean = sum(gaps) / max(len(gaps), 1)
        print(f"warm +{extra}: first {first} ms, mean gap {mean:.2f}, gaps {gaps[:4]} .. {gaps[-4:]}", phases)
        print(*tables, sep="\n")
        phases.clear()
    occupier.release()


if __name__ == "__main__":
    main()
