"""One long request through ``infinigen serve`` against ``generate`` in the same process (issue: the server).

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``), a tokenizer
of one word per id (the shape has none of its own), a prompt of ``--context`` random tokens. Timed:
``--repeat`` streamed requests through the server on 127.0.0.1 (the ``openai`` client; first token, median
gap between streamed tokens, tokens/s after the first) and as many ``generate`` calls through a fresh
``cache_for(model)`` with ``infinigen.decode``, alternating, each path warmed up once at the size timed. Prints a table;
``--out`` writes JSON.

    python benchmarks/serve_gpu.py --shape llama-3-8b --gpu-memory-gb 24 --context 32768 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import openai
import torch
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import infinigen
from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.runtime import cache_argument
from infinigen.serve.app import make_app
from infinigen.serve.engine import Engine


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One word per id ("t0", "t1", ...): every token a random model samples decodes to a piece of text."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


def prompt_of(tokens: int, vocab_size: int) -> str:
    ids = torch.randint(1, vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return " ".join(f"t{i}" for i in ids.tolist())


def rates(times: list[float], start: float) -> dict:
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return {
        "first_token_s": round(times[0] - start, 3),
        "median_step_ms": round(gaps[len(gaps) // 2] * 1e3, 2),
        "tokens_per_s": round((len(times) - 1) / (times[-1] - times[0]), 2),
        "tokens": len(times),
    }


def through_server(url: str, prompt: str, new_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    start, times = time.perf_counter(), []
    stream = client.completions.create(
        model="shape", prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True, stop=None
    )
    for piece in stream:
        if piece.choices and piece.choices[0].text:
            times.append(time.perf_counter())
    return rates(times, start)


class Timer:
    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def through_generate(engine: Engine, prompt: str, new_tokens: int) -> dict:
    ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]], device=engine.device)
    timer, start = Timer(), time.perf_counter()
    with infinigen.cache_for(engine.model, engine.artifact) as cache, torch.no_grad():
        engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            custom_generate=infinigen.decode,
            decode_streamer=timer,
            **{cache_argument(engine.model): cache},
        )
    return rates(timer.times[1:], start)  # times[0]: the prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    occupier = Occupier(args.gpu_memory_gb, "cuda")
    model = random_model(args.shape, "cuda", torch.bfloat16)
    vocab = model.config.vocab_size
    tokenizer = word_tokenizer(vocab)
    engine = Engine(model, tokenizer, random_artifact(model, args.shape, 0.5), {}, "shape")
    server = uvicorn.Server(uvicorn.Config(make_app(engine), host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    prompt = prompt_of(args.context, vocab)
    through_server(url, prompt, 8)  # warm-up at the size timed: Triton's compilation, the first captures
    through_generate(engine, prompt, 8)
    rows = []
    for i in range(args.repeat):
        rows.append({"path": "server", "run": i} | through_server(url, prompt, args.new_tokens))
        rows.append({"path": "generate", "run": i} | through_generate(engine, prompt, args.new_tokens))
        print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    server.should_exit = True
    occupier.release()
    by = {p: statistics.median(r["tokens_per_s"] for r in rows if r["path"] == p) for p in ("server", "generate")}
    print(
        f"\n{args.shape}, 1 x {args.context} + {args.new_tokens}, {args.gpu_memory_gb:g} GB held, "
        f"{torch.cuda.get_device_name()}"
    )
    for r in rows:
        print(
            f"{r['path']:>9} run {r['run']}: first token {r['first_token_s']} s, step {r['median_step_ms']} ms, "
            f"{r['tokens_per_s']} tok/s ({r['tokens']} tokens)"
        )
    print(f"server / generate tokens/s (medians): {by['server'] / by['generate']:.3f}")
    if args.out:
        write_rows(args.out, {"shape": args.shape, "gpu_memory_gb": args.gpu_memory_gb, "context": args.context}, rows)


def write_rows(path: str, meta: dict, rows: list[dict]) -> None:
    """The run's rows as JSON, with what it ran on."""
    with open(path, "w") as f:
        json.dump({"meta": meta | {"device": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
