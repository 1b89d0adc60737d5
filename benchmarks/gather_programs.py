"""The decode step against the row gather's program count (``RuntimeConfig.gather_programs``), in one process.

The gather reads the pinned pool from the GPU's SMs (zero-copy): too few programs leave PCIe idle (the
compute stream waits for rows), too many take SMs from the layers computing beside them. Each size runs
every count in turn, ``--rounds`` times, interleaved, on one random-weight model; prints one line a run.

    python benchmarks/gather_programs.py --shape llama-3-8b --sizes 8x16384,1x131072 --programs 33,66,99,132
"""

from __future__ import annotations

import argparse

from infinigen.bench.runs import BenchCase, load_subject, run_case, subject_artifacts
from infinigen.bench.sweep import planned_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--sizes", default="8x16384,1x131072", help="batch x context pairs")
    parser.add_argument("--programs", default="33,66,99,132")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--gen-len", type=int, default=16)
    args = parser.parse_args()
    subject = load_subject(args.shape, None, None, None, "cuda", "bfloat16")
    programs = [int(p) for p in args.programs.split(",")]
    for size in args.sizes.split(","):
        batch, context = map(int, size.split("x"))
        base = BenchCase("infinigen", batch, context, gen_len=args.gen_len)
        artifact = subject_artifacts(subject, [base])[base.ratio]
        run_case(subject.model, artifact, BenchCase("infinigen", batch, 1024, gen_len=2))  # one-time work first
        for _ in range(args.rounds):
            for count in programs:
                case = BenchCase("infinigen", batch, context, gen_len=args.gen_len, runtime={"gather_programs": count})
                case, refused, _ = planned_case(subject.model, case, None)
                row = refused or run_case(subject.model, artifact, case)
                print(
                    f"{size} gather_programs {count}: {row.get('ms_per_step')} ms a step, the compute stream's wait "
                    f"{row.get('wait_ms_per_step')} ms, {row.get('h2d_mb_per_step')} MB moved {row.get('error') or ''}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
