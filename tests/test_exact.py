"""Exact decoding (``--exact``): the policy drafts, one forward over every cached row verifies, the rejected drafts
are cut off; greedy tokens equal dense decoding's for every tiny architecture, batch 1 and a padded batch, and
what it cannot make exact is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHITECTURES, invoke
from helpers import greedy, padded_batch, tiny_setup
from transformers import DynamicCache

import infinigen
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for


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
@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
def test_every_policy_and_draft_length_is_exact(tokenizer, policy, draft_tokens, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = batch(device, seed=4)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=40)
    settings = dict(policy=policy, budget=0.2, min_tokens=2, draft_tokens=draft_tokens)
    tokens, counts = exact_tokens(model, artifact, inputs, 40, **settings)
    assert torch.equal(tokens, expected)
    if policy in ("dense", "full"):  # drafts over every row: each the model's own (the last cycle's may go unread)
        assert counts["accepted"] >= counts["drafted"] - draft_tokens


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
