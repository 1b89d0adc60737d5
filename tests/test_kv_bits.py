"""8-bit pool rows (``kv_bits`` 8): the codec's error bound, the gather's dequantisation (PyTorch
path, and the Triton kernel under the interpreter), decoding close to dense, and the bytes reported."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_interpreter, tiny_model
from helpers import padded_batch, teacher_forced_argmax, teacher_forced_logits, tiny_setup
from transformers import DynamicCache

from infinigen.eval.perplexity import pool_settings
from infinigen.runtime import cache_for
from infinigen.runtime.kernels import int8_rows, transfer
from infinigen.runtime.memory.pool import KVPool, row_bytes
from infinigen.runtime.selection.policies import settings_grid


def rows_with_outliers(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random rows (..., d) at magnitudes 1e-3 .. 1e3, a few channels 100x larger (as keys' outlier
    channels), within float16's range, and some all-zero rows."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=generator)
    rows *= 10.0 ** torch.randint(-3, 4, (*shape[:-1], 1), generator=generator)
    rows[..., :2] *= 100
    rows.view(-1, shape[-1])[::7] = 0
    return rows.clamp(-6e4, 6e4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_is_within_half_a_step_of_each_row(dtype):
    """A value comes back within half a code step of its row's plane, scale = absmax / 127 (plus the
    float32 roundings of x / scale and code * scale: 2^-16 of the absmax), zeros exactly; a plane
    is head_dim int8 codes and one float32 scale."""
    rows = rows_with_outliers(64, 3, 2, 32).to(dtype)
    codes, scales = int8_rows.encode(rows)
    assert codes.dtype == torch.int8 and codes.shape == (64, 3, 2, 32)
    assert scales.dtype == torch.float32 and scales.shape == (64, 3, 2)
    decoded = int8_rows.decode(codes, scales, torch.float32)
    absmax = rows.float().abs().amax(dim=-1, keepdim=True)
    error = (decoded - rows.float()).abs()
    assert bool((error <= absmax / 254 + absmax * 2**-16).all())
    zero = absmax[..., 0] == 0
    assert bool(zero.any()) and bool(decoded[zero].eq(0).all()), "all-zero rows come back exactly"
    assert error.amax() > 0, "the rows are quantised"
    # the outlier channels cost the other channels precision, but never more than the bound
    assert bool((error[..., 2:] <= absmax / 254 + absmax * 2**-16).all())


def test_smoothed_keys_round_trip_within_their_bound_and_beat_plain_rows_on_outlier_channels():
    """Keys divided by their channels' factors (sqrt of each channel's absmax) before rounding come back
    within half a step times their factor; values are not smoothed (factor 1). On keys whose outliers sit
    in fixed channels, the other channels come back far closer than with one scale per plain row."""
    torch.manual_seed(0)
    rows = torch.randn(2, 3, 64, 2, 32)
    rows[:, :, :, 0, :2] *= 50  # two outlier key channels, in every token
    factors = int8_rows.channel_factors(rows)
    assert factors.shape == (2, 3, 2, 32) and bool(factors[:, :, 1].eq(1).all())
    assert torch.allclose(factors[:, :, 0], rows[..., 0, :].abs().amax(dim=2).sqrt())
    codes, scales = int8_rows.encode(rows, factors[:, :, None])
    decoded = int8_rows.decode(codes, scales, torch.float32, factors[:, :, None])
    smoothed_max = (rows / factors[:, :, None]).abs().amax(dim=-1, keepdim=True)
    bound = (smoothed_max / 254 + smoothed_max * 2**-16) * factors[:, :, None]
    error = (decoded - rows).abs()
    assert bool((error <= bound).all()) and error.amax() > 0
    plain = (int8_rows.decode(*int8_rows.encode(rows), torch.float32) - rows).abs()
    ordinary = (..., 0, slice(2, None))  # the keys' other channels
    assert error[ordinary].mean() * 4 < plain[ordinary].mean()
    assert torch.equal(error[..., 1, :], plain[..., 1, :]), "values are rounded as plain rows are"
    zero = torch.zeros(1, 3, 4, 2, 32)
    assert bool(int8_rows.channel_factors(zero).eq(1).all())


def test_a_rows_factors_come_from_its_own_first_tokens_not_its_padding_or_batch_mates():
    """Each batch row's key factors are set from its first tokens written, its padding and the other rows left
    out, and a row with no token yet (all padding) gets them from its first chunk that has one: a row's codes
    are those it has alone."""
    torch.manual_seed(0)
    rows = rows_with_outliers(2, 2, 12, 2, 8)
    rows[1, :, :3] *= 1000  # padding with huge keys: its factors must not see them
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False
    pool = KVPool(2, 2, 8, torch.float32, torch.device("cpu"), block_tokens=4, kv_bits=8)
    pool.write_range(0, pool.encode_range(0, rows[:, :, :8], valid[:, :8]))
    alone = KVPool(1, 2, 8, torch.float32, torch.device("cpu"), block_tokens=4, kv_bits=8)
    alone.write_range(0, alone.encode_range(0, rows[1:, :, 3:8]))
    assert torch.equal(pool.factors[1], alone.factors[0]) and pool.smoothed
    assert torch.equal(pool.factors[0], int8_rows.channel_factors(rows[:1, :, :8])[0])
    later = KVPool(2, 2, 8, torch.float32, torch.device("cpu"), block_tokens=4, kv_bits=8)
    valid[1, :8] = False  # row 1 all padding in the first chunk: its factors wait for its first token
    later.encode_range(0, rows[:, :, :8], valid[:, :8])
    assert not later.smoothed and bool(later.factors[1].eq(1).all())
    later.encode_range(8, rows[:, :, 8:], valid[:, 8:])
    first = int8_rows.channel_factors(rows[1:, :, 8:])[0]
    assert later.smoothed and torch.equal(later.factors[1], first)
    assert torch.equal(later.factors[0], int8_rows.channel_factors(rows[:1, :, :8])[0]), "set once"


def test_pool_rows_and_bytes_with_8_bits():
    """Host rows hold the codes alone (2 * head_dim bytes: whole 128-byte lines at head_dim 64 or
    128); each slot's two scales live beside them on the compute device, grown with the pool."""
    pool = KVPool(2, 3, 64, torch.float16, torch.device("cpu"), block_tokens=8, kv_bits=8)
    assert pool.dtype == torch.int8 and pool.row_bytes == 2 * 64 == row_bytes(64, torch.float16, None, 8)
    pool.reserve(5)
    assert pool.nbytes == 2 * 3 * 8 * pool.row_bytes
    assert pool.scales.shape == (2, 3, 8, 2) and pool.scales.dtype == torch.float32 and not pool.scales.any()
    pool.scales[:, :, 7] = 1.0
    pool.reserve(9)  # a second block: the scales grow with the capacity, old ones kept, new ones zero
    assert pool.scales.shape == (2, 3, 16, 2) and bool(pool.scales[:, :, 7].eq(1).all())
    assert not pool.scales[:, :, 8:].any()
    assert (
        row_bytes(64, torch.float16, None, 16) == KVPool(1, 1, 64, torch.float16, pool.device, block_tokens=8).row_bytes
    )
    assert KVPool(1, 1, 64, torch.float16, pool.device, block_tokens=8).scales is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_gather_dequantises_with_count_and_destination(dtype):
    torch.manual_seed(0)
    pool = KVPool(2, 2, 8, dtype, torch.device("cpu"), block_tokens=5, kv_bits=8)
    rows = rows_with_outliers(2, 2, 12, 2, 8).to(dtype)
    pool.write_range(0, pool.encode_range(0, rows[:, :, :11]))
    pool.write_slots(torch.full((2, 2), 11), rows[:, :, 11:])  # a decode step's token
    factors = int8_rows.channel_factors(rows[:, :, :11])[:, :, None]  # from the first rows written
    assert pool.smoothed and torch.equal(pool.factors[:, :, None], factors)
    expected = int8_rows.decode(*int8_rows.encode(rows, factors), dtype, factors)
    indices = torch.tensor([[[0, 6, 11], [4, 5, 10]], [[1, 2, 3], [7, 8, 9]]])
    count = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    out = torch.full((2, 2, 2, 3, 8), float("nan"), dtype=dtype)
    transfer.gather_rows(pool, indices, count, out)
    destination = torch.tensor([[[4, 0, 2], [1, 3, 0]], [[0, 1, 2], [2, 0, 4]]], dtype=torch.int32)
    placed = torch.full((2, 2, 2, 5, 8), float("nan"), dtype=dtype)
    transfer.gather_rows(pool, indices, count, placed, destination)
    for b in range(2):
        for h in range(2):
            n = int(count[b, h])
            assert torch.equal(out[b, h, :, :n].transpose(0, 1), expected[b, h, indices[b, h, :n]])
            assert not out[b, h, :, n:].any(), "zeros past the count"
            at = destination[b, h, :n].long()
            assert torch.equal(placed[b, h, :, at].transpose(0, 1), expected[b, h, indices[b, h, :n]])
            untouched = torch.ones(5, dtype=torch.bool)
            untouched[at] = False
            assert bool(placed[b, h, :, untouched].isnan().all()), "only the moved rows are written"
    # kept in 8 bits (row reuse): the codes and scales as stored, dequantised later to the same rows
    codes, scales = torch.zeros(2, 2, 2, 5, 8, dtype=torch.int8), torch.zeros(2, 2, 2, 5)
    transfer.gather_rows(pool, indices, count, codes, destination, scales)
    dequantised = torch.full_like(placed, float("nan"))
    int8_rows.dequantise(codes, scales, pool.factors, dequantised)
    moved = ~placed.isnan()
    assert torch.equal(dequantised[moved], placed[moved]) and not scales[~moved[..., 0]].any()


