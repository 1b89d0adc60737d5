"""``SlidingLayer``: the cache of a sliding-window attention layer (Gemma 3's local layers), a ring of
``window`` slots on the compute device.

Such a layer only ever attends to the last ``window`` tokens (512 on Gemma 3), so its KV is bounded
whatever the context (0.5 MB per layer and sequence on Gemma-3-270m in float16): it stays on the compute
device, is neither offloaded nor speculated, and every policy leaves it as it is. What grows with
the context, and what InfiniGen moves over PCIe, is the KV of the full-attention layers only.

The token at position p lives in slot ``p % window``: a decode step overwrites the token that just
left the window, and attends to every valid slot, which then holds exactly positions p-window+1 .. p,
as transformers' sliding-window mask allows. Slots hold no order; attention needs none (the keys
carry their RoPE). A multi-token step returns the kept past in position order before its own tokens,
the same ``window - 1`` past tokens that transformers' ``DynamicSlidingWindowLayer`` returns, and
reports the same mask sizes, so the model's own sliding mask applies unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infinigen.runtime.cache.layers import DenseLayer
from infinigen.runtime.kernels.buffers import grown_to

if TYPE_CHECKING:
    from infinigen.runtime.cache import InfinigenCache


class SlidingLayer(DenseLayer):
    """KV of the last ``window`` tokens in a ring on the compute device. A decode step writes at the
    cache's device-side ``slot`` modulo ``window``: as in ``DenseLayer``, nothing in it depends on the
    length, so a captured decode step replays unchanged (and the ring, once full, never grows)."""

    is_sliding = True

    def __init__(self, window: int, cache: InfinigenCache) -> None:
        super().__init__(cache)
        self.window = window

    def _room(self, tokens: int) -> int:
        """Slots needed for ``tokens`` tokens seen: all of them until the window is full."""
        return min(tokens, self.window)

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens seen (grown by an eighth, at most to the window)."""
        needed = self._room(tokens)
        if needed > self.capacity:
            size = min(self.window, max(needed, self.capacity + max(256, self.capacity // 8)))
            self.keys, self.values = grown_to(self.keys, size, 2), grown_to(self.values, size, 2)
            self.valid = grown_to(self.valid, size, 2, fill=False)

    def _slots(self, start: int, end: int) -> torch.Tensor:
        """The ring slots of positions start .. end-1 (at most ``window`` of them)."""
        return torch.arange(start, end, device=self.valid.device) % self.window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = min(self.length, self.window - 1)  # past tokens a multi-token step returns
        return kept + query_length, self.length - kept

    def get_max_length(self) -> int:
        return self.window

    def decode_slot(self) -> torch.Tensor:
        return self.cache.slot % self.window  # the slot of the token that just left the window

    def _update_many(self, key_states, value_states):
        start, new = self.length, key_states.shape[2]
        kept = min(start, self.window - 1)
        past = self._slots(start - kept, start)
        past_keys, past_values = (
            self.keys.index_select(2, past),
            self.values.index_select(2, past),
        )  # before overwriting
        stored = min(new, self.window)  # the rest of the new tokens left the window within this step
        self.reserve(start + new)
        slots = self._slots(start + new - stored, start + new)
        self.keys.index_copy_(2, slots, key_states[:, :, new - stored :])
        self.values.index_copy_(2, slots, value_states[:, :, new - stored :])
        self.valid[:, :, slots] = True  # padding is cleared by the attention function
        self.length = start + new
        self.attention_valid = None
        if not kept:
            return key_states, value_states
        return torch.cat([past_keys, key_states], dim=2), torch.cat([past_values, value_states], dim=2)

    def mark_padding(self, token_valid: torch.Tensor, padded: bool) -> None:
        """token_valid: (B, T) for the tokens of the multi-token step just stored (False at padding)."""
        stored = min(token_valid.shape[1], self.window)
        slots = self._slots(self.length - stored, self.length)
        self.valid[:, :, slots] &= token_valid[:, None, token_valid.shape[1] - stored :]

    def grows(self) -> bool:
        """Whether the next decode step's token needs a bigger ring."""
        return self._room(self.length + 1) > self.capacity
