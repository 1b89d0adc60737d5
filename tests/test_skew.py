"""Skewing must leave every attention score q·kᵀ unchanged, for every architecture, and concentrate
the score energy in the kept channels on a real model."""

from __future__ import annotations

import copy

import pytest
import scipy.linalg
import torch
from conftest import ARCHITECTURES

from infinigen.architectures import attention_norm, decoder_layers, model_spec
from infinigen.errors import InfinigenError
from infinigen.prepare import capture_calibration, prepare_artifact, skew_layer
from infinigen.prepare.calibration import load_samples
from infinigen.prepare.capture import capture_qk
from infinigen.prepare.fold import skew_model_in_place
from infinigen.prepare.skew import right_singular_vectors, score_energy, skew_head
from infinigen.runtime.selection.speculation import LayerSpeculator


def max_relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact.double()).abs().max() / exact.double().abs().max())


def max_score_error(skewed_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float:
    """max over (t, u) of |skewed score - q_t·k_u| / (‖q_t‖ ‖k_u‖): the scale of dot-product rounding."""
    q, k = q.double(), k.double()
    scale = q.norm(dim=1)[:, None] * k.norm(dim=1)[None, :]
    return float(((skewed_scores.double() - q @ k.T).abs() / scale).max())


def assert_scores_preserved(loaded, artifact, tokens: int = 256) -> None:
    """Per layer and query head, (q A)(k A)ᵀ == q kᵀ with the head's KV-group skew A."""
    spec = model_spec(loaded.model.config)
    captured = capture_calibration(loaded, load_samples(loaded.tokenizer, tokens=tokens))
    for layer, (q, k) in captured.items():
        skew = artifact.skew_matrix(layer)  # (kv_heads, d, d)
        for head in range(spec.n_heads):
            kv_head = head // spec.group_size
            a, qh, kh = skew[kv_head].double(), q[head].double(), k[kv_head].double()
            assert max_score_error((qh @ a) @ (kh @ a).T, qh, kh) <= 1e-5
            # In float16 (q, k, A and the skewed q/k rounded; products accumulated in float32, as GPU
            # kernels do), against the float16 model's own scores.
            q16, k16, a32 = qh.half(), kh.half(), a.half().float()
            skewed_q, skewed_k = (q16.float() @ a32).half(), (k16.float() @ a32).half()
            assert max_score_error(skewed_q.float() @ skewed_k.float().T, q16, k16) <= 1e-3


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_skew_preserves_scores_tiny(tiny, arch):
    loaded = tiny(arch)
    assert_scores_preserved(loaded, prepare_artifact(loaded, tokens=256))


def test_skew_preserves_scores_smollm2(smollm2, smollm2_artifact):
    assert_scores_preserved(smollm2, smollm2_artifact)


def test_skew_concentrates_score_energy_smollm2(smollm2_artifact):
    energy = smollm2_artifact.manifest.energy
    before = sum(e["before"] for e in energy) / len(energy)
    after = sum(e["after"] for e in energy) / len(energy)
    improved = sum(e["after"] > e["before"] for e in energy)
    print(f"SmolLM2 score energy in kept channels: {before:.3f} -> {after:.3f}, {improved}/{len(energy)} layers up")
    assert after > before + 0.02
    assert improved >= 0.8 * len(energy)


def test_skew_matrices_are_orthogonal(tiny):
    artifact = prepare_artifact(tiny("llama"), tokens=128)
    for layer in range(3):
        a = artifact.skew_matrix(layer).double()
        eye = torch.eye(a.shape[-1], dtype=torch.float64).expand_as(a)
        torch.testing.assert_close(a.mT @ a, eye, atol=1e-5, rtol=0)


def test_ablations_skip_the_skew_or_draw_random_channels_in_every_layer(tiny):
    loaded = tiny("llama")
    svd = prepare_artifact(loaded, tokens=128)
    identity = prepare_artifact(loaded, tokens=128, skew="identity")
    random = prepare_artifact(loaded, tokens=128, channel_rule="random")
    assert svd.manifest.method == {"skew": "svd", "channels": "top"}
    assert identity.manifest.method == {"skew": "identity", "channels": "top"}
    for layer in range(3):
        eye = torch.eye(16).expand(2, 16, 16)
        assert not torch.allclose(svd.skew_matrix(layer), eye, atol=1e-3)
        assert torch.equal(identity.skew_matrix(layer), eye)
        torch.testing.assert_close(random.skew_matrix(layer), svd.skew_matrix(layer))
    assert any(not torch.equal(random.channels(i), svd.channels(i)) for i in range(3))
    with pytest.raises(InfinigenError, match="skew must be one of"):
        prepare_artifact(loaded, tokens=128, skew="pca")


def test_channel_indices_shape_and_range(tiny):
    loaded = tiny("qwen3")
    artifact = prepare_artifact(loaded, tokens=128, ratio=0.25)
    channels = artifact.channels(0)
    assert channels.shape == (2, 4) and channels.dtype == torch.int64  # 2 KV heads, ceil(0.25 * 16)
    assert bool((channels.diff(dim=1) > 0).all()) and channels.min() >= 0 and channels.max() < 16


def test_svd_falls_back_to_gesvd(monkeypatch):
    torch.manual_seed(0)
    queries = torch.randn(200, 16, dtype=torch.float64) * torch.linspace(0.1, 5, 16, dtype=torch.float64)
    keys = torch.randn(100, 16, dtype=torch.float64)
    expected = right_singular_vectors(queries)
    called = {}

    def no_convergence(*args, **kwargs):
        raise torch.linalg.LinAlgError("The algorithm failed to converge")

    real_svd = scipy.linalg.svd

    def spy(*args, **kwargs):
        called["driver"] = kwargs.get("lapack_driver")
        return real_svd(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", no_convergence)
    monkeypatch.setattr(scipy.linalg, "svd", spy)
    head = skew_head(queries, keys, 4)
    assert called["driver"] == "gesvd"
    # Same subspaces up to the sign of each singular vector.
    torch.testing.assert_close(head.skew_matrix.double().abs(), expected.abs(), atol=1e-6, rtol=0)
    skewed = (queries @ head.skew_matrix.double()) @ (keys @ head.skew_matrix.double()).T
    assert max_relative_error(skewed, queries @ keys.T) <= 1e-5


def test_gqa_skew_is_shared_by_query_group(tiny):
    """One skew per KV head, computed from the group's stacked queries."""
    loaded = tiny("llama")
    q, k = capture_calibration(loaded, load_samples(loaded.tokenizer, tokens=64))[1]
    heads = skew_layer(q, k, n_kv_heads=2, n_channels=5)
    stacked = torch.cat([q[2], q[3]])  # query heads 2 and 3 share KV head 1
    torch.testing.assert_close(heads[1].skew_matrix.abs(), right_singular_vectors(stacked.double()).float().abs())


def test_opt_folded_partial_query_matches_skewed_query(tiny):
    loaded = tiny("opt")
    artifact = prepare_artifact(loaded, tokens=64)
    q, _ = capture_calibration(loaded, load_samples(loaded.tokenizer, tokens=64))[2]
    layer = loaded.model.model.decoder.layers[2]
    hidden = {}

    def keep_attention_input(module, args, output):
        hidden["x"] = output[0]  # (T, hidden)

    handle = layer.self_attn_layer_norm.register_forward_hook(keep_attention_input)
    loaded.model(input_ids=load_samples(loaded.tokenizer, tokens=64)[0].input_ids)
    handle.remove()
    x = torch.cat([hidden["x"], torch.ones(hidden["x"].shape[0], 1)], dim=1).double()
    weight = artifact.partial_query_weight(2).double()  # (heads, r, hidden + 1)
    skew, channels = artifact.skew_matrix(2).double(), artifact.channels(2)
    for head in range(4):
        expected = (q[head].double() @ skew[head])[:, channels[head]]
        torch.testing.assert_close(x @ weight[head].T, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_rope_partial_query_is_the_skewed_query_in_logit_units(tiny, arch):
    """The runtime's partial query of a RoPE layer, from the layer's attention input and rotary cos/sin,
    is the query its attention computes (q norm, RoPE) skewed, cut to the kept channels and scaled as
    the attention scales its logits: Gemma 3 by query_pre_attn_scalar**-0.5 (1/8 here), not 32**-0.5."""
    loaded = tiny(arch)
    model, spec = loaded.model, model_spec(loaded.model.config)
    artifact = prepare_artifact(loaded, tokens=64)
    layer = spec.n_layers - 1  # on tiny Gemma 3 a full-attention layer
    block = decoder_layers(model)[layer]
    seen = {}
    hooks = [
        attention_norm(block).register_forward_hook(lambda module, args, out: seen.update(x=out[:, -1])),
        block.register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(rope=kwargs["position_embeddings"]), with_kwargs=True
        ),
    ]
    with capture_qk(model) as records, torch.no_grad():
        model(input_ids=load_samples(loaded.tokenizer, tokens=64)[0].input_ids, use_cache=False)
        speculator = LayerSpeculator(spec, artifact, layer, block.self_attn, "cpu", torch.float32)
        partial = speculator.partial_query(seen["x"], seen["rope"])[0]  # (heads, r, zero-padded)
    for hook in hooks:
        hook.remove()
    query = records[layer][0][0][:, -1].double()  # (heads, d): the last token's
    skew, channels = artifact.skew_matrix(layer).double(), artifact.channels(layer)
    scale = block.self_attn.scaling
    assert scale == (64**-0.5 if arch == "gemma3" else spec.head_dim**-0.5)
    for head in range(spec.n_heads):
        kv_head = head // spec.group_size
        expected = (query[head] @ skew[kv_head])[channels[kv_head]] * scale
        torch.testing.assert_close(partial[head, : channels.shape[1]].double(), expected, atol=1e-5, rtol=1e-4)


def test_opt_skewed_checkpoint_has_identical_logits(tiny):
    loaded = tiny("opt", dtype=torch.float64)
    artifact = prepare_artifact(loaded, tokens=128)
    skewed = copy.deepcopy(loaded.model)
    skew_model_in_place(skewed, [artifact.skew_matrix(i) for i in range(3)])
    assert not torch.equal(
        skewed.model.decoder.layers[0].self_attn.q_proj.weight,
        loaded.model.model.decoder.layers[0].self_attn.q_proj.weight,
    )
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(skewed(ids).logits, loaded.model(ids).logits, atol=1e-9, rtol=1e-9)


def test_a_skew_that_carries_less_score_energy_than_none_is_not_shipped():
    """Q's principal direction (e0 + e1) is not where its scores with the keys live (e0 alone): the
    SVD skew would keep less score energy than the plain channels, so the head ships the identity."""
    generator = torch.Generator().manual_seed(0)
    tokens, head_dim = 512, 4
    along, across = torch.tensor([1.0, 1.0, 0, 0]) / 2**0.5, torch.tensor([1.0, -1.0, 0, 0]) / 2**0.5
    queries = (
        10 * torch.randn(tokens, 1, generator=generator) * along
        + 5 * torch.randn(tokens, 1, generator=generator) * across
    )
    keys = 3 * torch.randn(tokens, 1, generator=generator) * torch.tensor([1.0, 0, 0, 0])
    svd_only = skew_head(queries, keys, 1, skew="svd", channel_rule="top")
    assert svd_only.unskewed and torch.equal(svd_only.skew_matrix, torch.eye(head_dim))
    assert svd_only.channels.tolist() == [0] and svd_only.energy_after == svd_only.energy_before > 0.99
    skewed = right_singular_vectors(queries.double())  # what the SVD alone would have kept
    assert (
        score_energy(queries.double() @ skewed, keys.double() @ skewed, torch.tensor([0]))
        < 0.9
        < svd_only.energy_before
    )
