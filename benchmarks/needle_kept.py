"""Needle in a haystack with kept prompts (issue: kept prompts; CPU): ``needle_accuracy`` over one PG-19 book's
passages, one prompt at a time, twice in one process: with kept prompts (the defaults: a passage's prompts deepest
needle first, each served the passage before its needle by the one before) and with none (``prompt_cache_gb`` 0,
every prompt computed whole). Reported: each run's wall-clock, the prompt tokens served, the accuracy, and whether
every answer equals the other run's. SmolLM2-135M by default (``--model``: another, as `infinigen generate` takes
it). ``--out`` writes JSON.

    python benchmarks/needle_kept.py --length 6000 --depths 0,0.25,0.5,0.75,1 --out results/needle-kept.json
"""

from __future__ import annotations

import argparse
import json
import time

from real_text import with_artifact

from infinigen.eval.decoding import read_text
from infinigen.eval.needle import needle_accuracy, needle_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what `infinigen generate` takes; default: SmolLM2-135M")
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--length", type=int, default=6000, help="each prompt's tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact(args.model)
    depths = [float(d) for d in args.depths.split(",")]
    prompts = needle_prompts(tokenizer, [read_text(args.book)], [args.length], depths, args.trials)
    runs = {}
    for name, settings in (("kept", {}), ("whole", {"prompt_cache_gb": 0})):
        start = time.perf_counter()
        report = needle_accuracy(model, tokenizer, artifact, prompts, **settings)
        runs[name] = {"seconds": round(time.perf_counter() - start, 1), "report": report}
        print(f"{name}: {runs[name]['seconds']} s, cached {report['cached_tokens']}, accuracy {report['accuracy']}")
    outputs = {name: [a["output"] for a in run["report"]["answers"]] for name, run in runs.items()}
    summary = {
        "model": args.model or "smollm2-135m",
        "book": args.book,
        "length": args.length,
        "depths": depths,
        "trials": args.trials,
        "kept_s": runs["kept"]["seconds"],
        "whole_s": runs["whole"]["seconds"],
        "speedup": round(runs["whole"]["seconds"] / runs["kept"]["seconds"], 2),
        "prompt_tokens": args.length * len(prompts),
        "cached_tokens": runs["kept"]["report"]["cached_tokens"],
        "equal_answers": outputs["kept"] == outputs["whole"],
        "answers": [
            {k: a[k] for k in ("depth", "trial", "needle_start", "cached_tokens", "correct", "output")}
            for a in runs["kept"]["report"]["answers"]
        ],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "answers"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary | {"runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
