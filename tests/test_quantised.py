"""Quantised weights (transformers' ``TorchAoConfig``, torchao's int8 weight-only) under the runtime's cache:
decoding as transformers' own cache does on the same weights, planned at their stored size, and refused
in one line where layers would stream. They need torchao (``.[quant]``), which CI does not install (see
pyproject.toml); run them with it installed."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, greedy, padded_batch
from transformers import AutoModelForCausalLM, DynamicCache

from infinigen.artifacts import open_artifact
from infinigen.artifacts.manifest import ArtifactError
from infinigen.errors import InfinigenError
from infinigen.models import LoadedModel, ModelSource
from infinigen.prepare import prepare_artifact
from infinigen.runtime import cache_for
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.weights import StreamedWeights
from infinigen.tensor_parallel import quantised, weight_bytes

PROMPTS = [[5, 9, 23, 7, 81, 4, 12, 40], [6, 17, 3, 99]]


def quantised_model(folder, device: str):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    config = TorchAoConfig(Int8WeightOnlyConfig())
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantised_weights_decode_through_the_runtime_as_through_transformers_cache(prepared, tokenizer, arch, device):
    """int8 weight-only linears loaded by transformers: an artifact prepared on them (their dequantised q/k
    weights: the unquantised model's artifact is refused, its probes differ by the rounding), and at budget
    1 ``full`` and ``infinigen`` give the tokens of ``DynamicCache`` on the same model."""
    folder, unquantised_artifact = prepared(arch)
    model = quantised_model(folder, device)
    assert quantised(model.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ArtifactError, match="q/k weights differ"):
        open_artifact(str(unquantised_artifact), model)
    inputs = padded_batch(PROMPTS, 1, device)
    expected = greedy(model, inputs, DynamicCache())
    artifact = prepare_artifact(LoadedModel(model, tokenizer, ModelSource(arch, None, "local")), tokens=128)
    for policy in ("full", "infinigen"):
        with cache_for(model, artifact, policy=policy, **EXACT) as cache:
            assert torch.equal(greedy(model, inputs, cache), expected), policy


def test_quantised_weights_are_planned_at_their_size_and_never_streamed(checkpoint, device):
    """The plan counts the int8 codes and their scales, not the logical float32 weights, and streams none of
    them (the plan's last resort is off for them; asking for it is refused in one line)."""
    folder = checkpoint("llama")
    plain = AutoModelForCausalLM.from_pretrained(folder)
    model = quantised_model(folder, device)
    linear = sum(p.numel() for n, p in plain.named_parameters() if n.endswith("proj.weight"))
    assert weight_bytes(plain) - weight_bytes(model) == pytest.approx(3 * linear, rel=0.05)  # 4 -> 1 byte a weight
    planned = memory.loaded_model(model)
    assert planned.weight_bytes == weight_bytes(model) and planned.layer_bytes == 0  # 0: nothing streams
    with pytest.raises(InfinigenError, match=r"quantised weights \(Int8Tensor\) do not stream"):
        StreamedWeights(model, [1], device)
    with pytest.raises(InfinigenError, match="do not stream"):
        cache_for(model, None, policy="full", streamed_layers=1)
