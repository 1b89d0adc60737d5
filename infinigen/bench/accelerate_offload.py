"""The baseline ``hf-accelerate``: transformers with accelerate's big-model inference, as its users run a model
larger than their GPU today (``from_pretrained(..., device_map="auto", max_memory=...)``). accelerate maps as
many modules to the GPU as ``max_memory`` allows (``infer_auto_device_map``) and keeps the others' weights in
host memory, copied to the GPU at each of their forwards and dropped after (its ``AlignDevicesHook``s); the
KV in transformers' ``DynamicCache``.

``accelerate_offloaded`` applies that to a model already built (``bench``'s random shapes: no checkpoint to
load from) and undoes it: the model's own parameters back where they were, and its streamed layers
(``runtime.weights``) streaming again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from infinigen.errors import InfinigenError
from infinigen.runtime.weights import StreamedWeights, streamed_weights


@contextmanager
def accelerate_offloaded(model: nn.Module, device: torch.device, gpu_bytes: int) -> Iterator[dict[str, str]]:
    """``model`` under accelerate's offloading with at most ``gpu_bytes`` of weights on ``device``; yields
    accelerate's device map (module name -> "gpu" or "cpu")."""
    from accelerate.hooks import attach_align_device_hook_on_blocks, remove_hook_from_submodules
    from accelerate.utils import OffloadedWeightsLoader, infer_auto_device_map

    device = torch.device(device)
    ours = streamed_weights(model)
    streaming = (ours.order, ours.ahead) if ours is not None else None
    if ours is not None:
        ours.close()
    # each parameter's device, and its data where that is host memory (kept: a streamed layer's pinned copy);
    # a GPU original mapped to the host is not kept: its GPU memory is accelerate's to use
    owned, homes = [], {}
    host_weights: dict[str, torch.Tensor] = {}
    try:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        if gpu_bytes >= total:  # every weight fits: nothing to offload
            found = {"": "device"}
        else:  # the device's index (the CPU's 0: the tests' stand-in for a GPU)
            limits = {device.index or 0: gpu_bytes, "cpu": total}
            found = infer_auto_device_map(model, max_memory=limits, no_split_module_classes=model._no_split_modules)
            if set(found.values()) == {"cpu"}:  # accelerate would run the model on the CPU, not offload it
                raise InfinigenError(
                    f"accelerate places no module in {gpu_bytes / 1e9:.2f} GB: every layer would run on the CPU"
                )
        device_map = {name: "cpu" if where == "cpu" else "gpu" for name, where in found.items()}
        longest_first = sorted(device_map.items(), key=lambda item: -len(item[0]))
        for name, module in model.named_modules(remove_duplicate=False):
            mapped = next((where for prefix, where in longest_first if _within(name, prefix)), "gpu")
            for leaf, param in module._parameters.items():
                if param is None:
                    continue
                owned.append((module, leaf, param))
                if id(param) not in homes:  # a tied weight moves once
                    homes[id(param)] = (param, param.device, param.data if param.device.type == "cpu" else None)
                    # to the GPU a copy where it lives in host memory; to the host a copy in plain memory, as
                    # from_pretrained loads it: a streamed layer's pinned one crossed 6x faster (0.77 s a step
                    # against 2.66 s, OPT-30B on an H200), a baseline users do not have
                    if mapped == "gpu":
                        param.data = param.data.to(device)
                    elif param.data.device.type == "cpu" and param.data.is_pinned():
                        param.data = torch.empty_like(param.data, device="cpu").copy_(param.data)
                    else:
                        param.data = param.data.to("cpu")
                if mapped == "cpu":
                    host_weights[f"{name}.{leaf}".lstrip(".")] = param.data
        attach_align_device_hook_on_blocks(
            model,
            execution_device={name: device for name in device_map},
            offload={name: where == "cpu" for name, where in device_map.items()},
            weights_map=OffloadedWeightsLoader(host_weights),
        )
        yield device_map
    finally:
        remove_hook_from_submodules(model)
        host_weights.clear()
        for module, leaf, param in owned:
            module._parameters[leaf] = param
        for param, _, kept in homes.values():  # host originals first: their GPU copies go
            if kept is not None:
                param.data = kept
        for param, home, kept in homes.values():
            if kept is None:
                param.data = param.data.to(home)
        # streaming again copies each layer into a new pinned block: an old block must go with its layer, not
        # wait for this frame (OPT-30B's 60 GB of streamed layers held twice outgrew a 128 GB host)
        owned.clear()
        homes.clear()
        if streaming is not None:
            StreamedWeights(model, streaming[0], device, streaming[1])


def _within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")
