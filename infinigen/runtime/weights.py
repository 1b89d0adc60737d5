"""Decoder layers whose weights live in host memory and reach the GPU one layer ahead of their use, as
the KV rows do: for models larger than the card (the issue on weights that do not fit).

``StreamedWeights(model, layers, device, ahead)`` keeps the named decoder layers' parameters in (pinned)
host memory and ``ahead + 2`` GPU slots, each as large as the largest of those layers. Before a streamed
layer runs (a forward pre-hook, ahead of any other) it and the ``ahead`` streamed layers after it are in
their slots, their parameters pointing there: ``ahead`` 1 serves a speculation that reads the next layer's
query projection during this one. The copy of the streamed layer after those, in cyclic order (the last
one's next is the first, for the next forward), is then queued on a side stream into the slot of the layer
before, once that layer's forward is done (an event its forward hook records); after its forward a
layer's parameters point at the host copy again. Where every streamed layer has a slot, each is copied
once. On the CPU the same path runs with plain copies: the tests' equality.

``close()`` (or leaving the ``with`` block) removes the hooks and puts every parameter back where it
was: the model as it was found. Replayed CUDA-graph steps are not used with streamed weights: a graph
would bake in one slot per layer without its copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from infinigen.architectures import decoder_layers
from infinigen.errors import InfinigenError
from infinigen.runtime.memory import host_memory
from infinigen.runtime.memory.sizing import slot_bytes, streamed_layer_indices, weights_ahead
from infinigen.runtime.streams import side_stream
from infinigen.tensor_parallel import quantised

STREAMED = "_infinigen_streamed_weights"  # the model attribute naming its StreamedWeights while attached


def layer_bytes(layer: nn.Module) -> int:
    """A decoder layer's parameters as a slot holds them."""
    return layer_bytes_of(layer.parameters())


def layer_bytes_of(tensors: Iterable[torch.Tensor]) -> int:
    return slot_bytes(t.numel() * t.element_size() for t in tensors)


