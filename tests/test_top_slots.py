"""top_slots: each row's best slots in slot order, as many as the count rule says, by PyTorch (CPU)
and by the radix-select kernels (Triton's CPU interpreter here, compiled on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_in_interpreter

from infinigen.runtime.kernels import top_slots as module
from infinigen.runtime.kernels.top_slots import FORCED, CountRule, top_slots, truncated

CASES = [  # batch, heads, n, cached tokens per batch row, rule
    (2, 3, 5000, [5000, 700], CountRule(0.2, math.inf, 8)),  # two chunks, different counts per batch row
    (1, 2, 300, [300], CountRule(0.2, 1.0, 8)),  # one partial chunk, counted by alpha
    (2, 1, 9000, [0, 9000], CountRule(0.25, math.inf, 8)),  # nothing cached in a row
    (1, 4, 8200, [8200], CountRule(0.5, 2.0, 8)),
    (3, 2, 40, [40, 5, 3], CountRule(0.1, math.inf, 8)),  # min_tokens, fewer cached than that
    (2, 2, 5000, [5000, 300], CountRule(0.05, 1.0, 8)),  # slots always fetched (FORCED), counted by alpha
]


def case_scores(index: int, batch: int, heads: int, n: int, cached: list[int]) -> torch.Tensor:
    """Random scores, -inf past each batch row's cached tokens (and one head one slot short)."""
    generator = torch.Generator().manual_seed(index)
    scores = torch.randn(batch, heads, n, generator=generator)
    if index % 2:  # heavy ties: a few distinct values, negative zero among them
        scores = torch.randint(-3, 4, (batch, heads, n), generator=generator).float() * 0.5
        scores[..., ::7] = -0.0
    if index == 5:  # sinks and a recent window, as the infinigen policy marks them
        scores[..., :4] = FORCED
        scores[0, :, 4980:5000] = scores[1, :, 280:300] = FORCED
    for b, tokens in enumerate(cached):
        scores[b, :, tokens:] = -math.inf
        scores[b, -1, max(tokens - 1, 0) :] = -math.inf
    return scores


def check(select, device: str) -> None:
    """select(scores, rule, k_max) keeps exactly the rule's count of slots per row (the counts
    CountRule.counts gives on the CPU), ranked by bfloat16-truncated score: every slot above the
    row's count-th best, the lowest slots among those equal to it, ascending, then n - 1."""
    for index, (batch, heads, n, cached, rule) in enumerate(CASES):
        scores = case_scores(index, batch, heads, n, cached)
        k_max = min(n, max(rule.min_tokens, math.ceil(rule.budget * n)))  # as the infinigen policy bounds it
        out, count = select(scores.to(device), rule, k_max)
        out, count = out.cpu(), count.cpu()
        assert out.shape == (batch, heads, k_max) and out.dtype == torch.int64 and count.dtype == torch.int32
        assert torch.equal(count, rule.counts(scores))
        for b in range(batch):
            c = int(count[b])
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


def with_tile_maxima(select):
    """``select`` given the maxima of 100-slot tiles of each row, as the scoring kernel passes them."""

    def select_with_tiles(scores, rule, k_max):
        speculated = scores.masked_fill(scores >= FORCED, -math.inf)  # the kernel's maxima: before FORCED
        tiles = torch.nn.functional.pad(speculated, (0, -scores.shape[-1] % 100), value=-math.inf)
        return select(scores, rule, k_max, tiles.unflatten(-1, (-1, 100)).amax(-1).flatten(0, 1))

    return select_with_tiles


def test_count_rule_averages_the_heads_rounds_half_to_even_and_keeps_within_budget_and_floor():
    inf = math.inf
    scores = torch.tensor(
        [
            [[3.0, 2.5, 2.2, 0.0, -inf, -inf], [1.0, 0.5, -inf, -inf, -inf, -inf]],  # within 1 of the best: 3, 2
            [[3.0, 2.5, 2.2, 0.0, -inf, -inf], [1.0, 0.5, 0.4, 0.3, -0.2, -inf]],  # 3, 4; 5 cached
            [[-inf] * 6, [-inf] * 6],  # nothing cached
        ]
    )
    assert CountRule(1.0, 1.0, 1).counts(scores).tolist() == [2, 4, 0]  # 2.5 -> 2, 3.5 -> 4: half to even
    assert CountRule(0.25, 1.0, 1).counts(scores).tolist() == [1, 2, 0]  # ceil(0.25 * cached)
    assert CountRule(1.0, 0.0, 3).counts(scores).tolist() == [3, 3, 0]  # nothing above: the floor
    assert CountRule(1.0, inf, 1).counts(scores).tolist() == [3, 4, 0]  # every cached token, averaged


def test_pytorch_path():
    check(top_slots, "cpu")


@pytest.mark.skipif(module.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernels are tested")
def test_radix_select_in_interpreter():
    script = "from test_top_slots import check, with_tile_maxima\n"
    script += "from infinigen.runtime.kernels.top_slots import _radix_top_slots\n"
    script += "check(_radix_top_slots, 'cpu')\ncheck(with_tile_maxima(_radix_top_slots), 'cpu')\nprint('ok')"
    run_in_interpreter(script)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_radix_select_on_cuda():
    check(top_slots, "cuda")
    check(with_tile_maxima(top_slots), "cuda")


def test_budget_count_is_the_share_at_least_min_tokens_at_most_what_is_cached():
    cached = torch.tensor([0, 3, 40, 5000, 5001])
    assert module.budget_count(cached, 0.1, 8).tolist() == [0, 3, 8, 500, 501]
    assert module.budget_count(cached, 1.0, 8).tolist() == cached.tolist()
