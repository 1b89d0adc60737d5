"""A batch job's throughput (issue: long-context batch jobs), three ways in one process under one GPU budget:

- ``plan``: ``generate --input`` as it runs, batches as large as the memory plan admits (up to --max-batch);
- ``batches of 8``: the same job at ``--max-batch 8``: one batch of 8 at a time, as ``--batch-file`` runs take;
- ``transformers``: ``generate()`` with ``DynamicCache(offloading=True)``, the same requests longest first, each
  batch as large as transformers' memory estimate admits (``bench.hf_memory``) up to --max-batch.

Prompts are cut from the given texts (--min-tokens to --max-tokens tokens each). A budget (--gpu-memory-gb)
is held for the whole process as ``bench --gpu-memory-gb`` holds it. Prints a table; --out writes JSON.

    python benchmarks/batch_gpu.py --artifact ART --text 10146.txt 10321.txt 10356.txt --prompts 2000 \\
        --min-tokens 1024 --max-tokens 8192 --new-tokens 64 --gpu-memory-gb 24 --out batch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from infinigen.artifacts import open_artifact
from infinigen.batch import Job, Work, read_requests, run_job
from infinigen.batch.runner import Planner, end_tokens, form_batches, prepare
from infinigen.bench.hf_memory import hf_plan
from infinigen.bench.occupy import Occupier
from infinigen.eval.decoding import read_text
from infinigen.models import load_model
from infinigen.runtime import cache_argument
from infinigen.runtime.text import left_padded, pad_token_id


def cut_prompts(tokenizer, texts: list[str], count: int, shortest: int, longest: int, seed: int) -> list[dict]:
    """``count`` requests, each a random span of ``shortest`` to ``longest`` tokens of the joined texts."""
    ids = tokenizer("\n\n".join(texts))["input_ids"]
    if len(ids) <= longest:
        raise SystemExit(f"the texts hold {len(ids)} tokens, not more than --max-tokens {longest}")
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        length = rng.randint(shortest, longest)
        start = rng.randrange(len(ids) - length)
        requests.append({"id": i, "prompt": tokenizer.decode(ids[start : start + length])})
    return requests


class TransformersPlanner(Planner):
    """Batches as large as transformers' offloaded cache fits by its memory estimate."""

    def plan(self, work):
        return hf_plan(self.model, self.dtype, work, "hf-offloaded", self.budget)


