"""``InfinigenCache.crop``: a cache cut back to its first tokens decodes on as one that never held the cut ones
(its slots' state, then the next steps' logits, equal), transformers' prompt-lookup decoding runs with it, and a
cache whose state a cut cannot undo says so in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from helpers import EXACT, padded_batch, tiny_setup

from infinigen.errors import InfinigenError
from infinigen.runtime import StepGraph, cache_argument, cache_for
from infinigen.runtime.cache.layers import OffloadedLayer
from infinigen.runtime.generation import prefill

LENGTHS = (9, 23, 16)  # a padded batch


def prompts(device, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return padded_batch([torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS], 1, device)


@torch.no_grad()
def stepped(model, cache, inputs, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prefill ``inputs`` (when the cache is empty), then one decode step per (B, 1) of ``tokens``: the logits."""
    if not cache.get_seq_length():
        prefill(model, cache, inputs["input_ids"], inputs["attention_mask"])
    step = StepGraph(model, cache)
    start = cache.get_seq_length() - inputs["input_ids"].shape[1]  # decode steps already taken
    position = inputs["attention_mask"].sum(-1, keepdim=True) - 1 + start
    out = []
    for token in tokens:
        position = position + 1
        out.append(step(token, position).clone())
    return out


def slot_state(cache, length: int) -> list[dict[str, torch.Tensor]]:
    """Each layer's state for slots 0 .. length-1, as later steps read it."""
    states = []
    for layer in cache.layers:
        if isinstance(layer, OffloadedLayer):
            # as bytes: a codec's packed codes, viewed as floats, may read as NaN
            rows = torch.cat(layer.pool.blocks, dim=2)[:, :, :length].contiguous().view(torch.uint8)
            state = {"valid": layer.valid[:, :, :length], "rows": rows}
            if layer.pool.scales is not None:
                state["scales"] = layer.pool.scales[:, :, :length]
            partial = getattr(layer.policy, "partial_key_cache", None)
            if partial is not None:
                state["partial"] = partial[:, :, :length]
        else:
            state = {"valid": layer.valid[:, :, :length], "keys": layer.keys[:, :, :length]}
        states.append(state | {"length": torch.tensor([layer.get_seq_length()])})
    return states


OFF = {"budget": 0.3, "reuse_rows": "off"}


@pytest.mark.parametrize(
    ("policy", "settings"),
    [
        ("dense", {}),
        ("full", EXACT),
        ("full", {"kv_bits": 8}),
        ("infinigen", OFF),
        ("infinigen", OFF | {"kv_bits": 16, "block_tokens": 8}),  # 8: the cut steps grew the buffers
        ("int4", OFF),
        ("oracle", OFF),
        # the rows reuse keeps on the GPU: the same ones attended, in other places (the sums' order differs)
        ("infinigen", {"budget": 0.3, "reuse_rows": "on", "resident_extra": 0.0}),
    ],
)
def test_a_cut_cache_decodes_as_one_that_never_held_the_cut_tokens(tokenizer, policy, settings, device):
    """Except where rows of earlier steps are attended (``resident_extra`` > 0, by default where rows are reused):
    which ones are depends on what the recent steps selected, the cut ones too, as after any step."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts(device)
    generator = torch.Generator().manual_seed(1)
    kept, cut, after = (torch.randint(3, 512, (len(LENGTHS), 1), generator=generator).to(device) for _ in range(3))
    drafted = [kept, cut, cut, cut]  # three tokens then cut away: the next token is ``after``, not a fourth ``cut``
    config = dict(policy=policy, min_tokens=2) | settings
    rolled, fresh = cache_for(model, artifact, **config), cache_for(model, artifact, **config)
    stepped(model, rolled, inputs, drafted)
    rolled.crop(-3)
    stepped(model, fresh, inputs, [kept])
    length = fresh.get_seq_length()
    assert rolled.get_seq_length() == length
    for mine, theirs in zip(slot_state(rolled, length), slot_state(fresh, length), strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
    go_on = [after, kept, cut]
    # on CUDA a grown cache selects into its larger capacity: the attention's tiles of masked and attended rows
    # differ, its sums' order too
    reordered = settings.get("reuse_rows") == "on" or (device == "cuda" and "block_tokens" in settings)
    for mine, theirs in zip(stepped(model, rolled, inputs, go_on), stepped(model, fresh, inputs, go_on), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5, rtol=0) if reordered else torch.equal(mine, theirs)


@pytest.mark.parametrize("drafts", ["prompt lookup", "assistant"])
@pytest.mark.parametrize("policy", ["dense", "full"])
def test_assisted_decoding_runs_with_the_cache_and_gives_greedy_tokens(tokenizer, policy, drafts, device):
    """transformers' prompt-lookup decoding (drafts copied from the prompt) and assisted decoding (an assistant
    model's drafts), each verified in one forward and the rejected drafts cropped: greedy's tokens, from a prompt
    that repeats itself so that drafts are accepted too."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    if drafts == "prompt lookup":
        assisted = {"prompt_lookup_num_tokens": 3}
    else:
        assisted = {"assistant_model": tiny_model("llama", seed=1).to(device)}  # other weights: other tokens
    pattern = torch.randint(3, 512, (6,), generator=torch.Generator().manual_seed(2))
    ids = pattern.repeat(4)[None].to(device)
    cuts = []

    def generated(**kwargs) -> tuple[torch.Tensor, int]:
        cache = cache_for(model, artifact, policy=policy, **EXACT)
        crop = cache.crop
        cache.crop = lambda tokens: cuts.append(tokens) or crop(tokens)  # what transformers cuts
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            min_new_tokens=16,  # no end token: every step verified
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=1,
            **kwargs,
            **{cache_argument(model): cache},
        )
        return out[0, ids.shape[1] :], cache.get_seq_length()

    expected, _ = generated()
    assert not cuts
    tokens, cached = generated(**assisted)
    assert torch.equal(tokens, expected)
    assert any(cut < 0 for cut in cuts)  # rejected drafts were cut off
    assert cached == ids.shape[1] + 16 - 1  # every token but the last, no draft left


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"policy": "h2o", "budget": 0.3}, "accumulates the attention"),
        ({"policy": "quest", "budget": 0.3}, "per page"),
        ({"policy": "full", "cpu_pool_gb": 1e-5}, "limited CPU pool"),
    ],
)
def test_a_cache_a_cut_cannot_undo_refuses_in_one_line(tokenizer, settings, said, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts(device)
    cache = cache_for(model, artifact, block_tokens=8, **settings)
    stepped(model, cache, inputs, [inputs["input_ids"][:, -1:]] * 2)
    assert not cache.is_croppable
    with pytest.raises(InfinigenError, match=said) as refused:
        cache.crop(-1)
    assert "\n" not in str(refused.value)
    length = cache.get_seq_length()
    cache.crop(0)  # nothing to remove: no refusal
    with pytest.raises(InfinigenError, match="cannot be removed"):
        cache_for(model, artifact).crop(-1)
    assert cache.get_seq_length() == length


def test_a_cut_given_as_a_tensor_is_the_same_cut(tokenizer):
    """transformers 5.17's assisted decoding passes its cuts as 0-d tensors."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    inputs = prompts("cpu")
    caches = [cache_for(model, artifact, policy="full", **EXACT) for _ in range(2)]
    for cache in caches:
        stepped(model, cache, inputs, [inputs["input_ids"][:, -1:]] * 3)
    caches[0].crop(-2)
    caches[1].crop(torch.tensor(-2))
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == inputs["input_ids"].shape[1] + 1
    assert isinstance(caches[1].get_seq_length(), int)
