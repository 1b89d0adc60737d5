"""int4 / int2: every cached token, stored in the CPU pool and moved group-wise quantized
(asymmetric min/max per group of 64 channels, as in FlexGen and KIVI), dequantized on the compute
device after the transfer. Prefill attends in full precision; the current token too."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinigen.runtime.selection.policies.base import Policy


@dataclass(frozen=True)
class GroupQuantizer:
    """A RowCodec. Stored row bytes: ``bits`` per value packed, then float16 minimum and scale per group."""

    bits: int
    group: int = 64

    @property
    def bits_per_value(self) -> float:
        return self.bits + 32 / self.group

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    def _group(self, head_dim: int) -> int:
        return math.gcd(self.group, head_dim)

    def _nbytes(self, head_dim: int) -> tuple[int, int]:
        """(packed value bytes, float16 minimum + scale bytes)."""
        return head_dim * self.bits // 8, 4 * (head_dim // self._group(head_dim))

    def stored_dim(self, head_dim: int, dtype: torch.dtype) -> int:
        return math.ceil(sum(self._nbytes(head_dim)) / dtype.itemsize)

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows (..., d) -> codes (..., d) uint8, minimum and scale (..., groups) float16.

        The minimum rounds down and the scale up to float16, so every value lies in the coded range
        and the error is at most half a scale step."""
        groups = rows.float().unflatten(-1, (-1, self._group(rows.shape[-1])))  # (..., groups, g)
        low = groups.amin(dim=-1)
        low16 = low.half()
        low16 = torch.where(low16.float() > low, low16.nextafter(low16.new_full((), -math.inf)), low16)
        scale = ((groups.amax(dim=-1) - low16.float()) / self.levels).clamp(min=1e-6)
        scale16 = scale.half()
        scale16 = torch.where(scale16.float() < scale, scale16.nextafter(scale16.new_full((), math.inf)), scale16)
        codes = ((groups - low16.float()[..., None]) / scale16.float()[..., None]).round().clamp(0, self.levels)
        return codes.flatten(-2).to(torch.uint8), low16, scale16

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        codes, low, scale = self.quantize(rows)
        per_byte = 8 // self.bits
        shifts = torch.arange(0, 8, self.bits, device=rows.device, dtype=torch.uint8)
        packed = (codes.unflatten(-1, (-1, per_byte)) << shifts).sum(dim=-1, dtype=torch.uint8)
        parts = [packed, low.view(torch.uint8), scale.view(torch.uint8)]
        width = self.stored_dim(rows.shape[-1], rows.dtype) * rows.dtype.itemsize
        padding = width - sum(part.shape[-1] for part in parts)
        parts.append(packed.new_zeros(*packed.shape[:-1], padding))
        return torch.cat(parts, dim=-1).view(rows.dtype)

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        head_dim = out.shape[-1]
        value_bytes, scale_bytes = self._nbytes(head_dim)
        raw = stored.contiguous().view(torch.uint8)
        shifts = torch.arange(0, 8, self.bits, device=raw.device, dtype=torch.uint8)
        codes = (raw[..., :value_bytes, None] >> shifts) & self.levels  # (..., value_bytes, per_byte)
        low, scale = raw[..., value_bytes : value_bytes + scale_bytes].contiguous().view(torch.float16).chunk(2, -1)
        groups = codes.flatten(-2).unflatten(-1, (-1, self._group(head_dim))).float()
        out.copy_((groups * scale.float()[..., None] + low.float()[..., None]).flatten(-2))


class Int4Policy(Policy):
    name = "int4"
    codec = GroupQuantizer(bits=4)


class Int2Policy(Policy):
    name = "int2"
    codec = GroupQuantizer(bits=2)
