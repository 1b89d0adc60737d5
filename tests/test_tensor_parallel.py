"""Tensor parallel on the CPU: two processes over gloo, the model sharded by transformers' own tensor
parallelism (``infinigen.models.load_model`` under a ``WORLD_SIZE`` of 2), every rank's cache holding
its own KV heads; the tokens must equal one process's. What transformers cannot shard (OPT) and what
no split can serve (KV heads that do not divide by the ranks) is refused in one line; the artifact's
slicing is checked on projections sharded by hand (``distribute_tensor``), OPT's included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT, tiny_model
from helpers import greedy, tiny_setup

from infinigen.architectures import decoder_layers, model_spec
from infinigen.errors import InfinigenError
from infinigen.runtime.kernels.top_slots import CountRule
from infinigen.runtime.selection.speculation import LayerSpeculator

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
RANKS = 2
NO_PLAN = "opt has no tensor-parallel plan in transformers: run it in one process (no torchrun)"
INDIVISIBLE = (
    "tensor parallel over 2 ranks needs the KV heads (1) to divide by 2: use a tensor-parallel size that divides 1"
)
NEW_TOKENS = 10
# every case at its exact setting and one that selects: budget 0.2 of ~60 cached tokens fetches 12;
# a finite alpha makes the count depend on every head (all-reduced across the ranks)
CASES = {
    "dense": dict(policy="dense"),
    "full": dict(policy="full"),
    "infinigen-1.0": dict(policy="infinigen", budget=1.0),
    "infinigen-0.2": dict(policy="infinigen", budget=0.2, allocation="uniform"),
    "infinigen-0.2-adaptive": dict(policy="infinigen", budget=0.2),
    "infinigen-0.2-alpha": dict(policy="infinigen", budget=0.2, alpha=2.0, allocation="uniform"),
    # the other policies read their layer's sizes the same way
    **{policy: dict(policy=policy, budget=0.2) for policy in ("quest", "oracle", "h2o", "int4")},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: str, worker, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # two ranks on a shared CPU
    torch.save(worker(rank, *args), os.path.join(out, f"{rank}.pt"))
    if dist.is_initialized():  # no rank leaves while the other is still in a collective
        dist.barrier()
    # gloo's teardown, at destroy_process_group or at exit, now and then aborts a rank ("terminate called
    # without an active exception", in CI about 1 run in 10) after its results are saved: end without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_ranks(tmp_path, worker, *args) -> list:
    """``worker(rank, *args)`` in RANKS processes (torchrun's environment, gloo); their results. The
    processes see no GPU: transformers would shard over the accelerator it finds (NCCL, a GPU a rank)."""
    with mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES=""):
        mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), worker, args), nprocs=RANKS, join=True)
    return [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in range(RANKS)]


def _prompt(tokenizer) -> dict[str, torch.Tensor]:
    from infinigen.prepare.calibration import bundled_text

    ids = tokenizer(bundled_text(), return_tensors="pt")["input_ids"][:, :60]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _tokens(model, prompt: dict[str, torch.Tensor], artifact) -> dict[str, list]:
    from infinigen.runtime import cache_for

    tokens = {}
    for name, settings in CASES.items():
        with cache_for(model, artifact, **settings) as cache:
            tokens[name] = greedy(model, prompt, cache, NEW_TOKENS).tolist()
    return tokens


def _sharded_generation(rank: int, folder: str, artifact_folder: str, prompt: dict, samples: list) -> dict:
    from infinigen.artifacts import open_artifact
    from infinigen.models import load_model
    from infinigen.prepare import prepare_artifact
    from infinigen.runtime import cache_for

    loaded = load_model(folder, device="cpu")  # sharded: WORLD_SIZE is 2
    artifact = open_artifact(artifact_folder, loaded.model)  # fingerprints the whole weights
    prepared = prepare_artifact(loaded, samples=samples).tensors  # every rank gathers every head
    with cache_for(loaded.model, artifact, policy="infinigen", budget=0.2) as cache:
        greedy(loaded.model, prompt, cache, 2)
        layer = cache.offloaded[0]
        shapes = {"pool": layer.pool.shape, "valid": tuple(layer.valid.shape)}
        projections = {name: buffer.clone() for name, buffer in layer.speculator.named_buffers()}
    tokens = _tokens(loaded.model, prompt, artifact)
    return {"tokens": tokens, "shapes": shapes, "buffers": projections, "prepared": prepared}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_tokens_equal_one_process(arch, tmp_path, tokenizer):
    """dense, full, infinigen at 1.0 and at 0.2 (uniform, adaptive, a finite alpha): the tokens of two
    ranks under transformers' tensor parallelism equal one process's; each rank's pool and partial
    projections hold its KV heads (one of the tiny model's two), sliced from the one artifact; and
    prepare on the sharded model builds one process's artifact."""
    from infinigen.artifacts import save_artifact
    from infinigen.prepare.calibration import load_samples

    model, artifact = tiny_setup(tokenizer, arch, "cpu")
    folder, artifact_folder = tmp_path / "model", tmp_path / "artifact"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_artifact(artifact, artifact_folder, card="test")
    # the ids, not the text: a checkpoint folder's tokenizer loads as its architecture's class
    prompt = _prompt(tokenizer)
    want = _tokens(model, prompt, artifact)
    samples = load_samples(tokenizer, None, tokens=128)  # tiny_setup's calibration, as ids
    ranks = on_ranks(tmp_path, _sharded_generation, str(folder), str(artifact_folder), prompt, samples)

    from infinigen.runtime import cache_for

    with cache_for(model, artifact, policy="infinigen", budget=0.2) as cache:
        greedy(model, prompt, cache, 2)
        whole = dict(cache.offloaded[0].speculator.named_buffers())
    for rank, result in enumerate(ranks):
        assert result["tokens"] == want, rank
        assert result["shapes"]["pool"][1] == 1 and result["shapes"]["valid"][1] == 1  # its one KV head
        kv, queries = slice(rank, rank + 1), slice(2 * rank, 2 * rank + 2)  # 2 query heads per KV head
        assert torch.equal(result["buffers"]["key_projection"], whole["key_projection"][kv])
        assert torch.equal(result["buffers"]["query_projection"], whole["query_projection"][queries])
        prepared = result["prepared"]  # prepare under tensor parallelism: one process's artifact, up to rounding
        assert prepared.keys() == artifact.tensors.keys()
        for name, tensor in artifact.tensors.items():
            if name.endswith(".channels"):
                assert torch.equal(prepared[name], tensor), name
            else:
                torch.testing.assert_close(prepared[name], tensor, atol=1e-4, rtol=1e-4, msg=name)


def _shard_attention(attention: torch.nn.Module, mesh) -> None:
    """Split q/k projections by output features over ``mesh``, as transformers' colwise plan does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for projection in (attention.q_proj, attention.k_proj):
        weight = distribute_tensor(projection.weight.detach(), mesh, [Shard(0)])
        projection.weight = torch.nn.Parameter(weight, requires_grad=False)


def _sliced_speculators(rank: int, artifacts: dict) -> dict:
    """Per architecture, this rank's speculator buffers for layer 2, its projections sharded by hand;
    the one-KV-head model's refusal; CountRule's counts with and without the other rank's heads."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (RANKS,))
    result = {}
    for arch, artifact in artifacts.items():
        model = tiny_model(arch)
        attention = decoder_layers(model)[2].self_attn
        _shard_attention(attention, mesh)
        speculator = LayerSpeculator(model_spec(model.config), artifact, 2, attention, "cpu", torch.float32)
        result[arch] = {name: buffer.clone() for name, buffer in speculator.named_buffers()}
    one_head = tiny_model("llama", num_key_value_heads=1)
    _shard_attention(decoder_layers(one_head)[2].self_attn, mesh)
    try:
        LayerSpeculator(
            model_spec(one_head.config),
            artifacts["llama"],
            2,
            decoder_layers(one_head)[2].self_attn,
            "cpu",
            torch.float32,
        )
    except InfinigenError as exc:
        result["refusal"] = str(exc)
    scores = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))[:, 2 * rank : 2 * rank + 2]
    result["counts"] = CountRule(1.0, 1.5, 1, dist.group.WORLD).counts(scores)
    result["alone"] = CountRule(1.0, 1.5, 1).counts(scores)
    return result


