"""Shared fixtures: a tiny offline tokenizer, tiny random models of every supported family, SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from infinigen.models import LoadedModel, ModelSource, load_model
from infinigen.prepare.calibration import bundled_text

ARCHITECTURES = ("opt", "llama", "mistral", "qwen2", "qwen3", "gemma3")
# tiny Gemma 3: sliding-window layers (window 8) interleaved with full-attention layers 1, 3 and 5; at the
# default dense_layers=2 layer 1 keeps its KV on the device, 3 and 5 are offloaded (each selected from a
# sliding layer's input)
GEMMA3_LAYERS = ("sliding_attention", "full_attention") * 3
GEMMA3_WINDOW = 8
ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
VOCAB = 512


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each test that takes it runs on CPU and, where present, on CUDA with the same assertions."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the bundled calibration text: no Hub access needed."""
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<pad>", "<s>"])
    backend.train_from_iterator([bundled_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>")


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **settings):
    """A 3-layer random model of ``arch``; GQA (4 query heads, 2 KV heads unless ``num_key_value_heads``
    says otherwise) for the RoPE families; Gemma 3 with 6 layers (``GEMMA3_LAYERS``), one KV head of 32
    dims and logits scaled by 1/8, not 32**-0.5.
    ``settings``: more config arguments (``attn_implementation="eager"``, ...)."""
    torch.manual_seed(seed)
    rope = dict(intermediate_size=128, num_key_value_heads=settings.pop("num_key_value_heads", 2))
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=1,
        **settings,
    )
    if arch == "opt":
        model = OPTForCausalLM(OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64, enable_bias=True))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **rope))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, **rope, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, **rope))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, **rope, head_dim=16))
    elif arch == "gemma3":
        gemma = dict(common, num_hidden_layers=len(GEMMA3_LAYERS), intermediate_size=128, num_key_value_heads=1)
        config = Gemma3TextConfig(
            **gemma,
            head_dim=32,
            query_pre_attn_scalar=64,
            sliding_window=GEMMA3_WINDOW,
            layer_types=list(GEMMA3_LAYERS),
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


@pytest.fixture
def tiny(tokenizer):
    def make(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
        return LoadedModel(
            tiny_model(arch, seed=seed, dtype=dtype), tokenizer, ModelSource(f"tiny-{arch}", None, "local")
        )

    return make


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct, GGUF), loaded once per session in float32."""
    return load_model(None, device="cpu")


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2):
    from infinigen.prepare import prepare_artifact

    return prepare_artifact(smollm2, tokens=1024)


@pytest.fixture(scope="module")
def tiny_engine(tokenizer):
    """A server engine over a tiny random llama and its artifact, the default settings."""
    from helpers import tiny_setup

    from infinigen.serve.engine import Engine

    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    return Engine(model, tokenizer, artifact, {}, "tiny")


@pytest.fixture(scope="module")
def solo_engine(tiny_engine):
    """The same model, artifact and settings, a request at a time: what a request gets alone in the server."""
    from infinigen.serve.engine import Engine

    return Engine(tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact, {}, "tiny", max_batch=1)


def run_in_interpreter(script: str, **env: str) -> None:
    """Run ``script`` under Triton's CPU interpreter (TRITON_INTERPRET=1; tests/ and the repository
    importable, ``env`` added) and check that it printed ``ok``: how CI, without a GPU, runs the
    same checks the CUDA tests run on the compiled kernels. Each kernel it launches is compiled for
    sm_90 too (``compile_check``)."""
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    variables = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **env)
    script = "import compile_check\n" + script
    result = subprocess.run([sys.executable, "-c", script], env=variables, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def invoke(*args: str):
    """The command line, through typer's test runner (exceptions not caught: a traceback fails the test)."""
    from typer.testing import CliRunner

    from infinigen.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def checkpoint(tmp_path, tokenizer):
    def save(arch: str):
        folder = tmp_path / f"tiny-{arch}"
        tiny_model(arch).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return save


@pytest.fixture
def prepared(checkpoint, tmp_path):
    """A tiny checkpoint folder and its artifact."""

    def make(arch: str):
        folder, out = checkpoint(arch), tmp_path / f"skewed-{arch}"
        assert invoke("prepare", str(folder), "--out", str(out), "--tokens", "64", "--device", "cpu").exit_code == 0
        return folder, out

    return make
