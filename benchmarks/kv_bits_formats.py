"""Which format for 8-bit pool rows (``kv_bits`` 8), and whether 4 bits would do: perplexity of SmolLM2
decoding through the runtime with every offloaded layer's new rows rounded to each candidate as they are
written (what a gather dequantises is exactly that round trip), teacher-forced over the decoded part of
each window.

- int8: the runtime's ``int8_rows`` (codes with a float32 scale absmax / 127 per token, KV head, K/V);
- fp8-scaled: float8 e4m3 with a scale absmax / 448 per token, KV head, K/V (the same bytes);
- fp8: float8 e4m3 alone (no scale, 4 bytes fewer per row; values beyond +-448 saturate);
- int8-gN: int8 codes with a float32 scale absmax / 127 per group of N channels (outlier channels
  cost only their own group precision);
- int8-keys, int8-values: the runtime's int8 on one plane, the other left at 16 bits (which of the
  two the loss comes from);
- int4-gN: 4-bit codes with a float16 minimum and scale per group of N channels (the ``int4``
  policy's codec, asymmetric as in KIVI): 4 + 32 / N bits a value.

    python benchmarks/kv_bits_formats.py BOOK.txt 2048 1792 2               # text, window, prefix, windows
    python benchmarks/kv_bits_formats.py BOOK.txt 2048 1792 2 int4-g32,int4-g16   # only these (and 16-bit)
    python benchmarks/kv_bits_formats.py BOOK.txt 4096 3584 1 int8,int8-g32 MODEL.gguf   # another model
"""

from __future__ import annotations

import math
import sys

import torch

from infinigen.eval.decoding import read_text, teacher_forced_nll, windows
from infinigen.models import load_model
from infinigen.runtime import cache_for, int8_rows
from infinigen.runtime.layers import OffloadedLayer
from infinigen.runtime.policies.int4 import GroupQuantizer

E4M3_MAX = 448.0


def int8(rows: torch.Tensor) -> torch.Tensor:
    return int8_rows.decode(*int8_rows.encode(rows), rows.dtype)


def int8_groups(group: int):
    def round_trip(rows: torch.Tensor) -> torch.Tensor:
        grouped = rows.unflatten(-1, (-1, group))
        return int8_rows.decode(*int8_rows.encode(grouped), rows.dtype).flatten(-2)

    return round_trip


def int8_plane(plane: int):
    def round_trip(rows: torch.Tensor) -> torch.Tensor:
        out = rows.clone()
        out[..., plane, :] = int8(rows[..., plane, :])
        return out

    return round_trip


def fp8_scaled(rows: torch.Tensor) -> torch.Tensor:
    values = rows.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, 1)
    return ((values / scale).to(torch.float8_e4m3fn).float() * scale).to(rows.dtype)


def fp8(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(rows.dtype)


def int4(group: int):
    codec = GroupQuantizer(bits=4, group=group)

    def round_trip(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        codec.decode(codec.encode(rows), out)
        return out

    return round_trip


FORMATS = {"16-bit": None, "int8": int8, "fp8-scaled": fp8_scaled, "fp8": fp8}
FORMATS |= {f"int8-g{group}": int8_groups(group) for group in (64, 32)}
FORMATS |= {"int8-keys": int8_plane(0), "int8-values": int8_plane(1)}
FORMATS |= {f"int4-g{group}": int4(group) for group in (64, 32, 16)}


def main(text: str, window: int, prefix: int, count: int, names: list[str], model: str | None = None) -> None:
    loaded = load_model(model, device="cpu", dtype="float32")
    ids = windows(loaded.tokenizer, read_text(text), window, count)
    encoded = OffloadedLayer._encoded
    reference = None
    for name in ["16-bit", *names]:
        round_trip = FORMATS[name]

        def rounded(layer, keys, values, round_trip=round_trip):
            return encoded(layer, *round_trip(torch.stack([keys, values], dim=3)).unbind(3))

        OffloadedLayer._encoded = encoded if round_trip is None else rounded
        try:
            nll = teacher_forced_nll(loaded.model, cache_for(loaded.model, policy="full"), ids, prefix).float()
        finally:
            OffloadedLayer._encoded = encoded
        reference = nll if reference is None else reference
        change = math.exp(nll.mean() - reference.mean()) - 1
        print(
            f"{name:10s} perplexity {math.exp(nll.mean()):.4f} ({change:+.3%}), "
            f"mean |NLL change| per token {(nll - reference).abs().mean():.4f}",
            flush=True,
        )


if __name__ == "__main__":
    chosen = sys.argv[5].split(",") if len(sys.argv) > 5 else [name for name in FORMATS if name != "16-bit"]
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), chosen, *sys.argv[6:7])
