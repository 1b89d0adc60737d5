"""The pools' host memory: a prefill's blocks planned ahead and taken as its layers reach them, none
left over, and a later cache reusing a dropped one's blocks. Runs on CPU in CI and on CUDA where
present (where the blocks are registered pinned memory)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import tiny_setup

from infinigen.runtime import cache_argument, cache_for, host_memory
from infinigen.runtime.host_memory import HostBlocks, as_bytes, retire


def flush_retired(device: str) -> None:
    """Free the blocks earlier tests' caches left for reuse (a plan of nothing frees every spare)."""
    gc.collect()
    host = HostBlocks(torch.device(device))
    host.plan([])


def test_planned_blocks_come_in_order_and_spares_are_reused_or_freed(device):
    flush_retired(device)
    host = HostBlocks(torch.device(device))
    host.plan([64, 64, 32])
    assert host.pending == 3
    first, second, small = host.take(64), host.take(64), host.take(32)
    assert [block.numel() for block in (first, second, small)] == [64, 64, 32]
    assert first.data_ptr() != second.data_ptr()
    assert host.pending == 0
    assert host.take(16).numel() == 16  # nothing planned: made on the spot
    assert first.is_pinned() == (device == "cuda")

    host.plan([128, 8])
    host.take(8)
    host.settle()  # the 128 was not taken: kept
    kept = host.spare[128][0].data_ptr()
    host.plan([128])
    assert host.take(128).data_ptr() == kept
    host.plan([8])  # nothing spare of size 8: a new block; nothing else spare stays
    assert not any(host.spare.values())
    host.settle()  # as a cache does after each prefill: no worker is left pinning
    assert host.pending == 0 and [block.numel() for block in host.spare[8]] == [8]
    retire([first, second, small], torch.device(device))  # as a pool's finaliser does


@pytest.mark.cuda
def test_a_failed_registration_falls_back_to_pinned_memory_and_leaves_no_cuda_error(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cudart = torch.cuda.cudart()

    class Refusing:  # registers nothing: the null pointer fails, leaving CUDA's last error set
        def cudaHostRegister(self, ptr, nbytes, flags):
            return cudart.cudaHostRegister(0, nbytes, flags)

    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: Refusing())
    block = host_memory._new_block(4096, torch.device("cuda", torch.cuda.current_device()))
    assert block.is_pinned() and block.data_ptr() not in host_memory._registered
    out = torch.ones(4, device="cuda") * 2  # a launch check would raise a CUDA error left behind
    torch.cuda.synchronize()
    assert out.sum().item() == 8


def test_a_dropped_host_blocks_retires_its_unused_blocks(device):
    flush_retired(device)
    host = HostBlocks(torch.device(device))
    host.plan([64, 32])
    taken, untaken = host.take(64), host.planned[32][0].result().data_ptr()
    del host  # a prefill that raised: the 32 was planned, never taken
    gc.collect()
    host = HostBlocks(torch.device(device))
    host.plan([32])
    assert host.take(32).data_ptr() == untaken
    retire([taken], torch.device(device))


def prefill(model, cache, batch: int, tokens: int, device: str) -> None:
    ids = torch.randint(3, 512, (batch, tokens), device=device)
    with torch.no_grad():
        model(ids, **{cache_argument(model): cache})


@pytest.mark.parametrize("kv_bits", [16, 8])
def test_a_prefill_plans_exactly_the_blocks_its_pools_take(tokenizer, device, kv_bits, monkeypatch):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    planned: list[int] = []
    plan = HostBlocks.plan
    monkeypatch.setattr(HostBlocks, "plan", lambda self, sizes: (planned.extend(sizes), plan(self, sizes)))
    cache = cache_for(model, artifact, block_tokens=8, kv_bits=kv_bits, budget=0.5)
    prefill(model, cache, batch=2, tokens=20, device=device)
    pools = [layer.pool for layer in cache.offloaded]
    assert planned == [pools[0].block_nbytes] * 3 * len(pools)  # 20 tokens: 3 blocks of 8 a layer
    assert sum(pool.nbytes for pool in pools) == sum(planned)
    assert cache.host_blocks.pending == 0 and not any(cache.host_blocks.spare.values())
    prefill(model, cache, batch=2, tokens=5, device=device)  # 25 tokens: one more block a layer
    assert planned[-len(pools) :] == [pools[0].block_nbytes] * len(pools) and len(planned) == 4 * len(pools)


def test_a_later_cache_reuses_the_blocks_of_a_dropped_one(tokenizer, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    flush_retired(device)
    cache = cache_for(model, artifact, block_tokens=8, budget=0.5)
    prefill(model, cache, batch=2, tokens=20, device=device)
    before = {as_bytes(block).data_ptr() for layer in cache.offloaded for block in layer.pool.blocks}
    cache.close()
    del cache
    gc.collect()
    cache = cache_for(model, artifact, block_tokens=8, budget=0.5)
    prefill(model, cache, batch=2, tokens=20, device=device)
    after = {as_bytes(block).data_ptr() for layer in cache.offloaded for block in layer.pool.blocks}
    assert after == before
