"""transformers' prompt-lookup decoding with the cache (issue: exact answers; CPU, real text): drafts copied from
the prompt, verified in one forward that attends every cached row, the rejected ones cut off (``crop``).

SmolLM2-135M-Instruct (the default model, its artifact prepared here), a PG-19 passage of ``--passage`` tokens
in its chat template after a request to repeat it word for word (an answer that copies from the document), greedy.
For each policy: ``infinigen.decode`` (one token a step) against ``generate(prompt_lookup_num_tokens=K)`` with a
fresh cache of the same settings, timed alternately ``--repeat`` times in this process. Reported: new tokens/s
(after the prefill's first token), the forwards after the prefill (tokens per forward), whether the tokens equal
``infinigen.decode``'s (they should where the policy attends every row: ``dense``, ``full``; a sparse policy's
verification attends every row where its steps do not) and where they first differ, each path's from dense
decoding's too. ``--out`` writes JSON.

    python benchmarks/prompt_lookup.py --out results/prompt-lookup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from real_text import with_artifact

from infinigen.runtime import cache_argument, cache_for, decode

SETTINGS = {"dense": {"policy": "dense"}, "full": {"policy": "full", "kv_bits": 16}, "infinigen": {}}


class Forwards:
    """Counts the model's forwards (a forward hook on it) and the times of the new tokens (a streamer)."""

    def __init__(self, model) -> None:
        self.calls, self.times, self.at_first = 0, [], 0
        model.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 2:  # the first new token (the prompt came first): the prefill's forwards done
            self.at_first = self.calls

    def end(self) -> None:
        pass


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--passage", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--lookup", type=int, default=5, help="prompt_lookup_num_tokens")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, artifact = with_artifact()
    with open(args.book) as f:
        passage = tokenizer.decode(tokenizer(f.read()[20_000:200_000])["input_ids"][: args.passage])
    ask = f"Repeat this text exactly, word for word:\n\n{passage}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    counter = Forwards(model)

    def run(settings: dict, lookup: bool) -> dict:
        counter.calls, counter.times = 0, []
        start = time.perf_counter()
        extra = {"prompt_lookup_num_tokens": args.lookup} if lookup else {"custom_generate": decode}
        # transformers' own loop streams through ``streamer``; infinigen.decode through ``decode_streamer``
        extra |= {"streamer": counter} if lookup else {"decode_streamer": counter}
        with cache_for(model, artifact, **settings) as cache, torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                **extra,
                **{cache_argument(model): cache},
            )
        new, times = out[0, ids.shape[1] :], counter.times[1:]  # the new tokens' times (the prompt's first)
        return {
            "tokens": new.tolist(),
            "first_token_s": times[0] - start,
            "tokens_per_s": (len(new) - 1) / (times[-1] - times[0]),
            "forwards_after_prefill": counter.calls - counter.at_first,
        }

    rows, dense = [], None
    for name, settings in SETTINGS.items():
        runs = {"decode": [], "lookup": []}
        for _ in range(args.repeat):
            for path in runs:
                runs[path].append(run(settings, path == "lookup"))
        plain, lookup = runs["decode"][0]["tokens"], runs["lookup"][0]["tokens"]
        dense = dense or plain  # the first policy's: dense decoding
        differs = first_difference(plain, lookup)
        row = {"policy": name, "settings": settings, "prompt_tokens": ids.shape[1], "first_difference": differs}
        row |= {"decode_vs_dense": first_difference(plain, dense), "lookup_vs_dense": first_difference(lookup, dense)}
        for path, results in runs.items():
            row[f"{path}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in results)
            row[f"{path}_forwards"] = results[0]["forwards_after_prefill"]
            row[f"{path}_new_tokens"] = len(results[0]["tokens"])
        row["answer"] = tokenizer.decode(lookup, skip_special_tokens=True)
        rows.append(row)
        print(
            f"{name:>10}: decode {row['decode_tokens_per_s']:.1f} tok/s ({row['decode_forwards']} forwards), "
            f"prompt lookup {row['lookup_tokens_per_s']:.1f} tok/s ({row['lookup_forwards']} forwards for "
            f"{row['lookup_new_tokens']} tokens); first difference between them {differs}, from dense decoding's: "
            f"{row['decode_vs_dense']} / {row['lookup_vs_dense']}",
            flush=True,
        )
    print(f"answer: {rows[-1]['answer']!r}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
