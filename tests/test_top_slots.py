"""top_slots: each row's count best slots in slot order, by PyTorch (CPU) and by the radix-select
kernels (Triton's CPU interpreter here, compiled on CUDA)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinigen.runtime import top_slots as module
from infinigen.runtime.top_slots import top_slots, truncated

CASES = [  # batch, heads, n, k_max, count per batch row
    (2, 3, 5000, 1000, [1000, 137]),  # two chunks, different counts per batch row
    (1, 2, 300, 64, [64]),  # one partial chunk
    (2, 1, 9000, 2000, [0, 2000]),  # nothing kept in a row
    (1, 4, 8200, 4000, [3999]),
]


def check(select, device: str) -> None:
    """select(scores, count, k_max) keeps exactly count[b] slots per row, ranked by bfloat16-truncated
    score: every slot above the row's count-th best, the lowest slots among those equal to it,
    ascending, then n - 1."""
    generator = torch.Generator().manual_seed(0)
    for index, (batch, heads, n, k_max, counts) in enumerate(CASES):
        scores = torch.randn(batch, heads, n, generator=generator)
        if index % 2:  # heavy ties: a few distinct values, negative zero and -inf among them
            scores = torch.randint(-3, 4, (batch, heads, n), generator=generator).float() * 0.5
            scores[..., ::7] = -0.0
        scores[..., -5:] = -math.inf
        count = torch.tensor(counts, dtype=torch.int32)
        out = select(scores.to(device), count.to(device), k_max).cpu()
        assert out.shape == (batch, heads, k_max) and out.dtype == torch.int64
        for b in range(batch):
            c = counts[b]
            assert bool((out[b, :, c:] == n - 1).all())
            for h in range(heads):
                row, kept = truncated(scores[b, h]), out[b, h, :c]
                assert bool((kept[1:] > kept[:-1]).all()), "ascending, no repeats"
                if c == 0:
                    continue
                threshold = row.sort(descending=True).values[c - 1]
                above = (row > threshold).nonzero().flatten()
                assert bool(torch.isin(above, kept).all()) and bool((row[kept] >= threshold).all())
                tied = (row == threshold).nonzero().flatten()
                assert torch.equal(kept[row[kept] == threshold], tied[: c - len(above)])


def test_pytorch_path():
    check(top_slots, "cpu")


@pytest.mark.skipif(module.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernels are tested")
def test_radix_select_in_interpreter():
    script = "from test_top_slots import check\nfrom infinigen.runtime.top_slots import _radix_top_slots\n"
    script += "check(_radix_top_slots, 'cpu')\nprint('ok')"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root / "tests"), str(root)]))
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_radix_select_on_cuda():
    check(top_slots, "cuda")
