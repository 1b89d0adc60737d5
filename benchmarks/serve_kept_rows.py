"""Conversations about long documents through the server's engine, rows batched against one at a time (issue: the
server, prompts reused across requests; CPU): ``users`` threads, each asking ``questions`` questions in turn about
its own PG-19 passage of ``context`` tokens (each question sent with the conversation so far, once the previous
answer is in), all users at once. Two engines over one model in one process, both keeping prompts (the defaults):
``--max-batch users`` (each batch prefilled a row at a time, every row served from and kept in the prompt cache)
and ``--max-batch 1``. Reported per engine: the wall time, the first token's latency by question (median over the
users), the prompt tokens served from kept prompts, and whether every answer equals the other engine's.
SmolLM2-135M with its artifact by default.

    python benchmarks/serve_kept_rows.py --users 4 --context 1500 --questions 3 --new-tokens 16 --out rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from real_text import with_artifact

from infinigen.eval.decoding import read_text
from infinigen.serve.engine import Engine
from infinigen.serve.protocol import parse


def conversation(engine: Engine, document: str, questions: int, new_tokens: int, out: dict) -> None:
    """One user's questions in turn; ``out``: each question's first-token latency, cached tokens and answer."""
    prompt = document
    for k in range(questions):
        prompt += f"\n\nQuestion {k + 1}: what happens next in this passage?\nAnswer:"
        ask = parse({"model": engine.name, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0}, False)
        start, first = time.perf_counter(), []

        def on_text(text: str, first: list = first) -> None:
            first.append(first[0] if first else time.perf_counter())

        answer = engine.run(ask, engine.admit(ask), on_text)
        out.setdefault("first_token_s", []).append(round((first[0] if first else time.perf_counter()) - start, 3))
        out.setdefault("cached_tokens", []).append(answer.cached_tokens)
        out.setdefault("answers", []).append(answer.text)
        prompt += answer.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what `infinigen generate` takes; default: SmolLM2-135M")
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--context", type=int, default=1500, help="each document's tokens")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact(args.model)
    book = tokenizer(read_text(args.book))["input_ids"]
    documents = [tokenizer.decode(book[u * args.context : (u + 1) * args.context]) for u in range(args.users)]
    runs = {}
    for name, max_batch in (("batched", args.users), ("one at a time", 1)):
        engine = Engine(model, tokenizer, artifact, {}, "model", max_batch=max_batch)
        users = [{} for _ in documents]
        threads = [
            threading.Thread(target=conversation, args=(engine, d, args.questions, args.new_tokens, out))
            for d, out in zip(documents, users, strict=True)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = round(time.perf_counter() - start, 1)
        by_question = [statistics.median(u["first_token_s"][k] for u in users) for k in range(args.questions)]
        runs[name] = {"seconds": seconds, "first_token_p50_s": by_question, "batches": engine.metrics.batches,
                      "rows": engine.metrics.batched_rows, "users": users}  # fmt: skip
        print(f"{name}: {seconds} s, first token p50 by question {by_question}, {engine.metrics.batches} batches")
    batched, alone = (runs[n]["users"] for n in ("batched", "one at a time"))
    equal = all(a["answers"] == b["answers"] for a, b in zip(batched, alone, strict=True))
    result = {"model": args.model or "smollm2-135m", **{k: v for k, v in vars(args).items() if k != "out"}}
    result |= {"speedup": round(runs["one at a time"]["seconds"] / runs["batched"]["seconds"], 2)}
    result |= {"equal_answers": equal, "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