def transformers_generate(job: Job, work: Work, max_batch: int, every: int) -> dict:
    """The requests through transformers' offloaded cache, batches by its memory estimate; with ``every`` > 1,
    every ``every``-th of those batches (from the first, longest to shortest): a sample across all lengths whose
    tokens/s estimates the whole job's where running it all would take too long."""
    fields = {f.name: getattr(job.planner, f.name) for f in dataclasses.fields(Planner)}
    planner = TransformersPlanner(**fields | {"max_batch": max_batch})
    prepared, _ = prepare(planner, work.requests)
    batches, unfit = form_batches(planner, prepared)
    formed, batches = len(batches), batches[::every]
    model, pad = job.model, pad_token_id(planner.tokenizer)
    ends = end_tokens(model, planner.tokenizer)
    offloading = model.device.type == "cuda"  # transformers offloads to a CUDA device only
    split = 0

    def generated(batch) -> int:
        """The batch's new tokens, counted as the job counts a row: up to its first end token. A batch that
        runs out of memory (its estimate's miss) runs again in halves, as the job's batches do."""
        nonlocal split
        if offloading:
            torch.cuda.empty_cache()  # each batch from none cached, as the job's batches start
        inputs = left_padded([p.ids for p in batch], pad, model.device)
        chunk = {"prefill_chunk_size": planner.prefill_chunk} if planner.prefill_chunk else {}
        try:
            with torch.no_grad():
                out = model.generate(
                    **inputs,
                    max_new_tokens=max(p.new_tokens for p in batch),
                    do_sample=False,
                    pad_token_id=pad,
                    **{cache_argument(model): DynamicCache(config=model.config, offloading=offloading)},
                    **chunk,
                )
        except torch.OutOfMemoryError:
            if len(batch) == 1:
                raise
            split += 1
            return generated(batch[: len(batch) // 2]) + generated(batch[len(batch) // 2 :])
        tokens = 0
        for p, row in zip(batch, out[:, inputs["input_ids"].shape[1] :].tolist(), strict=True):
            row = row[: p.new_tokens]
            tokens += next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        return tokens

    start = time.perf_counter()
    tokens = sum(generated(batch) for batch in batches)
    seconds = time.perf_counter() - start
    cache = "DynamicCache(offloading=True)" if offloading else "DynamicCache (the CPU: no offloading)"
    counts = {"batches": len(batches), "batches_formed": formed, "split_after_out_of_memory": split}
    counts |= {"unfit": len(unfit), "generated_tokens": tokens}
    return {"cache": cache, **counts, "seconds": round(seconds, 3)}


def phases(output: Path) -> dict:
    """A job's prefill and decode seconds, summed over its batches (each row carries its batch's), its
    batches' largest measured GPU peak, and its error rows' messages."""
    batches, errors = {}, {}
    for line in output.read_text().splitlines():
        row = json.loads(line)
        stats = row.get("stats", {})
        if "batch_index" in stats:  # an error row has none (a split batch's: only its split_from)
            batches[stats["batch_index"], stats.get("split_from"), stats["batch_prefill_s"]] = stats  # halves apart
        if "error" in row:
            errors[row["error"]] = errors.get(row["error"], 0) + 1
    peaks = [s["batch_peak_gpu_gb"] for s in batches.values() if s["batch_peak_gpu_gb"] is not None]
    over_plan = [s["batch_peak_gpu_gb"] / s["batch_planned_gpu_gb"] for s in batches.values() if s["batch_peak_gpu_gb"]]
    return {
        "prefill_seconds": round(sum(s["batch_prefill_s"] for s in batches.values()), 3),
        "decode_seconds": round(sum(s["batch_decode_s"] for s in batches.values()), 3),
        "largest_peak_gpu_gb": max(peaks, default=None),
        "largest_peak_over_plan": round(max(over_plan, default=0.0), 3),  # measured / planned, per batch
        "error_messages": errors,  # each distinct error and its rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="MODEL (default: the embedded SmolLM2-135M)")
    parser.add_argument("--artifact", default=None)
    parser.add_argument("--text", nargs="+", required=True)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--gpu-memory-gb", type=float, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--modes", default="plan,batches of 8,transformers")
    parser.add_argument("--transformers-every", type=int, default=1, help="run every N-th of its batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    occupier = None
    if args.gpu_memory_gb is not None and torch.cuda.is_available():
        occupier = Occupier(args.gpu_memory_gb, "cuda")  # before anything touches the device
    loaded = load_model(args.model, device=args.device)
    artifact = open_artifact(args.artifact, loaded.model) if args.artifact else None
    texts = [read_text(path) for path in args.text]
    records = cut_prompts(loaded.tokenizer, texts, args.prompts, args.min_tokens, args.max_tokens, args.seed)
    settings = {"policy": "infinigen" if artifact else "full", "gpu_memory_gb": args.gpu_memory_gb}
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "device": str(loaded.model.device), "modes": {}}
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "in.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
        requests, bad = read_requests(source)
        for mode in args.modes.split(","):
            max_batch = 8 if mode == "batches of 8" else args.max_batch
            options = {"max_new_tokens": args.new_tokens, "max_batch": max_batch}
            job = Job.of(loaded.model, loaded.tokenizer, artifact, settings, **options)
            work = Work(requests, bad, Path(folder) / f"{mode}.jsonl")
            if mode == "transformers":
                result = transformers_generate(job, work, args.max_batch, args.transformers_every)
            else:
                done = run_job(job, work).report()
                result = {key: done[key] for key in ("batches", "errors", "generated_tokens", "seconds")}
                result |= phases(work.output)
            result["tokens_per_s"] = round(result["generated_tokens"] / result["seconds"], 1)
            report["modes"][mode] = result
            print(f"{mode:>14}: {result}", flush=True)
    plan = report["modes"].get("plan")
    for mode, result in report["modes"].items():
        if plan and mode != "plan":
            print(f"plan / {mode}: {plan['tokens_per_s'] / result['tokens_per_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if occupier is not None:
        occupier.release()


if __name__ == "__main__":
    main()
