"""A cache connects itself to its model for its lifetime only: the model's own attention for every
other forward, nothing left on it once the last cache is closed or collected."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import tiny_model
from helpers import EXACT, greedy
from transformers import DynamicCache

from infinigen.architectures import decoder_layers
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for


def traces(model: torch.nn.Module) -> list[str]:
    """Forward hooks and attributes of ours on the model's modules."""
    found = []
    for name, module in model.named_modules():
        found += [f"{name}.{kind}" for kind in ("_forward_hooks", "_forward_pre_hooks") if getattr(module, kind)]
        found += [f"{name}.{attribute}" for attribute in vars(module) if "infinigen" in attribute]
    return found


def logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **({cache_argument(model): cache} if cache is not None else {})).logits


IDS = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("ending", ["close", "with", "collected"])
def test_a_finished_cache_leaves_the_model_as_it_was(arch, ending):
    model = tiny_model(arch, attn_implementation="eager")
    before = logits(model, IDS)
    assert model.config._attn_implementation == "eager" and traces(model) == []
    expected = greedy(model, {"input_ids": IDS}, DynamicCache())

    def decode_with(cache) -> None:
        assert torch.equal(greedy(model, {"input_ids": IDS}, cache), expected)
        assert traces(model) != [] and model.config._attn_implementation == "eager"

    cache = cache_for(model, policy="full", **EXACT)
    if ending == "with":
        with cache:
            decode_with(cache)
    else:
        decode_with(cache)
        if ending == "close":
            cache.close()
        else:
            released = weakref.ref(cache)
            del cache
            gc.collect()
            assert released() is None
    assert traces(model) == [] and model.config._attn_implementation == "eager"
    assert torch.equal(logits(model, IDS), before)


def test_the_last_of_two_caches_detaches():
    model = tiny_model("llama")
    expected = greedy(model, {"input_ids": IDS}, DynamicCache())
    first, second = cache_for(model, policy="full", **EXACT), cache_for(model, policy="full", **EXACT)
    first.close()
    assert traces(model) != []
    assert torch.equal(greedy(model, {"input_ids": IDS}, second), expected)
    with pytest.raises(InfinigenError, match="this cache is closed"):
        greedy(model, {"input_ids": IDS}, first)
    second.close()
    assert traces(model) == []
    with pytest.raises(InfinigenError, match="this cache is closed"):  # without any hook left
        logits(model, IDS, second)


def test_forwards_without_the_cache_keep_the_models_own_attention():
    """While a cache lives, a forward without it runs the model's own implementation (masks
    included), and a forward with it runs the cache's attention."""
    model = tiny_model("llama", attn_implementation="eager")
    before = logits(model, IDS)
    seen = []
    decoder_layers(model)[0].register_forward_pre_hook(lambda *_: seen.append(model.config._attn_implementation))
    cache = cache_for(model, policy="full", **EXACT)
    assert torch.equal(logits(model, IDS), before)
    logits(model, IDS, cache)
    assert torch.equal(logits(model, IDS, DynamicCache()), before)
    assert seen == ["eager", "infinigen", "eager"]


def test_an_eager_model_decodes_with_the_cache_as_an_sdpa_one():
    inputs = {"input_ids": IDS}
    sdpa, eager = tiny_model("qwen2"), tiny_model("qwen2", attn_implementation="eager")
    tokens = [greedy(model, inputs, cache_for(model, policy="full", **EXACT)) for model in (sdpa, eager)]
    assert torch.equal(tokens[0], tokens[1])
