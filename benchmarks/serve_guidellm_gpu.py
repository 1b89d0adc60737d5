"""``infinigen serve`` under guidellm, a load tool of the field (issue: the server): users in conversations about
their own long documents, every question sent with the conversation so far, over 127.0.0.1.

A random-weight shape on a GPU budget held for the whole process (as ``bench --gpu-memory-gb``). guidellm writes
its synthetic text with Faker's English words, so the tokenizer here has one id per Faker word (lower-cased,
punctuation apart) and ``t<id>`` words for the rest of the vocabulary: guidellm counts the tokens the server sees,
and every token the random model samples decodes to text. guidellm runs as a subprocess: ``--users`` concurrent
conversations of ``--questions`` turns, the first turn ``--context`` tokens (the document and its first question),
each later one ``--question-tokens`` more, ``--new-tokens`` generated each (``ignore_eos``). In the same process
and before the load, ``generate`` through ``infinigen.decode`` at 1 x the first turn's size, as many new tokens,
gives the step the server's inter-token latency is held against (its median, and its mean gap: a fresh cache
runs its first steps eagerly and captures its graph, as each request's does). Reported: guidellm's first-token
latency by turn, inter-token latency, tokens/s, errors; the server's prompt tokens served from kept prompts,
its batches, and its planned against measured GPU peak. Prints a table; ``--out`` writes JSON (guidellm's
own report beside it).

    pip install -e ".[load]"   # guidellm 0.8
    python benchmarks/serve_guidellm_gpu.py --gpu-memory-gb 24 --users 8 --context 32768 --questions 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
from faker.providers.lorem.en_US import Provider
from serve_gpu import prompt_of, through_generate, through_server
from serve_load_gpu import percentile, serving
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from infinigen.bench.occupy import Occupier
from infinigen.bench.shapes import random_artifact, random_model
from infinigen.runtime.config import KEPT_CHUNK
from infinigen.serve.engine import Engine


def faker_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Faker's English words, punctuation and the numbers guidellm starts a prompt with an id each (the rest
    ``t<id>``): its text is then the tokens it counted (an unknown word, the special ``t0``, would not decode)."""
    words = ["t0", *sorted({w.lower() for w in Provider.word_list}), ".", ",", "?", "!", "'", "-"]
    words += [str(i) for i in range(1000)]
    words = words[:vocab_size] + [f"t{i}" for i in range(len(words), vocab_size)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t0"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


def guidellm(url: str, tokenizer_dir: str, args, report: str) -> None:
    data = (
        f"kind=synthetic_text,first_prompt_tokens={args.context},prompt_tokens={args.question_tokens},"
        f"output_tokens={args.new_tokens},turns={args.questions}"
    )
    command = [
        *(sys.executable, "-m", "guidellm", "run"),
        *("--backend", f"kind=openai_http,target={url},model=shape,request_format=/v1/completions,timeout=3600"),
        *("--profile", f"kind=concurrent,streams={args.users}"),
        *("--data", data, "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}"),
        *("--constraint", f"kind=max_requests,count={args.users * args.questions + 1}"),
        *("--output", f"kind=json,path={report}", "--disable-console-interactive"),
    ]
    subprocess.run(command, check=True)


def server_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs if "{" not in name and "_bucket" not in name}


