"""The pools' host memory: a prefill's blocks planned ahead and taken as its layers reach them, none
left over, and a later cache reusing a dropped one's blocks. Runs on CPU in CI and on CUDA where
present (where the blocks are registered pinned memory)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import tiny_setup

from infinigen.runtime import cache_argument, cache_for, host_pool_size
from infinigen.runtime.memory import host_memory
from infinigen.runtime.memory.host_memory import HostBlocks, as_bytes, retire


def flush_retired(device: str) -> None:
    """Free the blocks earlier tests' caches left for reuse."""
    gc.collect()
    host_memory.release_retired(torch.device(device))


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


def test_take_counts_the_time_it_waited_for_blocks_still_being_made(device, monkeypatch):
    """A first prompt waits for its pool blocks to be pinned: ``waited_s`` (``bench``'s
    ``host_block_wait_s``) is that wait, not the time the workers spent ahead of it."""
    import threading
    import time

    flush_retired(device)
    real, release = host_memory._new_block, threading.Event()

    def slow(nbytes, where):
        release.wait()
        return real(nbytes, where)

    monkeypatch.setattr(host_memory, "_new_block", slow)
    host = HostBlocks(torch.device(device))
    host.plan([64, 64])
    threading.Timer(0.2, release.set).start()
    first = host.take(64)  # waits until the timer lets the workers finish
    waited = host.waited_s
    assert 0.15 <= waited < 5
    time.sleep(0.05)
    second = host.take(64)  # made already: no wait to speak of
    assert host.waited_s - waited < 0.05
    retire([first, second], torch.device(device))


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


@pytest.mark.cuda
def test_a_token_range_of_pool_blocks_moves_as_one_2d_copy_both_ways():
    """``copy_runs``: a token range of a (B, H, T, 2, w) host block written from the device and read back into
    part of a staging block, each as one 2D copy; a lone run too; a layout whose runs are not one pitch apart
    refused, nothing copied."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    shape, dtype = (3, 5, 16, 2, 8), torch.bfloat16
    block = host_memory.pinned_block(torch.Size(shape).numel() * 2, device).view(dtype).view(shape)
    rows = torch.randn(3, 5, 6, 2, 8, device=device, dtype=dtype)
    staged = torch.zeros(3, 5, 9, 2, 8, device=device, dtype=dtype)
    assert host_memory.copy_runs(block[:, :, 4:10], rows)
    assert host_memory.copy_runs(staged[:, :, 1:7], block[:, :, 4:10])
    assert host_memory.copy_runs(staged[:1, :1, 7:9], block[:1, :1, 4:6])
    torch.cuda.synchronize()
    assert torch.equal(block[:, :, 4:10].to(device), rows) and torch.equal(staged[:, :, 1:7], rows)
    assert torch.equal(staged[0, 0, 7:9], rows[0, 0, :2])
    before = block.clone()
    assert not host_memory.copy_runs(block[:, :, 4:10].transpose(0, 1), rows.transpose(0, 1).contiguous())
    torch.cuda.synchronize()
    assert torch.equal(block, before)
    host_memory.release(block.view(-1).view(torch.uint8))


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


def test_released_blocks_are_freed_not_reused(device):
    """A dropped pool's blocks wait for the next plan to reuse them, unless released first (a benchmark
    does so before a baseline that needs the host's memory): then freed, unregistered, and not reused."""
    flush_retired(device)
    host = HostBlocks(torch.device(device))
    host.plan([64, 32])
    blocks = [host.take(64), host.take(32)]
    pointers = {block.data_ptr() for block in blocks}
    retire(blocks, host.device)
    del blocks
    assert host_memory.release_retired(torch.device(device)) == 96
    assert host_memory.release_retired(torch.device(device)) == 0  # nothing left retired
    assert not pointers & set(host_memory._registered)
    assert all(where != host.device for where, _ in host_memory._retired)


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


ROW_BYTES = 2 * 16 * 4  # the tiny Llama's K and V of one token and KV head, float32


