"""Prefill once, ask many (issue: kept prompts), in one process under one GPU budget: questions of
``--question`` tokens about one document of ``--context`` tokens (random token ids, random weights of
``--shape``), each answered with ``--new-tokens`` greedy tokens by ``model.generate(custom_generate=
infinigen.decode)`` on a fresh ``infinigen.cache_for(model)``:

- ``cold``: no kept prompts (the first ``--cold`` questions), in the prefill chunks a run with kept prompts
  takes (``config.KEPT_CHUNK``: the same settings);
- ``keep``: the first question with a ``PromptCache`` (the cold run that keeps its prompt);
- ``cut``: the first ``--cold`` questions from the document alone, kept whole: a cold run whose prefill stops at the
  document's end (the chunk boundaries of a warm run, which cuts the kept question off there);
- ``warm``: every question again from the kept prompt (host memory);
- ``file``: the kept prompt saved (``save_prompt``), evicted from the page cache (``posix_fadvise``), its raw
  read bandwidth measured, then loaded (``load_prompt``) into a new ``PromptCache`` and a question answered.

Each row: the first token (s), the whole answer (s), the tokens served from the kept prompt, whether the
tokens equal the cold run's and the cut one's. Warm-up first (Triton's compilation, the first captures, at 4,096
tokens and at the full size: a process's first decode steps at a new size cost seconds, which a cold row must not
carry). ``questions_bound``: the questions' speedup were every warm prefill free (their decoding alone). Prints a
table; ``--out`` writes JSON.

    python benchmarks/prompt_cache_gpu.py --gpu-memory-gb 24 --context 131008 --question 64 --out prompts.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from library_path import Timer  # this folder's: the first and each later token's time

import infinigen
from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.runtime import cache_argument
from infinigen.runtime.cache.prompt_file import load_prompt, save_prompt
from infinigen.runtime.cache.prompts import PromptCache
from infinigen.runtime.config import KEPT_CHUNK


def answer(model, artifact, ids, new_tokens: int, prompts: PromptCache | None) -> dict:
    timer = Timer()
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0, "prefill_chunk_size": KEPT_CHUNK}
    torch.cuda.reset_peak_memory_stats()
    with infinigen.cache_for(model, artifact, prompts=prompts) as cache, torch.no_grad():
        kwargs[cache_argument(model)] = cache
        out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=infinigen.decode,
                             decode_streamer=timer, **kwargs)  # fmt: skip
        summary = cache.summary()
    end = time.perf_counter()
    return {
        "first_token_s": round(timer.times[1] - timer.start, 3),
        "answer_s": round(end - timer.start, 3),
        "cached_tokens": summary["cached_tokens"],
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
        "planned_peak_gpu_gb": summary["memory_plan"]["planned_peak_gpu_gb"],
        "tokens": out[0, ids.shape[1] :].tolist(),
    }


def read_bandwidth(path: str) -> float:
    """GB/s of one plain read of ``path`` from the disk (its pages dropped from the page cache first)."""
    evict(path)
    buffer = bytearray(64 << 20)
    start, total = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as file:
        while n := file.readinto(buffer):
            total += n
    seconds = time.perf_counter() - start
    evict(path)
    return total / seconds / 1e9


def evict(path: str) -> None:
    with open(path, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--context", type=int, default=131008)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--cold", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--file", default="/tmp/infinigen-document.prompt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")  # before this process touches the device
    model = random_model(args.shape, "cuda", torch.bfloat16)
    artifact = random_artifact(model, args.shape, 0.5)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    document = torch.randint(0, vocab, (1, args.context), generator=generator)
    questions = [torch.randint(0, vocab, (1, args.question), generator=generator) for _ in range(args.questions)]
    asked = [torch.cat([document, q], dim=1).cuda() for q in questions]
    warm_up = PromptCache()  # Triton's compilation and the first captures, cold and warm, at 4096
    for q in questions[:2]:
        answer(model, artifact, torch.cat([document[:, :4096], q], 1).cuda(), 8, warm_up)
    del warm_up
    answer(model, artifact, asked[-1], 8, None)  # and at the full size, cold
    rows = []

    def row(kind: str, i: int, result: dict) -> None:
        for reference in ("cold", "cut"):
            same = next((r for r in rows if r["kind"] == reference and r["question"] == i), None)
            result[f"equal_to_{reference}"] = None if same is None else result["tokens"] == same["tokens"]
        rows.append({"kind": kind, "question": i} | result)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)

    for i in range(args.cold):
        row("cold", i, answer(model, artifact, asked[i], args.new_tokens, None))
    prompts = PromptCache()
    row("keep", 0, answer(model, artifact, asked[0], args.new_tokens, prompts))
    alone = PromptCache()
    answer(model, artifact, document.cuda(), 1, alone)
    for i in range(args.cold):
        whole = PromptCache()  # the document alone: the kept question must not serve it
        whole.add(alone.newest)
        row("cut", i, answer(model, artifact, asked[i], args.new_tokens, whole))
    del alone, whole
    for i in range(args.questions):
        row("warm", i, answer(model, artifact, asked[i], args.new_tokens, prompts))
    kept = prompts.newest
    start = time.perf_counter()
    file_bytes = save_prompt(kept, args.file)
    save_s = time.perf_counter() - start
    kept_bytes = kept.nbytes
    prompts.clear()
    del kept
    bandwidth = read_bandwidth(args.file)
    start = time.perf_counter()
    loaded = PromptCache()
    loaded.add(load_prompt(args.file, "cuda"))
    load_s = time.perf_counter() - start
    result = answer(model, artifact, asked[1 % args.questions], args.new_tokens, loaded)
    result |= {"load_s": round(load_s, 3), "first_token_s": round(result["first_token_s"] + load_s, 3)}
    row("file", 1 % args.questions, result)
    os.unlink(args.file)
    occupier.release()

    cold = [r for r in rows if r["kind"] == "cold"]
    warm = [r for r in rows if r["kind"] == "warm"]
    cold_answer = sum(r["answer_s"] for r in cold) / max(len(cold), 1)
    keep_row = next(r for r in rows if r["kind"] == "keep")
    ten_cold = cold_answer * args.questions
    ten_warm = keep_row["answer_s"] + sum(r["answer_s"] for r in warm[1:])
    decoding = keep_row["answer_s"] + sum(r["answer_s"] - r["first_token_s"] for r in warm[1:])
    file_row = rows[-1]
    meta = {
        "shape": args.shape,
        "gpu_memory_gb": args.gpu_memory_gb,
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "question": args.question,
        "new_tokens": args.new_tokens,
        "file_bytes": file_bytes,
        "kept_bytes": kept_bytes,
        "file_over_kept": round(file_bytes / kept_bytes, 4),
        "save_s": round(save_s, 2),
        "disk_read_gb_s": round(bandwidth, 2),
        "file_bound_s": round(1.3 * file_bytes / bandwidth / 1e9 + warm[1 % len(warm)]["first_token_s"], 3),
        "questions_cold_s": round(ten_cold, 2),
        "questions_warm_s": round(ten_warm, 2),
        "questions_speedup": round(ten_cold / ten_warm, 2),
        "questions_bound": round(ten_cold / decoding, 2),
    }
    print(f"\n{args.shape}, {args.gpu_memory_gb:g} GB held, {meta['device']}; {args.context} + {args.question} tokens")
    print(f"{'kind':>5} {'q':>3} {'first s':>8} {'answer s':>9} {'cached':>7} {'peak':>7} {'plan':>7} cold cut")
    for r in rows:
        print(
            f"{r['kind']:>5} {r['question']:>3} {r['first_token_s']:>8} {r['answer_s']:>9} {r['cached_tokens']:>7} "
            f"{r['peak_gpu_gb']:>7} {r['planned_peak_gpu_gb']:>7} {r['equal_to_cold']} {r['equal_to_cut']}"
        )
    print(json.dumps(meta, indent=1))
    print(f"file row: first token {file_row['first_token_s']} s (load {file_row['load_s']} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
