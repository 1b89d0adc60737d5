"""Exact decoding (``--exact``): the policy drafts, one forward over every cached row verifies, the rejected drafts
are cut off; greedy tokens equal dense decoding's for every tiny architecture, batch 1 and a padded batch, and
what it cannot make exact is refused in one line."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import ARCHITECTURES, invoke
from helpers import greedy, padded_batch, tiny_setup
from transformers import DynamicCache

import infinigen
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for
from infinigen.runtime.config import MOST_DRAFTS, RuntimeConfig

EXACTLY = {"policy": "infinigen", "budget": 0.2, "min_tokens": 2, "draft_tokens": 3}  # drafts a verification corrects


def batch(device, lengths=(9, 23, 16), seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return padded_batch([torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths], 1, device)


def exact_tokens(model, artifact, inputs, new_tokens: int, **settings) -> tuple[torch.Tensor, dict]:
    with cache_for(model, artifact, exact=True, **settings) as cache:
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=1,
            custom_generate=infinigen.decode,
            **{cache_argument(model): cache},
        )
        return out[:, inputs["input_ids"].shape[1] :], cache.verified.summary()


@pytest.mark.parametrize("lengths", [(17,), (9, 23, 16)], ids=["batch 1", "padded batch"])
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "gemma3"])
def test_exact_decoding_gives_dense_decodings_tokens(tokenizer, arch, lengths, device):
    model, artifact = tiny_setup(tokenizer, arch, device)
    inputs = batch(device, lengths)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=64)
    tokens, counts = exact_tokens(model, artifact, inputs, 64, budget=0.1, min_tokens=2, block_tokens=16)
    assert torch.equal(tokens, expected)
    assert counts["verifications"] > 0 and 0 <= counts["accepted"] <= counts["drafted"]


@pytest.mark.parametrize("policy", ["dense", "full", "oracle", "infinigen"])
@pytest.mark.parametrize("draft_tokens", [0, 1, 3, 8])  # 0: adaptive
def test_every_policy_and_draft_length_is_exact(tokenizer, policy, draft_tokens, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = batch(device, seed=4)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=40)
    settings = dict(policy=policy, budget=0.2, min_tokens=2, draft_tokens=draft_tokens)
    tokens, counts = exact_tokens(model, artifact, inputs, 40, **settings)
    assert torch.equal(tokens, expected)
    if policy in ("dense", "full"):  # drafts over every row: each the model's own (the last cycle's may go unread)
        assert counts["accepted"] >= counts["drafted"] - (draft_tokens or MOST_DRAFTS)


@pytest.mark.parametrize(
    ("settings", "generate", "said"),
    [
        ({}, {"do_sample": True}, "greedy"),
        ({"policy": "int4"}, {}, "lossy"),
        ({"policy": "h2o"}, {}, "accumulates"),
        ({"policy": "quest"}, {}, "per page"),
        ({"cpu_pool_gb": 1.0}, {}, "unlimited CPU pool"),
    ],
)
def test_what_exact_decoding_cannot_make_exact_is_refused_in_one_line(tokenizer, settings, generate, said, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = batch(device)
    with cache_for(model, artifact, exact=True, **settings) as cache, pytest.raises(InfinigenError, match=said) as e:
        kwargs = {"do_sample": False} | generate
        model.generate(
            **inputs,
            max_new_tokens=4,
            pad_token_id=1,
            custom_generate=infinigen.decode,
            **kwargs,
            **{cache_argument(model): cache},
        )
    assert "\n" not in str(e.value)
    with pytest.raises(InfinigenError, match="kv_bits 16"):
        cache_for(model, artifact, exact=True, kv_bits=8)


def test_a_sliding_window_the_run_passes_is_refused(tokenizer, device):
    model, artifact = tiny_setup(tokenizer, "gemma3", device)
    inputs = batch(device)
    with cache_for(model, artifact, exact=True) as cache, pytest.raises(InfinigenError, match="sliding window"):
        model.generate(
            **inputs,
            max_new_tokens=200,
            do_sample=False,
            pad_token_id=1,
            custom_generate=infinigen.decode,
            **{cache_argument(model): cache},
        )


def test_the_command_line_decodes_exactly_and_reports_the_drafts(prepared):
    folder, artifact = prepared("llama")
    common = ("generate", str(folder), "--artifact", str(artifact), "--prompt", "the old house", "--device", "cpu")
    out = invoke(*common, "--exact", "--draft-tokens", "3", "--max-new-tokens", "12", "--json")
    assert out.exit_code == 0, out.output
    stats = json.loads(out.output[out.output.index("{") :])["stats"]
    assert stats["exact_verifications"] > 0 and 0 <= stats["exact_accepted"] <= stats["exact_drafted"]
    assert 0 < stats["exact_verification_share"] < 1 and stats["exact_verify_ms"] > 0 and stats["exact_draft_ms"] > 0
    refused = invoke(*common, "--exact", "--temperature", "0.7")
    said = [line for line in refused.output.splitlines() if line.startswith("error")]
    assert refused.exit_code == 2 and len(said) == 1 and "greedy" in said[0] and "Traceback" not in refused.output


@pytest.mark.parametrize("command", [("bench",), ("eval", "ppl"), ("eval", "tasks")])
def test_commands_that_do_not_decode_offer_no_exact_option(command):
    """bench times single decode steps and eval ppl / tasks score teacher-forced: --exact would change nothing."""
    refused = invoke(*command, "--exact")
    assert refused.exit_code == 2 and "No such option: --exact" in refused.output


def test_a_batch_job_decodes_exactly(tokenizer, tmp_path):
    """A job of padded batches under ``exact``: every row is dense decoding's, each row's own length."""
    from test_batch import results, write_requests

    from infinigen.batch import Job, Work, read_requests, run_job

    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    write_requests(tmp_path / "in.jsonl", 6, longest=40)
    requests, bad = read_requests(tmp_path / "in.jsonl")
    rows = {}
    for name, settings in [("dense", {"policy": "dense"}), ("exact", EXACTLY | {"exact": True})]:
        job = Job.of(model, tokenizer, artifact, settings, max_new_tokens=12, max_batch=4)
        run_job(job, Work(requests, bad, tmp_path / f"{name}.jsonl"))
        rows[name] = results(tmp_path / f"{name}.jsonl")
    assert rows["exact"] == rows["dense"] and len(rows["dense"]) == 6


def test_a_server_that_decodes_exactly_answers_greedy_requests_with_dense_tokens(tokenizer):
    """``infinigen serve --exact``: concurrent greedy requests get dense decoding's text; a sampled one a 400."""
    import httpx
    from serving import PROMPTS, client, serving

    from infinigen.serve.engine import Engine

    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    engine = Engine(model, tokenizer, artifact, EXACTLY | {"exact": True}, "tiny")
    expected = []
    for prompt in PROMPTS[:3]:
        inputs = tokenizer(prompt, return_tensors="pt")
        expected.append(tokenizer.decode(greedy(model, inputs, DynamicCache(), new_tokens=10)[0]))
    with serving(engine) as url:
        asked = [{"model": "tiny", "prompt": p, "max_tokens": 10, "temperature": 0} for p in PROMPTS[:3]]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda body: client(url).completions.create(**body), asked))
        sampled = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}, timeout=60
        )
    assert [a.choices[0].text for a in answers] == expected
    assert sampled.status_code == 400 and "send temperature 0" in sampled.json()["error"]["message"]


