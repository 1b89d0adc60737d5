"""First writes into fresh host blocks (BENCHMARKS.md, "Prefill"): a prompt's rows of the OPT-13B
shape, batch 20 x 1,920 tokens (one whole 1,024-token block and 896 tokens of the next), written into
10 layers' fresh pools, then into the same blocks twice more: the whole block's copy and the partial
block's write (``KVPool.write_range``) timed apart. Needs CUDA.

    python benchmarks/first_writes.py
"""

from __future__ import annotations

import time

import torch

from infinigen.runtime.pool import KVPool

LAYERS, BATCH, HEADS, TOKENS, BLOCK_TOKENS, HEAD_DIM = 10, 20, 40, 1920, 1024, 128  # OPT-13B b20 x 1,920


def main() -> None:
    device = torch.device("cuda", 0)
    rows = torch.randn(BATCH, HEADS, TOKENS, 2, HEAD_DIM, device=device, dtype=torch.bfloat16)
    pools = [KVPool(BATCH, HEADS, HEAD_DIM, torch.bfloat16, device, block_tokens=BLOCK_TOKENS) for _ in range(LAYERS)]
    start = time.perf_counter()
    for pool in pools:
        pool.reserve(TOKENS)
    torch.cuda.synchronize()
    print(f"blocks made {time.perf_counter() - start:.2f} s")

    def timed(label: str, lo: int, hi: int) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for pool in pools:
            pool.write_range(lo, rows[:, :, lo:hi])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"{label}: {seconds:.3f} s, {LAYERS * BATCH * HEADS * (hi - lo) * 512 / 1e9 / seconds:.1f} GB/s")

    for round_ in ("first", "second", "third"):
        timed(f"{round_} full block copy", 0, BLOCK_TOKENS)
        timed(f"{round_} partial block write", BLOCK_TOKENS, TOKENS)


if __name__ == "__main__":
    main()