KERNELS = r"""
import torch
from infinigen.runtime.kernels import int8_rows, transfer
from infinigen.runtime.memory.pool import KVPool
from test_kv_bits import rows_with_outliers
B, H, D, bt = 2, 3, 16, 8
pool = KVPool(B, H, D, torch.float32, torch.device("cpu"), block_tokens=bt, gather_programs=4, kv_bits=8)
rows = rows_with_outliers(B, H, 30, 2, D)
pool.write_range(0, pool.encode_range(0, rows[:, :, :29]))
pool.block_table = torch.tensor([b.data_ptr() for b in pool.blocks], dtype=torch.int64)
slots = torch.tensor([[29, 29, 29], [29, 29, 29]])
codes, scales = int8_rows.encode(rows[:, :, 29:], pool.factors[:, :, None])  # the decode write, quantised first
pool.scales[:, :, 29] = scales[:, :, 0]
transfer._launch_scatter(pool, slots, codes)
generator = torch.Generator().manual_seed(1)
idx = torch.stack([torch.randperm(30, generator=generator)[:12].sort().values for _ in range(B * H)]).view(B, H, 12)
count = torch.tensor([[12, 0, 5], [3, 7, 1]], dtype=torch.int32)
destination = torch.stack([torch.randperm(16, generator=generator)[:12] for _ in range(B * H)]).view(B, H, 12)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for where in (None, destination.to(torch.int32)):
        width = 12 if where is None else 16
        kernel = torch.full((B, H, 2, width + 1, D), float("nan"), dtype=dtype)
        reference = kernel.clone()
        transfer._launch_gather(pool, idx, count, kernel[:, :, :, :width], where)
        transfer.gather_rows(pool, idx, count, reference[:, :, :, :width], where)  # the PyTorch path
        # equal up to the last rounding to bfloat16 (the interpreter's conversion may round otherwise)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        close = (kernel - reference).abs() <= ulp * reference.abs()
        assert bool((close | (kernel.isnan() & reference.isnan())).all()), (dtype, where is None)
        assert not bool(kernel[:, :, :, : width].isnan().all(dim=-1).all(dim=-1).all()), "rows were written"
        assert bool(kernel[:, :, :, width].isnan().all()), "gather wrote past its slice"
# kept in 8 bits (row reuse): codes and scales as stored, exactly the PyTorch path's; dequantised alike
for where in (None, destination.to(torch.int32)):
    width = 12 if where is None else 16
    codes = torch.zeros(2, B, H, 2, width + 1, D, dtype=torch.int8)
    scales = torch.full((2, B, H, 2, width + 1), -1.0)
    transfer._launch_gather(pool, idx, count, codes[0, ..., :width, :], where, scales[0, ..., :width])
    transfer.gather_rows(pool, idx, count, codes[1, ..., :width, :], where, scales[1, ..., :width])
    assert torch.equal(codes[0], codes[1]) and torch.equal(scales[0], scales[1]), ("raw gather", where is None)
    assert bool((scales[0, ..., width] == -1).all()), "raw gather wrote past its slice"
    kept = (codes[0, ..., :width, :], scales[0, ..., :width], pool.factors)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((2, B, H, 2, width + 1, D), float("nan"), dtype=dtype)
        int8_rows._launch_dequantise(*kept, out[0, ..., :width, :])
        int8_rows.dequantise(*kept, out[1, ..., :width, :])  # the PyTorch path
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
        kernel, reference = out[0, ..., :width, :], out[1, ..., :width, :]
        assert bool(((kernel - reference).abs() <= ulp * reference.abs()).all()), dtype
        assert bool(out[0, ..., width, :].isnan().all()), "dequantise wrote past its slice"
# a prefill's block of earlier rows as the pool's blocks hold them, (B, H, n, 2, d), seen as (B, H, 2, n, d)
block, block_scales = torch.randint(-127, 128, (B, H, 7, 2, D), dtype=torch.int8), torch.rand(B, H, 7, 2)
for dtype in (torch.float32, torch.bfloat16):
    rows = torch.full((B, H, 7, 2, D), float("nan"), dtype=dtype)
    planes = (block.transpose(2, 3), block_scales.transpose(2, 3), pool.factors, rows.transpose(2, 3))
    int8_rows._launch_dequantise(*planes)
    reference = int8_rows.decode(block, block_scales, dtype, pool.factors[:, :, None])  # the CPU path of read_rows
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    assert bool(((rows - reference).abs() <= ulp * reference.abs()).all()), ("prefill block", dtype)
print("ok")
"""


