"""The CUDA gather's tuning against row formats: rows a program moves per loop step
(``RuntimeConfig.gather_rows``) and programs (``gather_programs``; default half the SMs), for
16-bit rows (512 B at head_dim 128) and 8-bit rows (256 B: int8 codes; their scales stay on the
device), one layer of the Llama-3-8B shape (8 KV heads), 10% and 20% of 16K and 128K tokens, graph-replayed
as ``infinigen bench --micro`` times them; one process, against its own pinned bulk copy. Needs CUDA.
(BENCHMARKS.md, "Micro-benchmarks".)

    python benchmarks/gather_tuning.py [ROWS,...] [PROGRAMS,...]   # defaults: 8,16,32,64; default (half the SMs)
"""

from __future__ import annotations

import json
import sys

import torch

from infinigen.bench.micro import micro_gather
from infinigen.bench.runs import pinned_bandwidth

CONTEXTS, FRACTIONS = [16384, 131072], [0.1, 0.2]
KV_HEADS, HEAD_DIM = 8, 128  # Llama-3-8B


def main() -> None:
    rows_list = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8,16,32,64").split(",")]
    programs_arg = sys.argv[2] if len(sys.argv) > 2 else "default"
    programs_list = [None if x == "default" else int(x) for x in programs_arg.split(",")]
    bulk = pinned_bandwidth("cuda")
    results = []
    print(f"pinned bulk copy {bulk:.1f} GB/s; {torch.cuda.get_device_name()}")
    print("gather_rows programs kv_bits context fraction      ms    GB/s  rows/us")
    for programs in programs_list:
        for rows in rows_list:
            shape = (KV_HEADS, HEAD_DIM, CONTEXTS, FRACTIONS)
            cases = micro_gather("cuda", torch.bfloat16, *shape, bulk, [16, 8], rows, programs)
            for row in cases:
                row |= {"gather_rows": rows, "gather_programs": programs}
                results.append(row)
                per_us = round(row["fraction"] * row["context"] * KV_HEADS / (row["ms"] * 1e3), 1)
                print(
                    f"{rows:11d} {str(programs):>8} {row['kv_bits']:7d} {row['context']:7d} {row['fraction']:8.2f}"
                    f" {row['ms']:7.3f} {row['gb_s']:7.1f} {per_us:8.1f}"
                )
    print(json.dumps({"bulk_gb_s": bulk, "results": results}))


if __name__ == "__main__":
    main()
