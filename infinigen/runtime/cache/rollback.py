"""A cache cut back to its first tokens (``InfinigenCache.crop``): transformers' assisted and prompt-lookup
decoding crop the drafted tokens a verification rejected, and decode on from the cut.

Every slot's state is a function of its token and the earlier ones (``kept``'s premise too), so cutting to n
tokens is marking slots n.. free: their pool rows, 8-bit scales and partial keys are written again by the next
tokens, and attention reads no slot that is not valid. Rows reuse keeps on the GPU are dropped from the cut
on. Where the premise fails, a crop is refused in one line: a policy that accumulates what later queries
attend to (h2o) or keeps state per page (quest: a page's bounds span the cut), a limited CPU pool (it evicted
and rewrote slots), a sliding window that has moved past the cut.
"""

from __future__ import annotations

from infinigen.errors import InfinigenError
from infinigen.runtime.cache.layers import DenseLayer, OffloadedLayer
from infinigen.runtime.cache.sliding import SlidingLayer


def refusal(cache) -> str | None:
    """Why ``cache`` cannot be cut back as it now stands, or None."""
    policy = cache.policy_type
    if policy.observes_attention:
        return f"the {policy.name} policy accumulates the attention its cached tokens receive"
    if policy.paged:
        return f"the {policy.name} policy keeps state per page of tokens, which a cut may split"
    for layer in cache.layers:
        if isinstance(layer, OffloadedLayer) and layer.max_tokens is not None:
            return "a limited CPU pool (--cpu-pool-gb) has evicted and rewritten its slots"
        if isinstance(layer, SlidingLayer) and layer.length > layer.window:  # its ring rewrote earlier tokens
            return f"a sliding-window layer has moved past its {layer.window}-token window"
    return None


def crop(cache, tokens: int) -> None:
    """Remove the last ``-tokens`` tokens (transformers' convention), or keep the first ``tokens`` (its
    convention before 5.2); 0 removes nothing."""
    held, tokens = cache.get_seq_length(), int(tokens)  # transformers 5.17 passes a 0-d tensor
    length = held + tokens if tokens < 0 else (tokens or held)
    if length >= held:
        return
    if length < 0:
        raise InfinigenError(f"crop: the cache holds {held} tokens, {-tokens} cannot be removed")
    reason = refusal(cache)
    if reason is not None:
        raise InfinigenError(f"this cache cannot be cropped: {reason} (assisted decoding needs a cut)")
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if isinstance(layer, OffloadedLayer):
            _cut_offloaded(layer, length)
        elif isinstance(layer, DenseLayer):  # a sliding window's too, within its window (``refusal``)
            layer.valid[:, :, length:] = False
            layer.length = length


def _cut_offloaded(layer: OffloadedLayer, length: int) -> None:
    layer.valid[:, :, length:] = False
    layer.used = layer.length = length
    layer.attention_valid = None
    resident = layer.resident
    if resident is not None:  # rows of the cut slots are not those the slots will hold
        cut = resident.slots >= length
        resident.slots.masked_fill_(cut, -1)
        resident.age.masked_fill_(cut, 0)
        resident.position_of[:, :, length:-1] = -1  # (the last column takes the writes of no slot)


class Croppable:
    """``InfinigenCache``'s side of transformers' rollback: ``is_croppable``, asked before assisted decoding's first
    cut, and ``crop``."""

    @property
    def is_croppable(self) -> bool:
        return refusal(self) is None

    def crop(self, tokens: int) -> None:
        crop(self, tokens)