@pytest.mark.skipif(transfer.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernels")
def test_triton_gather_dequantises_8_bit_rows_in_interpreter():
    """The CUDA kernels (under Triton's interpreter) give the PyTorch path's rows: per-head counts, with
    and without a destination, into float32, float16 and bfloat16; kept in 8 bits, the same codes and
    scales, and their dequantisation the same values."""
    run_in_interpreter(KERNELS)


# Tiny random models have logits within about +-1: with 8-bit rows at budget 1.0 the largest logit
# error measured was 1.4e-3 (llama, opt, qwen3, gemma3; 3 prompts each), with 16-bit rows 4e-7.
LOGIT_TOLERANCE = 5e-3


@pytest.mark.parametrize(
    ("arch", "policy", "reuse_rows"),
    [("llama", "full", False), ("llama", "infinigen", False), ("gemma3", "infinigen", True)],
)
def test_8_bit_rows_at_budget_one_stay_close_to_dense(tokenizer, arch, policy, reuse_rows, device):
    model, artifact = tiny_setup(tokenizer, arch, device)
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    dense = teacher_forced_logits(model, ids, 24, DynamicCache())
    settings = dict(policy=policy, budget=1.0, reuse_rows=reuse_rows)
    full_precision = teacher_forced_logits(model, ids, 24, cache_for(model, artifact, **settings, kv_bits=16))
    assert (full_precision - dense).abs().amax() <= 1e-4
    cache = cache_for(model, artifact, **settings, kv_bits=8)
    quantised = teacher_forced_logits(model, ids, 24, cache)
    error = (quantised - dense).abs().amax()
    assert 1e-4 < error <= LOGIT_TOLERANCE, error  # quantised, and by no more than the tolerance
    assert torch.equal(quantised.argmax(-1), dense.argmax(-1))
    assert cache.summary()["kv_bits"] == 8


def test_8_bit_rows_kept_on_the_gpu_attend_what_a_staging_buffer_attends(tokenizer, device):
    """Row reuse with 8-bit rows keeps them dequantised (``resident_bits`` 16) or as codes and scales,
    dequantised for each step's attention (8): the logits of a run without rows of earlier steps are those of
    fetching into a staging buffer either way."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    runs = {}
    for reuse_rows, kept in ((False, None), (True, 16), (True, 8)):
        settings = dict(budget=0.3, kv_bits=8, reuse_rows=reuse_rows, resident_extra=0, resident_bits=kept)
        cache = cache_for(model, artifact, **settings)
        runs[kept] = teacher_forced_logits(model, ids, 24, cache)
        assert (cache.offloaded[0].resident is not None) == reuse_rows
        if reuse_rows:
            assert cache.offloaded[0].resident.rows.dtype == (torch.int8 if kept == 8 else model.dtype)
    assert torch.allclose(runs[16], runs[None], atol=1e-5, rtol=0)
    assert torch.allclose(runs[8], runs[None], atol=1e-5, rtol=0)


def test_8_bit_rows_change_the_bytes_reported(tokenizer):
    """bytes moved each way = rows x the host row (the codes), the pool's too; a limited pool holds
    4x the tokens of float32 rows; fraction_bytes counts 8 of 16 bits per value."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    inputs = padded_batch([list(range(3, 30))], 1, "cpu")
    summaries = {}
    for bits in (16, 8):
        cache = cache_for(model, artifact, policy="full", kv_bits=bits)
        teacher_forced_argmax(model, inputs["input_ids"], 20, cache)
        summaries[bits] = cache.summary()
        layer = cache.offloaded[0]
        assert layer.pool.row_bytes == row_bytes(16, torch.float32, None, bits)
    wide, narrow = summaries[16], summaries[8]
    ratio = (2 * 16) / (2 * 16 * 4)  # float32 rows of head_dim 16 against their int8 codes
    for key in ("bytes_host_to_device", "bytes_device_to_host", "cpu_pool_bytes"):
        assert narrow[key] == pytest.approx(wide[key] * ratio), key
    assert (wide["kv_bits"], narrow["kv_bits"]) == (16, 8)
    assert narrow["fraction_bytes"] == pytest.approx(narrow["fraction_fetched"] * 8 / 16, abs=1e-4)
    limited = {bits: cache_for(model, policy="full", cpu_pool_gb=1e-3, kv_bits=bits) for bits in (16, 8)}
    tokens = {bits: cache.pool_limit(1, torch.float32) for bits, cache in limited.items()}
    assert tokens[8] >= 4 * tokens[16] - 1
    sized = {bits: pool_settings(model, {"policy": "full", "kv_bits": bits}, 64, 1)["cpu_pool_gb"] for bits in (16, 8)}
    assert sized[8] == pytest.approx(sized[16] * ratio, rel=1e-3)  # eval's --cpu-pool-fraction pools (+ half a byte)


def test_8_bit_rows_take_any_head_dim():
    """No alignment asked of head_dim (the scales are not in the host row): 18 decodes as dense does."""
    model = tiny_model("llama", head_dim=18)
    ids = torch.randint(3, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    dense = teacher_forced_logits(model, ids, 20, DynamicCache())
    quantised = teacher_forced_logits(model, ids, 20, cache_for(model, policy="full", kv_bits=8))
    assert 0 < (quantised - dense).abs().amax() <= LOGIT_TOLERANCE


def test_kv_bits_sweeps_only_policies_that_offload_plain_rows():
    rows = settings_grid({"policy": ["dense", "full", "infinigen", "int4"], "kv_bits": [16, 8]})
    assert [(row["policy"], row["kv_bits"]) for row in rows] == [
        ("dense", None),
        ("full", 16),
        ("full", 8),
        ("infinigen", 16),
        ("infinigen", 8),
        ("int4", None),
    ]