@pytest.mark.parametrize(
    ("arch", "settings"),
    [
        ("llama", dict(budget=0.5)),
        ("llama", dict(budget=0.5, kv_bits=8)),
        ("llama", dict(policy="int4")),  # rows in the policy's own codes
        ("opt", dict(policy="full", dense_layers=1)),
        ("gemma3", dict(budget=0.5)),  # sliding-window layers keep their window on the device
        ("llama", dict(budget=0.5, cpu_pool_gb=24 * 2 * 2 * ROW_BYTES / 1e9)),  # 24 tokens a sequence: evicts
        ("llama", dict(policy="dense")),  # no pool at all
    ],
)
def test_host_pool_size_is_what_the_pools_take(tokenizer, device, arch, settings):
    """What ``infinigen generate`` pins before the weights load: the pools' blocks once the prompt
    and the new tokens are cached, from the config and the settings alone."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    cache = cache_for(model, artifact, block_tokens=8, **settings)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0)).to(device)
    model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1, **{cache_argument(model): cache})
    size = host_pool_size(model.config, 2, 20 + 6, model.dtype, block_tokens=8, **settings)
    pools = [layer.pool for layer in cache.offloaded if layer.pool is not None]
    assert size.blocks == sum(len(pool.blocks) for pool in pools)
    assert size.nbytes == sum(pool.nbytes for pool in pools)
    assert (size.blocks > 0) == (settings.get("policy") != "dense")
    if arch == "llama":  # a tensor-parallel rank holds its share of the KV heads (2 here: one each)
        shared = host_pool_size(model.config, 2, 20 + 6, model.dtype, ranks=2, block_tokens=8, **settings)
        assert shared.blocks == size.blocks and shared.block_bytes * 2 == size.block_bytes


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


def test_a_region_gives_first_fit_ranges_and_merges_what_comes_back():
    region = host_memory._Region(torch.empty(100, dtype=torch.uint8))
    assert [region.take(30), region.take(30), region.take(30)] == [0, 30, 60]
    assert region.take(20) is None  # 10 bytes left
    region.release(30, 30)
    assert region.take(40) is None and region.take(25) == 30  # first fit, the rest stays free
    region.release(0, 30)
    region.release(30, 25)  # merges with both neighbours: 0 .. 60 free again
    region.release(60, 30)
    assert region.free == {0: 100}


@pytest.fixture
def reservation(monkeypatch, device):
    """A reservation of this test's own (a process keeps its reservations; the others' tests carve none)."""
    flush_retired(device)
    monkeypatch.setattr(host_memory, "_reserved", host_memory.defaultdict(list))
    futures = host_memory.reserve_host_memory(8 * host_memory.PAGE, device, regions=2)  # two regions of 4 pages
    regions = [future.result() for future in futures]
    assert [region.memory.numel() for region in regions] == [4 * host_memory.PAGE] * 2
    return regions


def within(block: torch.Tensor, regions) -> bool:
    return any(0 <= block.data_ptr() - region.memory.data_ptr() < region.memory.numel() for region in regions)


def test_blocks_are_carved_from_a_reservation_and_go_back_to_it(reservation, device):
    host = HostBlocks(torch.device(device))
    host.plan([3 * host_memory.PAGE, 100, 2 * host_memory.PAGE])
    big, small, other = host.take(3 * host_memory.PAGE), host.take(100), host.take(2 * host_memory.PAGE)
    assert all(within(block, reservation) for block in (big, small, other))
    assert [block.numel() for block in (big, small, other)] == [3 * host_memory.PAGE, 100, 2 * host_memory.PAGE]
    blocks = (big, small, other)
    offsets = [block.data_ptr() - r.memory.data_ptr() for block in blocks for r in reservation if within(block, [r])]
    assert all(offset % host_memory.PAGE == 0 for offset in offsets)  # pages apart (mapped regions start on one)
    assert big.is_pinned() == (device == "cuda")
    too_big = host.take(5 * host_memory.PAGE)  # no region has room: a block of its own
    assert not within(too_big, reservation)
    retire([big, small, other, too_big], host.device)  # as a pool's finaliser does (the device with its index)
    HostBlocks(host.device).plan([])  # frees every spare block: carved ones go back
    assert [region.free for region in reservation] == [{0: 4 * host_memory.PAGE}] * 2


def test_a_cache_decodes_the_same_from_reserved_blocks(tokenizer, reservation, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
    carved = cache_for(model, artifact, block_tokens=8, budget=0.5)
    tokens = model.generate(inputs, **{cache_argument(model): carved}, **kwargs)
    assert all(within(block, reservation) for layer in carved.offloaded for block in layer.pool.blocks)
    host_memory._reserved.clear()  # the same again, each block of its own
    mapped = cache_for(model, artifact, block_tokens=8, budget=0.5)
    assert torch.equal(model.generate(inputs, **{cache_argument(model): mapped}, **kwargs), tokens)
    assert not any(within(block, reservation) for layer in mapped.offloaded for block in layer.pool.blocks)


def test_a_reservation_that_could_not_be_made_leaves_blocks_of_their_own(tokenizer, monkeypatch, device):
    """Host memory short at start-up: the regions fail on the workers, and the pools make their own."""
    flush_retired(device)
    monkeypatch.setattr(host_memory, "_reserved", host_memory.defaultdict(list))
    mapped = host_memory.pinned_block

    def short(nbytes, on):
        if nbytes > 4 * host_memory.PAGE:
            raise MemoryError("no room for the region")
        return mapped(nbytes, on)

    monkeypatch.setattr(host_memory, "pinned_block", short)
    futures = host_memory.reserve_host_memory(64 * host_memory.PAGE, device)
    assert all(isinstance(future.exception(), MemoryError) for future in futures)
    monkeypatch.setattr(host_memory, "pinned_block", mapped)
    model, artifact = tiny_setup(tokenizer, "llama", device)
    cache = cache_for(model, artifact, block_tokens=8, budget=0.5)
    prefill(model, cache, batch=2, tokens=20, device=device)
    assert all(len(layer.pool.blocks) == 3 for layer in cache.offloaded)


def test_a_finaliser_run_while_its_thread_holds_the_lock_does_not_wait_for_itself(device):
    """Garbage collection may run a dropped pool's finaliser (``retire``) on a thread inside a carve,
    which holds the module's lock: the finaliser must get it (a plain lock would wait forever)."""
    with host_memory._lock:
        assert host_memory._lock.acquire(timeout=1), "a finaliser here would wait for its own thread"
        host_memory._lock.release()
        retire([torch.empty(8, dtype=torch.uint8)], torch.device(device))
    flush_retired(device)