def summary(report: dict, questions: int, step_ms: float, metrics: dict[str, float]) -> dict:
    run = report["benchmarks"][0]
    answered, totals = run["requests"]["successful"], run["metrics"]["request_totals"]
    # guidellm's max_requests cuts a conversation's last turn unless one more request may start (a next
    # conversation's first turn): the statistics are those of the conversations answered whole
    conversations: dict[str, list[dict]] = {}
    for request in answered:
        conversations.setdefault(request["info"]["conversation_id"], []).append(request)
    done = [r for rs in conversations.values() if len(rs) == questions for r in rs]
    if not done:
        raise SystemExit(f"no conversation answered whole: {totals}")
    by_turn: dict[int, list[dict]] = {}
    for request in done:
        by_turn.setdefault(request["info"]["turn_index"], []).append(request)
    turns = {
        turn: {
            "requests": len(rs),
            "prompt_tokens_p50": statistics.median(r["prompt_tokens"] for r in rs),
            "cached_tokens_p50": statistics.median(r["cached_tokens"] or 0 for r in rs),
            "first_token_ms_p50": percentile([r["time_to_first_token_ms"] for r in rs], 0.5),
            "first_token_ms_p95": percentile([r["time_to_first_token_ms"] for r in rs], 0.95),
            "first_token_ms_min": min(r["time_to_first_token_ms"] for r in rs),
        }
        for turn, rs in sorted(by_turn.items())
    }
    gaps = [r["inter_token_latency_ms"] for r in done]  # each request's mean gap between its tokens
    output = sum(r["output_tokens"] for r in answered)
    return {
        "requests": totals,
        "conversations_whole": len(done) // questions,
        "duration_s": run["duration"],
        "output_tokens_per_s": output / run["duration"],
        "inter_token_ms_p50": percentile(gaps, 0.5),
        "inter_token_ms_p95": percentile(gaps, 0.95),
        "generate_step_ms": step_ms,
        "inter_token_p50_over_step": percentile(gaps, 0.5) / step_ms,
        "turns": turns,
        "server": {k: v for k, v in metrics.items() if not k.startswith(("infinigen_time_", "infinigen_inter_"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--gpu-memory-gb", type=float, default=24)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768, help="the first turn's tokens")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=KEPT_CHUNK, help="kept prompts serve whole chunks")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (a tiny shape)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    occupier = Occupier(args.gpu_memory_gb, "cuda") if cuda else None
    model = random_model(args.shape, args.device, torch.bfloat16 if cuda else torch.float32)
    tokenizer = faker_tokenizer(model.config.vocab_size)
    engine = Engine(model, tokenizer, random_artifact(model, args.shape, 0.5), {}, "shape", args.prefill_chunk)
    prompt = prompt_of(args.context, 2000)  # ids of Faker's words
    through_generate(engine, prompt, 8)  # warm-up at the size timed: Triton's compilation, the first captures
    timed = through_generate(engine, prompt, args.new_tokens)  # a fresh cache, as each request has
    step_ms, mean_gap_ms = timed["median_step_ms"], 1e3 / timed["tokens_per_s"]
    server, url = serving(engine)
    through_server(url, prompt, 8)  # the server's own warm-up: its first pools' host memory pinned
    with tempfile.TemporaryDirectory() as work:
        tokenizer.save_pretrained(work)
        started = time.perf_counter()
        guidellm(url, work, args, f"{work}/report.json")
        wall = time.perf_counter() - started
        with open(f"{work}/report.json") as f:
            report = json.load(f)
    result = summary(report, args.questions, step_ms, server_metrics(url))
    result |= {"wall_s": wall, "generate_mean_gap_ms": mean_gap_ms}
    server.should_exit = True
    if occupier is not None:
        occupier.release()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"\n{args.shape}, {args.users} users x {args.questions} questions, first turn {args.context} tokens, "
        f"+{args.question_tokens} a turn, {args.new_tokens} new; {args.gpu_memory_gb:g} GB held, "
        f"{device}"
    )
    print(
        f"requests {result['requests']}, {result['conversations_whole']} conversations whole; "
        f"{result['output_tokens_per_s']:.1f} tok/s over {result['duration_s']:.1f} s"
    )
    print(
        f"inter-token p50 / p95 {result['inter_token_ms_p50']:.2f} / {result['inter_token_ms_p95']:.2f} ms "
        f"(generate at 1 x {args.context}: median step {step_ms} ms, {result['inter_token_p50_over_step']:.2f}x; "
        f"mean gap {mean_gap_ms:.2f} ms over its {args.new_tokens} tokens)"
    )
    first = result["turns"][0]["first_token_ms_p50"]
    for turn, t in result["turns"].items():
        latency = f"{t['first_token_ms_p50']:.0f} / {t['first_token_ms_p95']:.0f} / {t['first_token_ms_min']:.0f}"
        print(
            f"turn {turn}: {t['requests']} requests, prompt {t['prompt_tokens_p50']:.0f} tokens "
            f"({t['cached_tokens_p50']:.0f} cached), first token p50 / p95 / min {latency} ms "
            f"({t['first_token_ms_p50'] / first:.3f} of turn 0's p50)"
        )
    server_rows = result["server"]
    print({k: server_rows.get(k) for k in ("infinigen_batches_total", "infinigen_prompt_tokens_cached_total")})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": vars(args) | {"device": device}, "result": result}, f, indent=1)
        with open(args.out.replace(".json", "-guidellm.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
