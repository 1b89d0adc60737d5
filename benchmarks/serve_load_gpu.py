"""Concurrent users through ``infinigen serve``: requests batched (``--max-batch 8``) against one at a time
(``--max-batch 1``), two engines over one model in the same process (issue: the server, scheduling).

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``), the word
tokenizer of ``serve_gpu.py``. For each size, ``users`` clients (the ``openai`` client, threads, 127.0.0.1)
send one streamed greedy request each at the same moment (``--repeat`` times, the engines alternating), each
its own document of about ``context`` random tokens (lengths differ by 61 tokens, so batches are padded).
Reported per engine: the wall time to the last answer, generated tokens/s over it, first-token and
inter-token latency p50 / p95; and for each user whether the batched engine's tokens equal the one-at-a-time
engine's (the tokens it gets alone), and where they first differ. Prompts are not kept (``prompt_cache_gb``
0): this measures batching alone.

    python benchmarks/serve_load_gpu.py --shape llama-3-8b --gpu-memory-gb 24 --sizes 8x16384 4x32768
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import openai
import torch
import uvicorn
from serve_gpu import prompt_of, word_tokenizer, write_rows

from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.serve.app import make_app
from infinigen.serve.engine import Engine


def serving(engine: Engine) -> tuple[uvicorn.Server, str]:
    server = uvicorn.Server(uvicorn.Config(make_app(engine), host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def request(url: str, prompt: str, new_tokens: int, start: float, out: dict) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
    times, pieces = [], []
    stream = client.completions.create(model="shape", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True)
    try:
        for piece in stream:
            if piece.choices and piece.choices[0].text:
                times.append(time.perf_counter())
                pieces.append(piece.choices[0].text)
    except openai.APIError as exc:
        out["error"] = str(exc)
        return
    out |= {"first_token_s": times[0] - start, "gaps": [b - a for a, b in zip(times, times[1:], strict=False)]}
    out |= {"tokens": "".join(pieces).split(), "done_s": times[-1] - start}


def load(url: str, documents: list[str], new_tokens: int) -> dict:
    """Every document's request at once; what each got and when."""
    start, results = time.perf_counter(), [{} for _ in documents]
    threads = [
        threading.Thread(target=request, args=(url, doc, new_tokens, start, out))
        for doc, out in zip(documents, results, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"wall_s": time.perf_counter() - start, "requests": results}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(run: dict) -> dict:
    answered = [r for r in run["requests"] if "error" not in r]
    errors = len(run["requests"]) - len(answered)
    if not answered:
        return {"errors": errors}
    firsts = [r["first_token_s"] for r in answered]
    gaps = [g for r in answered for g in r["gaps"]]
    tokens = sum(len(r["tokens"]) for r in answered)
    return {
        "errors": errors,
        "wall_s": round(run["wall_s"], 2),
        "tokens_per_s": round(tokens / run["wall_s"], 1),
        "first_token_p50_s": round(percentile(firsts, 0.5), 2),
        "first_token_p95_s": round(percentile(firsts, 0.95), 2),
        "inter_token_p50_ms": round(percentile(gaps, 0.5) * 1e3, 2),
        "inter_token_p95_ms": round(percentile(gaps, 0.95) * 1e3, 2),
    }


def first_difference(a: list[str], b: list[str]) -> int | None:
    """The first token position where ``a`` and ``b`` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--sizes", nargs="+", default=["8x16384", "4x32768"], help="USERSxCONTEXT")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each engine at each size, alternating")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model(args.shape, "cuda", torch.bfloat16)
    vocab = model.config.vocab_size
    tokenizer, artifact = word_tokenizer(vocab), random_artifact(model, args.shape, 0.5)
    settings = {"prompt_cache_gb": 0}
    engines = {
        "one at a time": Engine(model, tokenizer, artifact, settings, "shape", max_batch=1),
        "batched": Engine(model, tokenizer, artifact, settings, "shape", max_batch=8),
    }
    urls = {name: serving(engine) for name, engine in engines.items()}
    rows = []
    for size in args.sizes:
        users, context = map(int, size.split("x"))
        documents = [prompt_of(context - 61 * i, vocab) for i in range(users)]
        runs = {}
        for _, url in urls.values():
            load(url, [prompt_of(1024 - 61 * i, vocab) for i in range(users)], 4)  # warm-up: Triton, cuBLAS
        for repeat in range(args.repeat):  # alternating: the first run of a size also pins its pools' host memory
            for name, (_, url) in urls.items():
                runs[name] = load(url, documents, args.new_tokens)
                batches = engines[name].metrics.batches
                row = {"size": size, "engine": name, "run": repeat, "batches_so_far": batches} | summary(runs[name])
                rows.append(row)
                print(json.dumps(row), flush=True)
        alone, batched = (runs[name]["requests"] for name in engines)
        differ = [
            first_difference(a["tokens"], b["tokens"]) if "tokens" in a and "tokens" in b else "error"
            for a, b in zip(alone, batched, strict=True)
        ]
        rows[-1]["first_difference_per_user"] = differ
        print(f"{size}: first differing token per user, batched vs alone (None: equal): {differ}", flush=True)
    for server, _ in urls.values():
        server.should_exit = True
    occupier.release()
    card = torch.cuda.get_device_name()
    print(f"\n{args.shape}, {args.new_tokens} new tokens a user, {args.gpu_memory_gb:g} GB held, {card}")
    for r in rows:
        if "wall_s" not in r:
            print(f"{r['size']:>9} {r['engine']:>13}: {r['errors']} errors")
            continue
        print(
            f"{r['size']:>9} {r['engine']:>13} run {r['run']}: {r['errors']} errors, wall {r['wall_s']} s, "
            f"{r['tokens_per_s']} tok/s, "
            f"first token p50 "
            f"{r['first_token_p50_s']} / p95 {r['first_token_p95_s']} s, inter-token p50 {r['inter_token_p50_ms']} "
            f"/ p95 {r['inter_token_p95_ms']} ms"
        )
    if args.out:
        write_rows(
            args.out, {"shape": args.shape, "gpu_memory_gb": args.gpu_memory_gb, "new_tokens": args.new_tokens}, rows
        )


if __name__ == "__main__":
    main()
