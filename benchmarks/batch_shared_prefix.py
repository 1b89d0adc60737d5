"""A batch job of questions about one document (issue: kept prompts): the shared prefix computed once
(``batch.shared``, the default) against the same job with ``prompt_cache_gb=0`` (the requests padded and
batched, each prefilled whole), in one process on real text: SmolLM2-135M by default, one PG-19 passage of
``--context`` tokens, ``--questions`` questions, greedy. Reported per mode: the job's seconds, tokens/s, the
prompt tokens served from the kept prefix; per request, whether its tokens equal the batched job's and the
request run alone (the reference a kept prefix is held to: a batch's padding moves its rows' numbers).
``--out`` writes JSON.

    python benchmarks/batch_shared_prefix.py --context 2000 --questions 8 --out results/batch-shared.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from prompt_cache_text import QUESTIONS
from real_text import with_artifact

from infinigen.batch import Job, Work, read_requests, run_job

MORE = [
    "What is the weather like?",
    "Who speaks first?",
    "What is the mood of the passage?",
    "Which places are named?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what `infinigen generate` takes; default: SmolLM2-135M")
    parser.add_argument("--book", default="../shared/data/pg19/10146.txt")
    parser.add_argument("--context", type=int, default=2000, help="the passage's tokens")
    parser.add_argument("--questions", type=int, default=8, help="at most 8")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, tokenizer, artifact = with_artifact(args.model)
    with open(args.book) as f:
        passage = tokenizer.decode(tokenizer(f.read()[:2_000_000])["input_ids"][5000 : 5000 + args.context])
    questions = (QUESTIONS + MORE)[: args.questions]
    records = [{"id": f"q{i}", "prompt": f"{passage}\n\nQuestion: {q}\nAnswer:"} for i, q in enumerate(questions)]
    folder = Path(tempfile.mkdtemp())
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    requests, _ = read_requests(folder / "in.jsonl")

    def job(name: str, chosen, **settings) -> tuple[dict, dict]:
        planner = {"max_new_tokens": args.new_tokens, "max_batch": args.max_batch, "prefill_chunk": 512}
        output = folder / f"{name}.jsonl"
        report = run_job(Job.of(model, tokenizer, artifact, settings, **planner), Work(chosen, [], output))
        rows = {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}
        return report.report(), rows

    shared, shared_rows = job("shared", requests)
    batched, batched_rows = job("batched", requests, prompt_cache_gb=0)
    alone = {r.id: job(f"alone-{r.id}", [r], prompt_cache_gb=0)[1][r.id] for r in requests}
    table = []
    for r in requests:
        row = shared_rows[r.id]
        table.append({"id": r.id, "prompt_tokens": row["stats"]["prompt_tokens"],
                      "cached_tokens": row["stats"]["cached_tokens"], "text": row["text"],
                      "equal_to_batched": row["text"] == batched_rows[r.id]["text"],
                      "equal_to_alone": row["text"] == alone[r.id]["text"],
                      "batched_equal_to_alone": batched_rows[r.id]["text"] == alone[r.id]["text"]})  # fmt: skip
    print(f"\n{'mode':>8} {'seconds':>8} {'tok/s':>7} {'cached':>7}")
    for name, report in (("shared", shared), ("batched", batched)):
        print(f"{name:>8} {report['seconds']:>8} {report['tokens_per_s']:>7} {report['cached_tokens']:>7}")
    print(f"speedup {batched['seconds'] / shared['seconds']:.2f}x")
    for row in table:
        print(json.dumps({k: v for k, v in row.items() if k != "text"}))
    if args.out:
        meta = vars(args) | {"device": "cpu", "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "shared": shared, "batched": batched, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
