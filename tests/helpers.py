"""Plain helpers shared by the runtime's tests (fixtures live in conftest.py)."""

from __future__ import annotations

import torch
from conftest import tiny_model
from transformers import AutoConfig

from infinigen.models import LoadedModel, ModelSource
from infinigen.prepare import prepare_artifact
from infinigen.runtime import cache_argument

EXACT = dict(budget=1.0, kv_bits=16)  # no other setting: budget 1.0 with 16-bit rows is dense decoding


def padded_batch(prompts: list[list[int]], pad: int, device) -> dict[str, torch.Tensor]:
    """Left-padded input_ids and attention_mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return {"input_ids": ids, "attention_mask": mask}


def greedy(model, inputs, cache=None, new_tokens: int = 12) -> torch.Tensor:
    kwargs = {cache_argument(model): cache} if cache is not None else {}
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=1, **kwargs)
    return out[:, inputs["input_ids"].shape[1] :]


def tiny_setup(tokenizer, arch: str, device: str):
    model = tiny_model(arch).to(device)
    artifact = prepare_artifact(LoadedModel(model, tokenizer, ModelSource(arch, None, "local")), tokens=128)
    return model, artifact


EXACT_POLICIES = ["full", "infinigen", "quest", "oracle"]  # lossless at budget 1 (h2o keeps a prompt-sized cache)


def teacher_forced_logits(model, ids: torch.Tensor, prefix: int, cache) -> torch.Tensor:
    """Prefill ids[:, :prefix], then feed the true tokens one by one; next-token logits at each step."""
    name = cache_argument(model)
    with torch.no_grad():
        logits = [model(ids[:, :prefix], **{name: cache}).logits[:, -1]]
        for t in range(prefix, ids.shape[1] - 1):
            logits.append(model(ids[:, t : t + 1], **{name: cache}).logits[:, -1])
    return torch.stack(logits, dim=1)


def teacher_forced_argmax(model, ids: torch.Tensor, prefix: int, cache) -> torch.Tensor:
    return teacher_forced_logits(model, ids, prefix, cache).argmax(-1)


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, positions: int = 4096):
    return AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=positions,
    )
