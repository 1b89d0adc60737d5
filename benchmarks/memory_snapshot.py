"""What the GPU holds beyond the weights while ``infinigen`` decodes: PyTorch's allocation history
over one case (random-weight Llama-3-8B shape, bfloat16), live blocks after the timed steps grouped
by the runtime's line that allocated them. Needs CUDA.

    python benchmarks/memory_snapshot.py 1 32768 0.1     # batch, context, budget
"""

from __future__ import annotations

import collections
import sys

import torch
from profiling import decoded

from infinigen.bench.shapes import random_artifact, random_model

SITES = 12


def allocation_site(frames: list[dict]) -> str:
    """The first frame inside the runtime (or the model code that asked)."""
    for frame in frames:
        if "/infinigen/" in frame["filename"] and not frame["filename"].endswith("bench.py"):
            return f"{frame['filename'].split('/infinigen/')[-1]}:{frame['line']} {frame['name']}"
    return "elsewhere: " + "; ".join(f"{f['filename'].split('/')[-1]}:{f['line']}" for f in frames[:3])


@torch.no_grad()
def main(batch: int, context: int, budget: float) -> None:
    model = random_model("llama-3-8b", "cuda", torch.bfloat16)
    artifact = random_artifact(model, "llama-3-8b", 0.5)
    weights = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    # held until the snapshot (the cache's buffers are what it shows); the peak restarts after the warm-up
    decoder, step_ms = decoded(model, artifact, batch, context, budget, gen_len=4)
    config = model.config
    kv = batch * context * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * 2
    live, peak = torch.cuda.memory_allocated() - weights, torch.cuda.max_memory_allocated() - weights
    print(f"{batch} x {context}, infinigen {budget} ({step_ms:.2f} ms per step), beyond the weights", end=" ")
    print(f"(against dense's {kv / 1e9:.2f} GB of KV; {decoder.cache.policy.name} cache held):")
    print(f"  live after decoding {live / 1e9:.3f} GB ({live / kv:.1%})")
    print(f"  the timed steps' peak {peak / 1e9:.3f} GB ({peak / kv:.1%})")
    sites = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block.get("frames"):  # the weights came before the history
                sites[allocation_site(block["frames"])] += block["size"]
    for site, size in sites.most_common(SITES):
        print(f"  {size / 1e6:9.1f} MB {size / kv:6.1%}  {site}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