def laid_out(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of (nbytes,) uint8 ``buffer`` with the shapes and dtypes of ``tensors``, at aligned offsets
    (``slot_bytes``): a slot's and a streamed layer's host block's layout."""
    views, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        views.append(buffer[offset : offset + nbytes].view(t.dtype).view(t.shape))
        offset += slot_bytes([nbytes])
    return views


class StreamedWeights:
    """The parameters of decoder ``layers`` of ``model`` streamed to ``device`` one layer ahead."""

    def __init__(self, model: nn.Module, layers: Iterable[int], device: torch.device | str, ahead: int = 0) -> None:
        blocks = decoder_layers(model)
        self.order = sorted(set(layers))
        if not self.order:
            raise InfinigenError("no decoder layer to stream: name at least one")
        if self.order[0] < 0 or self.order[-1] >= len(blocks):
            raise InfinigenError(f"decoder layers to stream must lie in 0..{len(blocks) - 1}, got {self.order}")
        if getattr(model, STREAMED, None) is not None:
            raise InfinigenError("this model's weights are already streamed: close the other StreamedWeights first")
        if ahead < 0:
            raise InfinigenError(f"ahead must be 0 or more, got {ahead}")
        if kind := next((type(p).__name__ for i in self.order for p in blocks[i].parameters() if quantised(p)), None):
            raise InfinigenError(
                f"quantised weights ({kind}) do not stream: give the GPU room for every layer, or load them unquantised"
            )
        self.model, self.device, self.ahead = model, torch.device(device), ahead
        self.cuda = self.device.type == "cuda"
        self.blocks = [blocks[i] for i in self.order]
        # each parameter and the device it was on (restored on close), and its host copy: pinned where
        # copies go to a GPU. A GPU original is freed (that is the point); a CPU one is replaced by its
        # pinned copy for good (the same values on the same device: no second host copy of a large model)
        self.params = [list(block.parameters()) for block in self.blocks]
        self.homes = [[p.device for p in params] for params in self.params]
        self.pinned: list[torch.Tensor] = []  # CUDA: each streamed layer's host block (``_host_copies``)
        self.hosts: list[list[torch.Tensor]] = []
        for params in self.params:  # layer by layer: an original is freed before the next layer's block is made
            self.hosts.append(self._host_copies(params))
            for param, host in zip(params, self.hosts[-1], strict=True):
                param.data = host
        size = max(layer_bytes(block) for block in self.blocks)
        count = min(ahead + 2, len(self.blocks))
        try:
            self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(count)]
        except torch.OutOfMemoryError:  # the model as it was found (its layers' GPU memory is free again)
            self.slots = []
            self._put_back()
            raise
        self.views: dict[tuple[int, int], list[torch.Tensor]] = {}  # (slot, streamed layer) -> its parameters
        self.stream = side_stream(self.device, "transfer") if self.cuda else None
        self.ready: list[torch.cuda.Event | None] = [None] * len(self.blocks)  # its copy into its slot done
        self.released: list[torch.cuda.Event | None] = [None] * count  # the slot's last forward done
        self.holder: list[int | None] = [None] * count  # the streamed layer each slot holds or is receiving
        self.slot_of: dict[int, int] = {}  # streamed layer -> its slot, while it has one
        self.cursor = 0  # the slot the next copy takes: the one taken longest ago
        self.handles = []
        for k, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._before(k), prepend=True))
            self.handles.append(block.register_forward_hook(self._after(k)))
        setattr(model, STREAMED, self)

    def _host_copies(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """A streamed layer's parameters in host memory: on CUDA in one pinned block of exactly the layer's
        bytes, laid out as in a slot (PyTorch's pinned allocator would round each parameter up to a power of
        two: OPT-30B's layers took 27% more host memory than the plan counted)."""
        if not self.cuda:
            return [p.data if p.device.type == "cpu" else p.data.to("cpu") for p in params]
        block = host_memory.pinned_block(layer_bytes_of(p.data for p in params), self.device)
        self.pinned.append(block)
        copies = laid_out(block, [p.data for p in params])
        for copy, param in zip(copies, params, strict=True):
            copy.copy_(param.data)
        return copies

    def _views(self, slot: int, k: int) -> list[torch.Tensor]:
        """Streamed layer ``k``'s parameters in ``slot``."""
        if (slot, k) not in self.views:
            self.views[slot, k] = laid_out(self.slots[slot], self.hosts[k])
        return self.views[slot, k]

    def _queue(self, k: int) -> None:
        """Have streamed layer ``k``'s parameters copied into the slot taken longest ago, after that slot's
        last forward; nothing where a slot holds them already."""
        if k in self.slot_of:
            return
        slot, self.cursor = self.cursor, (self.cursor + 1) % len(self.slots)
        if self.holder[slot] is not None:
            del self.slot_of[self.holder[slot]]
        self.holder[slot], self.slot_of[k] = k, slot
        views = self._views(slot, k)
        if self.stream is None:
            for view, host in zip(views, self.hosts[k], strict=True):
                view.copy_(host)
            return
        if self.released[slot] is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(self.released[slot])
        with torch.cuda.stream(self.stream):
            for view, host in zip(views, self.hosts[k], strict=True):
                view.copy_(host, non_blocking=True)
            self.ready[k] = self.stream.record_event()

    def _in_place(self, k: int) -> None:
        """Streamed layer ``k``'s parameters pointing at its slot, once its copy is done."""
        self._queue(k)
        if self.ready[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[k])
        for param, view in zip(self.params[k], self._views(self.slot_of[k], k), strict=True):
            param.data = view

    def _before(self, k: int):
        n = len(self.blocks)

        def hook(block: nn.Module, args) -> None:
            for m in range(k, k + min(self.ahead + 1, n)):
                self._in_place(m % n)
            self._queue((k + self.ahead + 1) % n)  # into the slot of the layer before: its forward is done

        return hook

    def _after(self, k: int):
        def hook(block: nn.Module, args, output) -> None:
            if self.cuda:
                self.released[self.slot_of[k]] = torch.cuda.current_stream(self.device).record_event()
            for param, host in zip(self.params[k], self.hosts[k], strict=True):
                param.data = host  # its slot is another layer's soon: a late reader reads the host copy

        return hook

    def close(self) -> None:
        """Remove the hooks and put every parameter back where it was found."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._put_back()
        self.slots, self.views, self.hosts = [], {}, []
        if getattr(self.model, STREAMED, None) is self:
            delattr(self.model, STREAMED)

    def _put_back(self) -> None:
        for params, homes, hosts in zip(self.params, self.homes, self.hosts, strict=True):
            for param, home, host in zip(params, homes, hosts, strict=True):
                param.data = host if home.type == "cpu" else host.to(home)
        for block in self.pinned:  # a parameter kept in host memory keeps its block's pages (unregistered)
            host_memory.release(block)
        self.pinned = []

    def __enter__(self) -> StreamedWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def streamed_weights(model: nn.Module) -> StreamedWeights | None:
    """The model's attached ``StreamedWeights``, if any."""
    return getattr(model, STREAMED, None)


def weights_for_run(model: nn.Module, config, device: torch.device, ranks: int = 1) -> StreamedWeights | None:
    """``config.streamed_layers`` decoder layers (``streamed_layer_indices``) streamed for one run (a cache's
    lifetime), or None where none are to stream or the caller streams the model's weights already (the
    command line does, once a process)."""
    streamed = streamed_layer_indices(config, len(decoder_layers(model)))
    ahead, theirs = weights_ahead(config.policy), streamed_weights(model)
    if theirs is not None and theirs.ahead < ahead:  # the next layer's weights would still be in host memory
        raise InfinigenError(
            f"policy {config.policy!r} reads the next decoder layer's weights during each layer: the model's weights "
            f"must stream at least {ahead} layer ahead (StreamedWeights(..., ahead={ahead})), not {theirs.ahead}"
        )
    if not streamed or theirs is not None:
        return None
    if ranks > 1:
        raise InfinigenError("streamed weights run in one process: not under tensor parallelism")
    return StreamedWeights(model, streamed, device, ahead)


def place_weights(model: nn.Module, device: torch.device | str, config) -> StreamedWeights | None:
    """A model loaded in host memory, onto ``device``: every parameter and buffer but those of the layers
    ``config`` streams, which stream from here on (for the process: the model keeps them streamed). The
    whole model never needs to fit on the device."""
    device = torch.device(device)
    layers = decoder_layers(model)
    streamed = streamed_layer_indices(config, len(layers))
    kept = {id(p) for i in streamed for p in layers[i].parameters()}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in kept:
                param.data = param.data.to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return weights_for_run(model, config, device)
