"""Random-weight models of known shapes, built directly on the device (under torchrun, each rank's shard
on its own), and artifacts calibrated for them."""

from __future__ import annotations

import logging
import re
import tempfile

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from infinigen.errors import InfinigenError
from infinigen.runtime.config import RuntimeConfig
from infinigen.tensor_parallel import loading_arguments, world_size

SHAPES: dict[str, dict] = {
    "opt-6.7b": dict(
        model_type="opt",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        ffn_dim=16384,
        word_embed_proj_dim=4096,
        vocab_size=50272,
        max_position_embeddings=2048,
    ),
    "opt-13b": dict(
        model_type="opt",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        ffn_dim=20480,
        word_embed_proj_dim=5120,
        vocab_size=50272,
        max_position_embeddings=2048,
    ),
    "opt-30b": dict(
        model_type="opt",
        hidden_size=7168,
        num_hidden_layers=48,
        num_attention_heads=56,
        ffn_dim=28672,
        word_embed_proj_dim=7168,
        vocab_size=50272,
        max_position_embeddings=2048,
    ),
    "llama-2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    # the shapes that need several GPUs (bf16 weights of ~140 GB): run them under torchrun, where each
    # rank materialises only its shard (``random_model``)
    "llama-3-70b": dict(
        model_type="llama",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    # 32K positions natively, 128K with the YaRN scaling Qwen documents: the 128K runs need the positions
    "qwen2.5-72b": dict(
        model_type="qwen2",
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=29568,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
    ),
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}


def rank_share(shape: dict, ranks: int) -> dict:
    """One rank's share of ``shape`` at tensor-parallel size ``ranks`` (heads, KV heads and MLP / ranks;
    embeddings whole), for one GPU: a rank's decode step against one GPU's on the same per-rank shape."""
    return shape | dict(
        num_attention_heads=shape["num_attention_heads"] // ranks,
        num_key_value_heads=shape["num_key_value_heads"] // ranks,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        intermediate_size=shape["intermediate_size"] // ranks,
    )


SHAPES.update({f"llama-3-70b-tp{n}-rank": rank_share(SHAPES["llama-3-70b"], n) for n in (2, 4)})


def shape_config(shape: str, layers: int | None = None, positions: int | None = None):
    """The config of ``shape``; ``layers``: this many decoder layers, each of the shape's size, instead of
    the shape's count; ``positions``: at least this many positions (a random shape's are only a number)."""
    if shape not in SHAPES:
        raise InfinigenError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[shape])
    if layers is not None:
        if layers < 2:  # speculation reads the layer before an offloaded one
            raise InfinigenError(f"--layers must be at least 2, got {layers}")
        fields["num_hidden_layers"] = layers
    if positions is not None and fields["model_type"] != "opt":  # OPT learns its positions: a fixed table
        fields["max_position_embeddings"] = max(positions, fields["max_position_embeddings"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_model(
    shape: str, device: str, dtype: torch.dtype, layers: int | None = None, streamed: RuntimeConfig | None = None
) -> PreTrainedModel:
    """Random weights of ``shape`` on ``device``; under torchrun sharded over the ranks (their devices).
    ``layers``: this many decoder layers, each of the shape's size, instead of the shape's count (a
    70B shape's prefill at 128K tokens takes minutes; a decode step and its memory grow by layer).
    ``streamed``: settings whose ``streamed_layers`` stay in host memory, streamed from then on."""
    config = shape_config(shape, layers)
    if world_size() > 1:
        return _sharded_random_model(config, dtype)
    if streamed is not None and streamed.streamed_layers:
        return _streamed_random_model(config, device, dtype, streamed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _streamed_random_model(config, device: str, dtype: torch.dtype, settings: RuntimeConfig) -> PreTrainedModel:
    """Random weights where the plan keeps them: the decoder layers ``settings`` streams in host memory
    (``streamed_layer_indices``), streamed from then on, the rest on ``device``. Built on the meta device and made
    in place, so the whole model never exists in one place (a 70B shape exceeds the host memory too); its
    buffers (rotary tables) from a one-layer copy built as usual."""
    from infinigen.architectures import decoder_layers
    from infinigen.runtime.memory.sizing import streamed_layer_indices
    from infinigen.runtime.weights import weights_for_run

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    small = AutoModelForCausalLM.from_config(_one_layer(config), dtype=dtype)
    blocks = decoder_layers(model)
    on_host = {id(p) for i in streamed_layer_indices(settings, len(blocks)) for p in blocks[i].parameters()}
    made: dict[int, nn.Parameter] = {}  # tied weights made once
    std = getattr(config, "initializer_range", 0.02)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        if id(param) not in made:
            host = id(param) in on_host
            made[id(param)] = _random_parameter(param.shape, name, dtype, device, host, std)
        setattr(model.get_submodule(owner), leaf, made[id(param)])
    small_buffers = dict(small.named_buffers())
    for name, _ in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        source = small_buffers[_first_layer(name)]
        model.get_submodule(owner).register_buffer(leaf, source.to(device), persistent=False)
    weights_for_run(model, settings, torch.device(device))
    return model.eval()


def _random_parameter(shape, name: str, dtype, device: str, host: bool, std: float) -> nn.Parameter:
    """One parameter's random values, made on ``device`` (fast) and kept there or in host memory; the device
    copy of a host one is gone when this returns, before the next is made or the slots are. Host copies are
    plain memory: streaming moves each layer into a pinned block of its own and frees them (pinned by
    PyTorch's caching allocator they would stay cached, rounded up: a 70B shape's twice over the host's)."""
    random = torch.empty(shape, dtype=dtype, device=device)
    if random.dim() > 1:
        random.normal_(0.0, std)
    else:  # norms' weights 1, biases 0
        random.fill_(1.0 if "norm" in name else 0.0)
    if not host:
        return nn.Parameter(random, requires_grad=False)
    return nn.Parameter(random.cpu(), requires_grad=False)


def _one_layer(config):
    """``config`` with one decoder layer (its kind the first layer's)."""
    small = type(config).from_dict(config.to_dict())
    small.num_hidden_layers = 1
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:1]
    return small


def _first_layer(name: str) -> str:
    """A buffer's name in the one-layer copy: a decoder layer's as layer 0's."""
    return re.sub(r"\.layers\.\d+\.", ".layers.0.", name)


def _sharded_random_model(config, dtype: torch.dtype) -> PreTrainedModel:
    """Random weights sharded by transformers' tensor parallelism: its loader builds the model on the
    meta device, shards it over the ranks and initialises each rank's shard of every weight the
    checkpoint lacks, so the whole model never exists in one place. The checkpoint: the config and one
    small stub tensor (a folder without weights is no checkpoint), in a folder of each rank's own."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # the final norm's weight (the last vector), which transformers initialises to ones anyway
    stub, vector = [(name, param) for name, param in skeleton.named_parameters() if param.dim() == 1][-1]
    logging.getLogger("transformers").setLevel(logging.ERROR)  # not its table of the weights it initialised
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        save_file({stub: torch.ones(vector.shape)}, f"{folder}/model.safetensors", metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **loading_arguments(config, world_size()))
    return model.eval()


def random_artifact(model: PreTrainedModel, shape: str, ratio: float):
    """An artifact for a random-weight model, calibrated on random tokens."""
    from infinigen.models import LoadedModel, ModelSource
    from infinigen.prepare import prepare_artifact
    from infinigen.prepare.calibration import CalibrationSample

    calibration = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    return prepare_artifact(
        LoadedModel(model, None, ModelSource(shape, None, "random")),
        samples=[CalibrationSample("random tokens", "", calibration)],
        ratio=ratio,
    )
