"""Exact decoding on real text (issue: exact answers; CPU): how many of the policy's drafts the verification
accepts, and whether the tokens are dense decoding's.

SmolLM2-135M (the default model; ``--model``: another) with its artifact prepared here, a PG-19 passage of
``--context`` tokens, ``--new-tokens`` greedy tokens: dense decoding's (``policy=dense``), then ``--exact`` with the
defaults at each ``--budgets`` and ``--draft-tokens``, and the policy alone (not exact) at each budget for
comparison. Reported per run: the first token that differs from dense decoding's (-: none), drafted and accepted
tokens, acceptance, verifications, tokens per verification ((accepted + verifications) / verifications: what a cycle
yields), and decode tok/s (the CPU's: not the GPU's cycle time). ``--batch``: that many consecutive passages decoded
together, which advance by the smallest run of drafts any row accepts: the acceptance is the batch's. ``--out``
writes JSON.

    python benchmarks/exact_acceptance.py --context 2048 --new-tokens 128 --out results/exact-acceptance.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from real_text import with_artifact

from infinigen.runtime import cache_argument, cache_for, decode


def first_difference(tokens: list[int], dense: list[int]) -> int | None:
    """The first position where a row's tokens leave dense decoding's (None: nowhere)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, dense, strict=True)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what `infinigen generate` takes; default: SmolLM2-135M")
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="rows of consecutive passages, decoded together")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.05])
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact(args.model)
    with open(args.book) as f:
        book = tokenizer(f.read()[:1_000_000])["input_ids"][5000:]
    ids = torch.tensor([book[i * args.context : (i + 1) * args.context] for i in range(args.batch)])

    def run(**settings) -> dict:
        start = time.perf_counter()
        with cache_for(model, artifact, **settings) as cache, torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,  # no end token: every run as long
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                custom_generate=decode,
                **{cache_argument(model): cache},
            )
            counts = cache.verified.summary() if cache.verified is not None else {}
        return {"tokens": out[:, ids.shape[1] :].tolist(), "seconds": time.perf_counter() - start, **counts}

    dense = run(policy="dense")
    rows = []
    for budget in args.budgets:
        for draft in [None, *args.draft_tokens]:  # None: the policy alone
            settings = {"budget": budget} | ({"exact": True, "draft_tokens": draft} if draft else {})
            result = run(**settings)
            found = [first_difference(*pair) for pair in zip(result["tokens"], dense["tokens"], strict=True)]
            differs = min((i for i in found if i is not None), default=None)  # any row's first
            row = {"budget": budget, "draft_tokens": draft, "first_difference": differs, "seconds": result["seconds"]}
            if draft:
                per = (result["accepted"] + result["verifications"]) / result["verifications"]
                row |= {k: result[k] for k in ("drafted", "accepted", "acceptance", "verifications")}
                row["tokens_per_verification"] = round(per, 3)
            rows.append(row)
            shown = "-" if differs is None else differs
            extra = f", acceptance {row['acceptance']}, {row['tokens_per_verification']} a cycle" if draft else ""
            print(f"budget {budget} draft {draft or 'off'}: first difference {shown}{extra}", flush=True)
    if args.out:
        meta = vars(args) | {"prompt_tokens": ids.shape[1], "dense_seconds": dense["seconds"]}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
