"""How caches connect to a model: forward hooks, installed while some ``InfinigenCache`` of the
model lives (``attach``), removed with the last one.

- On the decoder stack (the module that builds the attention masks and runs the blocks): a forward
  given one of the model's live caches is first checked against the cache's memory plan (``planning``),
  then runs with the ``ATTENTION`` implementation, masks included; every other forward keeps the
  model's own (eager, SDPA, flash: whatever it was loaded with).
- On each decoder block: bind the running cache to the block's attention (unbound after the block,
  also when it raised), and during decode start the selection and prefetch of the next layer
  (``_step_hook``, ``_after_attention_hook``).
- On the stack's rotary embedding: keep each rotary (cos, sin) it computes for the running cache, by
  layer type (``_rope_hook``): a selection one layer ahead needs its target layer's before that layer
  runs, and Gemma 3's local and global layers have different ones.

Nothing else is left on the model: the implementation is switched for the forward only, and the
hooks go when the last cache is closed or collected.
"""

from __future__ import annotations

import bisect
import functools
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedConfig, PreTrainedModel

from infinigen.architectures import Norm, attention_norm, decoder_layers, decoder_stack, mlp_norm, one_kernel_norm
from infinigen.runtime.cache.attention import ATTENTION, bind, bound_cache, unbind
from infinigen.runtime.cache.layers import OffloadedLayer
from infinigen.runtime.cache.planning import check_forward

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()


def attach(model: PreTrainedModel, cache) -> Callable[[], None]:
    """Connect ``cache`` to ``model`` (its hooks are installed with the model's first live cache);
    returns the release that the cache calls once, when it is closed or collected."""
    attachment = _ATTACHED.get(model)
    if attachment is None:
        attachment = _ATTACHED[model] = Attachment(model)
    attachment.caches.add(cache)
    attachment.users += 1
    return functools.partial(_release, weakref.ref(model), attachment)


def _release(model: weakref.ref, attachment: Attachment) -> None:
    attachment.users -= 1
    if attachment.users > 0:
        return
    try:
        attachment.remove()
    finally:
        owner = model()
        if owner is not None and _ATTACHED.get(owner) is attachment:
            del _ATTACHED[owner]


class Attachment:
    """The hooks on one model, shared by its live caches. It keeps no reference to the model (the
    registry of attachments holds models weakly) nor to a cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.caches: weakref.WeakSet = weakref.WeakSet()  # the model's live caches
        self.users = 0
        self.handles: list[RemovableHandle] = []
        self.configs = _attention_configs(model)
        self.running = None  # the cache of the running forward, if one of ours
        self.own: list[str | None] = []  # during such a forward: each config's own implementation
        try:
            self._install(model)
        except BaseException:
            self.remove()
            raise

    def _install(self, model: PreTrainedModel) -> None:
        stack = decoder_stack(model)
        self.handles.append(stack.register_forward_pre_hook(self._begin, with_kwargs=True))
        self.handles.append(stack.register_forward_hook(self._end, always_call=True))
        rotary = getattr(stack, "rotary_emb", None)
        if rotary is not None:
            self.handles.append(rotary.register_forward_hook(self._rope_hook, with_kwargs=True))
        blocks = decoder_layers(model)
        norms = [one_kernel_norm(attention_norm(block)) for block in blocks]  # for the selections' inputs
        for j, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(_step_hook(self, j, norms), with_kwargs=True))
            after_attention = _after_attention_hook(j, norms, block.self_attn)
            self.handles.append(mlp_norm(block).register_forward_pre_hook(after_attention))
            self.handles.append(block.register_forward_hook(_unbind, always_call=True))  # also when it raised

    def remove(self) -> None:
        """Remove every hook, and the implementation switch of a forward cut short."""
        try:
            self._end()
        finally:
            while self.handles:
                self.handles.pop().remove()

    def _begin(self, stack: nn.Module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache not in self.caches or self.running is not None:
            return
        given = (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])
        inputs = next((t for t in given if isinstance(t, torch.Tensor)), None)  # (B, T) or (B, T, hidden)
        mask = kwargs.get("attention_mask")
        if inputs is not None:  # before anything of the forward is allocated
            check_forward(cache, inputs.shape[0], inputs.shape[1], mask)
        # a prefill forward's padding, for 8-bit rows' smoothing: None where there is none (``check_forward`` has
        # waited for the mask already: this reads it at no further wait)
        two_d = isinstance(mask, torch.Tensor) and mask.dim() == 2 and inputs is not None and inputs.shape[1] > 1
        valid = mask[:, -inputs.shape[1] :].bool() if two_d else None
        cache.forward_valid = valid if valid is not None and not bool(valid.all()) else None
        self.running = cache
        self.own = [config._attn_implementation_internal for config in self.configs]
        for config in self.configs:
            config._attn_implementation_internal = ATTENTION

    def _rope_hook(self, rotary: nn.Module, args, kwargs, output) -> None:
        """After the stack's rotary embedding: its (cos, sin) for the running cache, under the layer type
        it was computed for (Gemma 3 computes one per type: ``forward(x, position_ids, layer_type)``),
        or None (one for every layer)."""
        if self.running is not None:
            layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
            self.running.ropes[layer_type] = output

    def _end(self, *hook_args) -> None:
        """After the stack's forward, or its exception: the model's own implementation again, and the
        running cache's selection stream joined to the compute stream (``join_selections``)."""
        own, self.own, running, self.running = self.own, [], self.running, None
        if own:  # the forward was given one of our caches
            for config, implementation in zip(self.configs, own, strict=True):
                config._attn_implementation_internal = implementation
        if running is not None:
            running.join_selections()