def test_artifact_slices_per_rank_and_indivisible_heads_fail(tmp_path, tokenizer):
    """A rank's skew columns, channels and partial query projection (RoPE: per query head; OPT: the
    folded W_q rows) are the one-process ones at its heads, in k_proj's and q_proj's shard order;
    one KV head over two ranks fails in one line; a finite alpha's count is every head's."""
    artifacts = {arch: tiny_setup(tokenizer, arch, "cpu")[1] for arch in ("llama", "opt")}
    ranks = on_ranks(tmp_path, _sliced_speculators, artifacts)
    for arch, artifact in artifacts.items():
        model = tiny_model(arch)
        spec = model_spec(model.config)
        whole = dict(
            LayerSpeculator(spec, artifact, 2, decoder_layers(model)[2].self_attn, "cpu", torch.float32).named_buffers()
        )
        kv_per_rank, queries_per_rank = spec.n_kv_heads // RANKS, spec.n_heads // RANKS
        for rank, result in enumerate(ranks):
            kv = slice(rank * kv_per_rank, (rank + 1) * kv_per_rank)
            queries = slice(rank * queries_per_rank, (rank + 1) * queries_per_rank)
            mine = result[arch]
            assert torch.equal(mine["key_projection"], whole["key_projection"][kv]), (arch, rank)
            for name in ("query_projection", "query_weight", "query_bias"):  # RoPE: the first; OPT: the others
                if name in whole:
                    assert torch.equal(mine[name], whole[name][queries]), (arch, rank, name)
    scores = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    together = CountRule(1.0, 1.5, 1).counts(scores)
    for result in ranks:
        assert result["refusal"] == INDIVISIBLE
        assert torch.equal(result["counts"], together)
    assert any(not torch.equal(result["alone"], together) for result in ranks), "the test must tell the two apart"


