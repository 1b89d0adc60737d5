"""Whether a row's greedy tokens depend on the rows batched with it (issue: the server; CPU, real text).

SmolLM2-135M (the default model, its artifact prepared here), six PG-19 passages of 260 to 1,000 tokens
(``--book``), 24 greedy tokens each: every passage decoded alone, then all six as one left-padded batch,
through ``infinigen.decode`` with each setting and prefill chunk. Prints, per setting and chunk, the first
token where each row's batched tokens differ from its alone run (-: none); ``--out`` writes JSON.

    python benchmarks/batch_mates.py --out results/batch-mates.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from real_text import with_artifact

from infinigen.runtime import cache_argument, cache_for, decode
from infinigen.runtime.text import left_padded, pad_token_id

LENGTHS = (700, 420, 1000, 260, 900, 555)
SETTINGS = {"defaults": {}, "kv_bits 16": {"kv_bits": 16}, "quest": {"policy": "quest"}}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    differs = (a != b).nonzero()
    return int(differs[0]) if differs.numel() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 256])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact()
    with open(args.book) as f:
        ids = tokenizer(f.read()[:200_000])["input_ids"]
    prompts = [ids[1000 + 8000 * i : 1000 + 8000 * i + n] for i, n in enumerate(LENGTHS)]
    pad = pad_token_id(tokenizer)

    def run(batch: list[list[int]], settings: dict, chunk: int) -> torch.Tensor:
        inputs = left_padded(batch, pad, "cpu")
        with cache_for(model, artifact, **settings) as cache:
            out = model.generate(
                **inputs,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=pad,
                custom_generate=decode,
                prefill_chunk_size=chunk,
                **{cache_argument(model): cache},
            )
        return out[:, inputs["input_ids"].shape[1] :]

    rows = []
    for name, settings in SETTINGS.items():
        for chunk in args.chunks:
            start = time.perf_counter()
            alone = [run([p], settings, chunk)[0] for p in prompts]
            together = run(prompts, settings, chunk)
            differ = [first_difference(a, b) for a, b in zip(alone, together, strict=True)]
            rows.append({"setting": name, "chunk": chunk, "first_difference": differ})
            shown = " ".join("-" if d is None else str(d) for d in differ)
            print(f"{name:>10}, chunks of {chunk:>4}: {shown}   ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.out:
        meta = {"model": "smollm2-135m", "lengths": LENGTHS, "new_tokens": args.new_tokens, "book": args.book}
        with open(args.out, "w") as f:
            json.dump({"meta": meta | {"device": "cpu", "torch": torch.__version__}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