def test_a_reservation_of_the_pool_size_holds_every_block(tokenizer, monkeypatch, device):
    """``reserve_host_memory(host_pool_size(...).reservation_bytes())``, as ``infinigen generate`` does
    while the weights load, holds every block of the cache it was sized for: here 5 blocks of 2 pages
    in 4 regions, where the bare ``nbytes`` (3 pages a region) would hold only 4."""
    flush_retired(device)
    monkeypatch.setattr(host_memory, "_reserved", host_memory.defaultdict(list))
    model, artifact = tiny_setup(tokenizer, "llama", device)
    size = host_pool_size(model.config, 2, 70 + 6, model.dtype, block_tokens=16, budget=0.5, kv_bits=16)
    assert (size.blocks, size.block_bytes) == (5, 2 * host_memory.PAGE)
    regions = [f.result() for f in host_memory.reserve_host_memory(size.reservation_bytes(), device)]
    inputs = torch.randint(3, 512, (2, 70), generator=torch.Generator().manual_seed(1)).to(device)
    cache = cache_for(model, artifact, block_tokens=16, budget=0.5, kv_bits=16)
    model.generate(inputs, **{cache_argument(model): cache}, max_new_tokens=6, do_sample=False, pad_token_id=1)
    blocks = [block for layer in cache.offloaded for block in layer.pool.blocks]
    assert len(blocks) == size.blocks and all(within(block, regions) for block in blocks)