def test_each_rank_computes_on_its_own_gpu(monkeypatch):
    """Under torchrun a rank's CUDA device is cuda:LOCAL_RANK, made current before anything touches
    CUDA, whatever index was asked for (transformers shards the model there regardless); one process
    and the CPU keep the device given."""
    from infinigen import models
    from infinigen.tensor_parallel import local_device

    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert local_device("cuda:1") == "cuda:1" and current == []  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device("cpu") == "cpu" and current == []
    assert [local_device("cuda"), local_device("cuda:0"), models.resolve_device(None)] == ["cuda:1"] * 3
    assert current == [1, 1, 1]


@pytest.mark.parametrize(
    ("arch", "settings", "message"),
    [
        ("opt", {}, NO_PLAN),
        (
            "llama",
            {"num_key_value_heads": 1},
            INDIVISIBLE,
        ),
    ],
)
def test_unshardable_models_fail_before_loading(arch, settings, message, tmp_path, monkeypatch):
    """Under a WORLD_SIZE of 2, what cannot be sharded fails in one line from its config alone: no
    weight loads, no process group starts."""
    from infinigen.models import load_model

    folder = tmp_path / arch
    tiny_model(arch, **settings).config.save_pretrained(folder)  # a config without weights: nothing else is read
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InfinigenError) as error:
        load_model(str(folder), device="cpu")
    assert str(error.value) == message
    assert not dist.is_initialized()


def test_under_torchrun_rank_0_prints_and_every_rank_fails_in_one_line(tmp_path):
    """``torchrun -m infinigen generate`` on a model it cannot shard, as ranks 0 and 1 see it: rank 0
    alone prints its notes, each rank its own one-line error, exit code 2."""
    folder = tmp_path / "opt"
    tiny_model("opt").config.save_pretrained(folder)
    command = [sys.executable, "-m", "infinigen", "generate", str(folder), "--prompt", "hi", "--policy", "full"]
    notes = {0: ["no CUDA device: running on the CPU (slowly)"], 1: []}
    for rank in range(RANKS):
        env = dict(os.environ, WORLD_SIZE=str(RANKS), RANK=str(rank), CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr.splitlines() == [*notes[rank], f"error: rank {rank}: {NO_PLAN}"]