def _attention_configs(model: PreTrainedModel) -> list[PreTrainedConfig]:
    """Every config whose attention implementation the model's modules read: the model's, its
    sub-configs at any depth (transformers keeps one implementation each), nested models'."""
    pending = [module.config for module in model.modules() if isinstance(module, PreTrainedModel)]
    found: dict[int, PreTrainedConfig] = {}  # by identity: configs are not hashable
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        pending += [sub for key in config.sub_configs if (sub := getattr(config, key, None)) is not None]
    return list(found.values())


def _unbind(block: nn.Module, args, output) -> None:
    """After a decoder block, or its exception: drop its reference to the cache, so that a finished
    or failed cache (and its GPU buffers) is freed as soon as the caller lets go of it."""
    unbind(block.self_attn)


def _prefetch(cache, targets: list[int], hidden: torch.Tensor, norms: list[Norm]) -> None:
    """Start the selection and fetch of the ``targets`` layers from ``hidden`` (B, 1, hidden), each
    with its target's own attention norm and rotary cos/sin. Sliding-window and dense layers select
    nothing (only offloaded layers do)."""
    for target in targets:
        layer = cache.layers[target] if target < len(norms) else None
        if isinstance(layer, OffloadedLayer) and layer.is_initialized:
            layer.prefetch(hidden[:, 0], norms[target], cache.rope(target))


def _reads_input(cache, layer: int) -> bool:
    """Whether ``layer``'s one-layer-ahead selection reads the residual stream entering the previous
    layer; if not, the residual after the previous layer's attention (``lookahead_from ==
    "attention"``, and the first ``attention_lookahead_layers`` offloaded layers, counted among the
    offloaded ones: Gemma 3's sliding layers between them count for nothing; an offloaded layer 0, which
    selects from its own input, neither)."""
    config = cache.config
    indices = cache.offloaded_indices
    earlier = bisect.bisect_left(indices, layer) - bisect.bisect_left(indices, 1)  # offloaded in 1 .. layer-1
    return config.lookahead_from == "input" and earlier >= config.attention_lookahead_layers


def _step_hook(attachment: Attachment, j: int, norms: list[Norm]):
    """Before decoder layer j: bind the running cache to its attention, and during decode start the
    selection and prefetch of layer j+1 from the residual stream entering layer j (where
    ``_reads_input``), of layer j itself for policies that select at their own layer, and of layer 0
    (no previous layer) from its own input.
    """

    def hook(block: nn.Module, args, kwargs):
        cache = attachment.running
        if cache is None:
            return
        bind(block.self_attn, cache)
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, q_len, hidden)
        if j == 0:
            cache.decoding = hidden.shape[1] == 1
            if cache.decoding and not cache.driven:
                cache.begin_decode_step()
        if not cache.decoding:  # prefill: nothing to select
            return
        if not cache.policy_type.lookahead:
            _prefetch(cache, [j], hidden, norms)
            return
        targets = [0] if j == 0 else []
        targets += [j + 1] if _reads_input(cache, j + 1) else []
        _prefetch(cache, targets, hidden, norms)

    return hook


def _after_attention_hook(j: int, norms: list[Norm], attention: nn.Module):
    """Before decoder layer j's MLP norm, i.e. on the residual stream after its attention: the
    selection and prefetch of layer j+1 where it does not read layer j's input."""

    def hook(norm: nn.Module, args) -> None:
        cache = bound_cache(attention)
        if cache is None or not cache.decoding or not cache.policy_type.lookahead:
            return
        if not _reads_input(cache, j + 1):  # (B, 1, hidden), or (B, hidden) as OPT flattens it
            _prefetch(cache, [j + 1], args[0].view(-1, 1, args[0].shape[-1]), norms)

    return hook
