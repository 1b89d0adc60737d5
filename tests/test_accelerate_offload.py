"""The ``hf-accelerate`` baseline: accelerate's offloading applied to a built model and undone."""

from __future__ import annotations

import accelerate.utils
import pytest
import torch
from conftest import tiny_model
from helpers import greedy, padded_batch

from infinigen.architectures import decoder_layers
from infinigen.bench.accelerate_offload import accelerate_offloaded
from infinigen.errors import InfinigenError
from infinigen.runtime.weights import StreamedWeights, streamed_weights

PROMPTS = [[5, 9, 23, 7, 81, 4], [6, 17, 3, 99]]


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_offloaded_modules_decode_as_resident_ones_and_the_model_is_left_as_found(arch, device, monkeypatch):
    """The layers accelerate maps to the host run from there through its hooks (their parameters on the meta
    device between forwards): the same tokens as the resident model; afterwards every parameter is the same
    object on the same device with the same values, no hook is left, and layers the model streamed stream
    again."""
    model = tiny_model(arch).to(device)
    inputs = padded_batch(PROMPTS, 1, device)
    resident = greedy(model, inputs)
    blocks = decoder_layers(model)
    real = accelerate.utils.infer_auto_device_map
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # accelerate's own map for a GPU taking 80% of the weights (on the CPU, device 0 stands for the device)
    monkeypatch.setattr(
        "accelerate.utils.infer_auto_device_map",
        lambda model, max_memory, **k: real(model, max_memory={0: int(0.8 * total), "cpu": 10**9}, **k),
    )
    StreamedWeights(model, [2], device, ahead=0)
    names = {module: name for name, module in model.named_modules()}
    layers = [names[block] for block in blocks]
    before = {name: (p, p.device, p.detach().clone()) for name, p in model.named_parameters()}
    with torch.no_grad(), accelerate_offloaded(model, torch.device(device), gpu_bytes=1) as placed:
        assert streamed_weights(model) is None
        assert [name for name, where in placed.items() if where == "gpu" and "layers" in name] == [layers[0]]
        assert placed[layers[1]] == placed[layers[2]] == "cpu"
        assert all(p.device.type == "meta" for p in blocks[1].parameters())  # until its forward
        assert torch.equal(greedy(model, inputs), resident)
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    again = streamed_weights(model)
    assert again is not None and again.order == [2] and again.ahead == 0
    for name, param in model.named_parameters():
        original, home, values = before[name]
        assert param is original and param.device == home and torch.equal(param, values), name
    assert torch.equal(greedy(model, inputs), resident)
    again.close()


def test_no_room_for_the_first_module_is_an_error_not_a_run_on_the_cpu(device, monkeypatch):
    """Where accelerate's device map puts every module on the host it would run the model there (no
    offloading at all): one clear error, and the model as it was found."""
    model = tiny_model("opt").to(device)
    before = {name: (p, p.device) for name, p in model.named_parameters()}
    monkeypatch.setattr("accelerate.utils.infer_auto_device_map", lambda model, max_memory, **k: {"": "cpu"})
    with pytest.raises(InfinigenError, match="places no module"), accelerate_offloaded(model, torch.device(device), 1):
        pass
    assert all(p is before[name][0] and p.device == before[name][1] for name, p in model.named_parameters())


def test_an_auto_size_runs_accelerate_at_the_largest_batch_its_cache_leaves_weights_room_for():
    """``--sizes autoxN``: accelerate's baselines run at the largest batch whose cache leaves weights room
    within the budget (their step is the weights' copy: more rows, more tokens/s), others as planned; a
    budget no row fits keeps the plan's batch (the row says it does not fit)."""
    from infinigen.bench.auto_batch import baselines_at_their_batch
    from infinigen.bench.hf_memory import accelerate_batch, accelerate_weight_room
    from infinigen.bench.runs import BenchCase
    from infinigen.bench.shapes import shape_config
    from infinigen.runtime.memory import plan as memory

    config, budget = shape_config("opt-30b"), int(16e9)
    model, work = memory.Model(config, 0), memory.Workload(1, 512, 7, 512)
    best = accelerate_batch(model, torch.float16, work, "hf-dynamic", budget)
    room = [
        accelerate_weight_room(model, torch.float16, memory.Workload(b, 512, 7, 512), "hf-dynamic", budget)
        for b in (best, best + 1)
    ]
    # accelerate's own map decides: at the best batch's room it places a module on the GPU, one row more
    # and it maps the whole model to the host (it keeps room for its largest layer beside the embeddings)
    assert best > 1 and [_places_a_module_on_the_gpu(config, r) for r in room] == [True, False]
    offloaded = accelerate_batch(model, torch.float16, work, "hf-offloaded", budget)
    assert offloaded > best  # two layers' KV on the GPU, not every layer's
    assert accelerate_batch(model, torch.float16, work, "hf-dynamic", int(5e8)) is None
    cases = [
        BenchCase(policy, 88, 512, gen_len=4, prefill_chunk=512)
        for policy in ("infinigen", "hf-accelerate", "hf-dynamic")
    ]
    cases.append(BenchCase("hf-accelerate", 8, 512, gen_len=4, prefill_chunk=512))  # not an auto size
    planned = [{"batch": 88, "context": 512}]
    ran = baselines_at_their_batch(list(cases), planned, config, "float16", "cpu", budget)
    assert [case.batch for case in ran] == [88, best, 88, 8]
    assert [c.batch for c in baselines_at_their_batch(list(cases), planned, config, "float16", "cpu", int(5e8))] == [
        88,
        88,
        88,
        8,
    ]


def _places_a_module_on_the_gpu(config, room: int) -> bool:
    from accelerate.utils import infer_auto_device_map
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    limits = {0: max(room, 0), "cpu": 10**13}
    found = infer_auto_device_map(model, max_memory=limits, no_split_module_classes=model._no_split_modules)
    return 0 in found.values()


def test_the_last_pools_host_blocks_go_before_accelerate_copies_weights_to_the_host(monkeypatch):
    """A case of ours leaves its pool's host blocks retired for the next pool; an accelerate baseline after it
    must not copy weights to the host beside them (OPT-30B at 56 x 1,920: 79 GB of them overran a 128 GB host)."""
    import infinigen.bench.runs as runs
    from infinigen.runtime.memory import host_memory

    model = tiny_model("opt")
    runs.run_case(model, None, runs.BenchCase("full", 2, 32, gen_len=2, warmup=0))
    assert host_memory.retired_bytes() > 0  # the pool's blocks, kept for a next pool
    real, retired_at_entry = runs.accelerate_offloaded, []

    def recorded(*args):
        retired_at_entry.append(host_memory.retired_bytes())
        return real(*args)

    monkeypatch.setattr(runs, "accelerate_offloaded", recorded)
    row = runs.run_case(model, None, runs.BenchCase("hf-accelerate", 2, 32, gen_len=2, warmup=0))
    assert retired_at_entry == [0] and row["ms_per_step"] > 0
