"""Kept prompts on real text (issue: kept prompts; CPU): questions about one PG-19 passage, each answered cold
(nothing kept) and warm (from the prompt the first question kept: the passage and the common start of the
questions served, the rest prefilled), greedy, with the defaults. Reported per question: the first token's time
cold and warm, the tokens served, and whether the answer's tokens equal the cold run's (the first difference if
not). SmolLM2-135M by default (``--model``: another, as `infinigen generate` takes it). ``--out`` writes JSON.

    python benchmarks/prompt_cache_text.py --context 8000 --new-tokens 32 --out results/prompt-cache-text.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from exact_acceptance import first_difference
from real_text import with_artifact

import infinigen
from infinigen.runtime import cache_argument
from infinigen.runtime.config import KEPT_CHUNK

QUESTIONS = [
    "Who is the main character of this story?",
    "Where does the story take place?",
    "What happens at the end of the passage?",
    "Name two people mentioned in the passage.",
]


class FirstToken:
    """A streamer that notes when the first new token arrives (after the prompt's ``put``)."""

    def __init__(self) -> None:
        self.start, self.puts, self.first = time.perf_counter(), 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what `infinigen generate` takes; default: SmolLM2-135M")
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--context", type=int, default=8000, help="the passage's tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="the first N of QUESTIONS")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact(args.model)
    with open(args.book) as f:
        passage = tokenizer(f.read()[:2_000_000])["input_ids"][5000 : 5000 + args.context]
    asked = [passage + tokenizer(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False)["input_ids"]
             for q in QUESTIONS[: args.questions]]  # fmt: skip
    prompts = infinigen.PromptCache()

    def answer(ids: list[int], kept: infinigen.PromptCache | None) -> dict:
        prompt, timer = torch.tensor([ids]), FirstToken()
        with infinigen.cache_for(model, artifact, prompts=kept) as cache, torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, prefill_chunk_size=KEPT_CHUNK,
                                 pad_token_id=tokenizer.eos_token_id, custom_generate=infinigen.decode,
                                 decode_streamer=timer, **{cache_argument(model): cache})  # fmt: skip
            cached = cache.reused_tokens
        return {"first_token_s": round(timer.first, 3), "cached": cached, "tokens": out[0, len(ids) :].tolist()}

    rows = []
    for i, ids in enumerate(asked):
        cold, warm = answer(ids, None), answer(ids, prompts)
        differs = first_difference(warm["tokens"], cold["tokens"])
        row = {"question": i, "prompt_tokens": len(ids), "cold_first_token_s": cold["first_token_s"]}
        row |= {"warm_first_token_s": warm["first_token_s"], "cached_tokens": warm["cached"]}
        row |= {"equal": differs is None, "first_difference": differs, "answer": tokenizer.decode(cold["tokens"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'q':>2} {'prompt':>7} {'cached':>7} {'cold s':>7} {'warm s':>7} equal")
    for r in rows:
        print(
            f"{r['question']:>2} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['cold_first_token_s']:>7} "
            f"{r['warm_first_token_s']:>7} {r['equal'] if r['equal'] else r['first_difference']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args) | {"device": "cpu", "torch": torch.__version__}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