def test_adaptive_drafting_takes_the_count_of_the_most_tokens_a_second():
    """``draft_tokens`` 0: before a cycle is timed, 4; then the count the acceptance and the cycles' times so far
    promise the most tokens a second from: every draft accepted and a costly verification, the most (16); none
    accepted, 1; the costlier a verification against a draft, the more drafts."""
    from infinigen.runtime.exact import FIRST_DRAFTS, Verified

    def adapted(accepted: int, draft_s: float, verify_s: float, drafted: int = 40, cycles: int = 10) -> int:
        verified = Verified(torch.device("cpu"))
        verified.drafted, verified.accepted = drafted, accepted
        verified.marks = [(0.0, draft_s * drafted / cycles, draft_s * drafted / cycles + verify_s)] * cycles
        return verified.adapted()

    assert Verified(torch.device("cpu")).adapted() == FIRST_DRAFTS == 4
    assert adapted(accepted=40, draft_s=0.01, verify_s=0.1) == MOST_DRAFTS == 16
    assert adapted(accepted=0, draft_s=0.01, verify_s=0.1) == 1
    counts = [adapted(accepted=36, draft_s=0.01, verify_s=v) for v in (0.01, 0.05, 0.2, 1.0)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    with pytest.raises(InfinigenError, match="at least 0"):
        RuntimeConfig(draft_tokens=-1)
