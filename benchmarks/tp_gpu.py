"""Tensor parallel on GPUs (issue 20), from the repository root:

    python benchmarks/tp_gpu.py [OPTIONS] PHASE...    phases run in the order given, then the table
      equality  a tiny random Llama saved to disk and loaded through infinigen's own loading path under
                torchrun (2 ranks, NCCL): dense, full and infinigen at budget 1.0 give the same tokens
                (float32; bfloat16 reported), step graphs equal eager steps where selection counts
                across ranks (finite alpha: an NCCL all-reduce inside the captured step), and
                `infinigen generate` under torchrun prints rank 0's JSON alone, with dense's text
      bench2    `torchrun --nproc-per-node 2 -m infinigen bench --shape llama-3-70b` at 8 x 16K and
                1 x 128K: full, infinigen at 10%, transformers' offloaded cache (its error, if it refuses)
      bench4    the same on 4 GPUs
      rank2     one GPU, plain python: llama-3-70b-tp2-rank (one rank's share of the model), same sizes
      rank4     llama-3-70b-tp4-rank likewise
      table     the summary of every result so far (run after every other phase anyway)
    python benchmarks/tp_gpu.py --tiny equality bench2 rank2
                the same phases on the CPU: gloo, two processes, tiny shapes and lengths

The 70B shape keeps each layer's size and builds --layers of its 80 layers (default 16): at TP=2 its
~72 GB of weights per rank leave ~12 GB of an 80 GB H100, less than bench's one-pass prefill of
131,072 tokens needs (its MLP activations alone are ~11 GB per rank), and a prefill of all 80 layers
at 128K takes most of a minute, four per run. A decode step and the memory beyond the weights grow
by layer; the table says how many layers ran.

Options (--tiny's defaults in brackets): --layers 16 [3]; --steps 8 [2] timed decode steps after 3
warm-up; --sizes 8x16384,1x131072 [2x256,1x512]; --policies full,infinigen,hf-offloaded; --budget 0.1;
--bench-args, more bench flags (e.g. --bench-args="--reuse-rows auto,off" or --bench-args="--kv-bits 16,8":
such rows get their own policy label; full / this compares like with like where full ran in the same
row format); --graphs, step unless the equality phase saw step graphs raise (then selection, else off);
--deadline 560 [7200], seconds from the start after which no command runs on: each command is cut to
what is left, and one with under 30 s left is skipped, so a call of at most 600 s returns what finished.
A command past its own limit (equality 240 [900] s, bench 420 [600], rank 240 [300], generate 180) is
sent SIGTERM (torchrun stops its workers), then SIGKILL 30 s later: a hung collective costs its limit.

Results, copied after every phase into --out (/tmp): tp_gpu_<run>.json (each run's raw report: equality,
tp2, tp4, rank2, rank4), tp_gpu_table.txt, tp_gpu.log; working files in --work (/tmp/tp_gpu), kept
between calls on a machine that stays up: `table` shows them all. Elsewhere: copy the returned
tp_gpu_*.json into DIR/results, then `python benchmarks/tp_gpu.py --work DIR table`. Every process
started here has NVLink multicast off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1: it can take a host's shared GPUs down), the Hub offline, OMP_NUM_THREADS 8
unless set (--tiny: 1, and no GPU) and NCCL's warnings in --work/nccl.*.log (NCCL_DEBUG=WARN).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import torch
from tp_equality import NEW_TOKENS, cli_check  # beside this script: the equality phase's own

from infinigen.bench.shapes import SHAPES

REPO = Path(__file__).resolve().parent.parent
EQUALITY = REPO / "benchmarks" / "tp_equality.py"  # the equality phase's processes
PHASES = ("equality", "bench2", "bench4", "rank2", "rank4", "table")
DIST = [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # torchrun, from this python

# --- the table -----------------------------------------------------------------------------------


def dense_kv_gb(report: dict, row: dict) -> float | None:
    """This rank's share of a dense KV cache of the layers that ran (16-bit), in GB."""
    shape = SHAPES.get(report["shape"])
    if shape is None:
        return None
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    kv_heads = shape.get("num_key_value_heads", shape["num_attention_heads"]) / report.get("ranks", 1)
    return row["batch"] * row["prompt_len"] * kv_heads * 2 * head_dim * 2 * report["layers"] / 1e9


def variant(row: dict) -> str:
    """What sets a row apart from its policy's defaults (8-bit rows, row reuse not auto, rows of earlier
    steps attended), so that rows of a sweep over them stay apart."""
    reuse, extra = row.get("reuse_rows"), row.get("resident_extra")
    return (
        (" (8-bit rows)" if row.get("kv_bits") == 8 else "")
        + (f" (reuse {reuse})" if reuse not in (None, "auto") else "")
        + (f" (resident extra {extra:g})" if extra else "")
    )


def rows_of(report: dict | None) -> dict:
    """(policy, batch, context) -> the row, with the memory beyond the weights and the dense KV share
    (a row set apart by ``variant`` is its own policy)."""
    found = {}
    for row in (report or {"results": []})["results"]:
        peak, dense, weights = row.get("decode_peak_gpu_gb"), dense_kv_gb(report, row), report.get("weights_gb")
        beyond = peak - weights if peak is not None and weights is not None else None
        key = (row["policy"] + variant(row), row["batch"], row["prompt_len"])
        found[key] = row | {"beyond_gb": beyond, "dense_kv_gb": dense}
    return found


def cell(value: object, form: str = "{}") -> str:
    return "" if value is None else form.format(value)


def faster(rows: dict, row: dict, other: str) -> float | None:
    """``other``'s step over ``row``'s (the speed-up), against the same row format where the other ran in it."""
    key = (row["batch"], row["prompt_len"])
    theirs = (rows.get((other + variant(row), *key)) or rows.get((other, *key), {})).get("ms_per_step")
    return theirs / row["ms_per_step"] if row.get("ms_per_step") and theirs and other != row["policy"] else None


def bench_lines(reports: dict) -> list[str]:
    """One line per run and one table of every row."""
    lines, table = [], []
    header = ("run", "policy", "batch x context", "step ms", "full / this", "hf-off / this", "beyond W GB",
              "of dense KV", "fetched", "H2D GB/s", "error")  # fmt: skip
    for name in ("tp2", "tp4", "rank2", "rank4"):
        if not (report := reports.get(name)):
            continue
        ranks = report.get("ranks", 1)
        lines.append(
            f"{name}: {report['shape']}, {report['layers']} layers, {report['dtype']}, {ranks} rank(s), "
            f"{report['device']}; "
            f"weights {report['weights_gb']} GB per rank; pinned H2D {report['pinned_h2d_gb_s']} GB/s per rank"
            + (f", {report.get('pinned_h2d_all_ranks_gb_s')} GB/s all ranks copying at once" if ranks > 1 else "")
            + f"; {report.get('wall_s')} s, exit code {report.get('exit_code')}"
            + (" (cut off: the rows it finished)" if report.get("partial") else "")
        )
        rows = rows_of(report)
        for (policy, batch, context), row in rows.items():
            beyond, dense = row["beyond_gb"], row["dense_kv_gb"]
            table.append((
                name, policy + cell(row.get("budget"), " {}"), f"{batch} x {context}",
                cell(row.get("ms_per_step"), "{:.2f}"), cell(faster(rows, row, "full"), "{:.1f}x"),
                cell(faster(rows, row, "hf-offloaded"), "{:.1f}x"), cell(beyond, "{:.2f}"),
                f"{beyond / dense:.0%}" if beyond is not None and dense else "",
                cell(row.get("fraction_fetched"), "{:.3f}"), cell(row.get("h2d_gb_s")), (row.get("error") or "")[:70],
            ))  # fmt: skip
    if table:
        widths = [max(len(str(c)) for c in column) for column in zip(header, *table, strict=True)]
        lines.append("")
        lines += [
            "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
            for cells in (header, *table)
        ]
        lines.append(
            "full / this, hf-off / this: that policy's step over this row's (the speed-up); beyond W: the decode "
            "steps' peak of GPU memory (allocator) less the weights, per rank; of dense KV: that over the rank's share "
            "of a dense 16-bit KV cache of the same layers"
        )
    return lines


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def target_lines(reports: dict) -> list[str]:
    """The issue's targets, where the runs for them exist."""
    targets = []
    tp2, tp4, one2, one4 = (rows_of(reports.get(name)) for name in ("tp2", "tp4", "rank2", "rank4"))
    for (policy, batch, context), row in tp2.items():
        if not policy.startswith("infinigen") or "reuse off" in policy or not row.get("ms_per_step"):
            continue
        size, step = f"{batch} x {context}", row["ms_per_step"]
        for other, bound in (("full", 10), ("hf-offloaded", 10)):
            theirs = tp2.get((other + variant(row), batch, context)) or tp2.get((other, batch, context), {})
            if theirs.get("ms_per_step"):
                ratio = theirs["ms_per_step"] / step
                label = other + variant(theirs)
                verdict = met(ratio >= bound)
                targets.append(f"TP=2 {size}: {policy} {ratio:.1f}x faster than {label} (>= {bound}x: {verdict})")
            elif theirs.get("error"):
                targets.append(f"TP=2 {size}: {other} did not run: {theirs['error']}")
        if row["beyond_gb"] is not None and row["dense_kv_gb"]:
            share = row["beyond_gb"] / row["dense_kv_gb"]
            targets.append(
                f"TP=2 {size}: GPU memory beyond the weights {row['beyond_gb']:.2f} GB per rank = {share:.0%} "
                f"of its dense KV share {row['dense_kv_gb']:.2f} GB (<= 25%: {met(share <= 0.25)})"
            )
        if four := tp4.get((policy, batch, context), {}).get("ms_per_step"):
            targets.append(f"TP=4 / TP=2 {size}: {four / step:.2f} (<= 0.6: {met(four / step <= 0.6)})")
        for ranks, per_rank, tp_rows in ((2, one2, tp2), (4, one4, tp4)):
            alone = per_rank.get((policy, batch, context), {}).get("ms_per_step")
            mine = tp_rows.get((policy, batch, context), {}).get("ms_per_step")
            if alone and mine:
                targets.append(
                    f"TP={ranks} {size}: rank step / one GPU's on the per-rank shape {mine / alone:.2f} "
                    f"(<= 1.2: {met(mine / alone <= 1.2)})"
                )
    if not targets:
        return []
    layers = (reports.get("tp2") or {}).get("layers")
    return ["", f"targets (infinigen at the budget run; {layers} of the shape's layers):", *(f"  {t}" for t in targets)]


def table_text(results: Path) -> str:
    """The equality checks, one table of every bench report so far, and the issue's targets."""
    paths = sorted(results.glob("*.json"))
    reports = {path.stem.removeprefix("tp_gpu_"): json.loads(path.read_text()) for path in paths}
    lines = []
    if equality := reports.get("equality"):
        lines.append(
            f"token equality ({equality.get('ranks')} ranks, {equality.get('device', 'cpu')}, "
            f"torch {equality.get('torch')}, transformers {equality.get('transformers')}): "
            f"{'PASS' if equality.get('passed') else 'FAIL'}"
            + ("" if equality.get("complete") else " (cut off: checks missing)")
        )
        lines += [f"  {c['label']} {c['dtype']:8} {c['check']}: {c['verdict']}" for c in equality["checks"]]
        lines.append("")
    return "\n".join(lines + bench_lines(reports) + target_lines(reports))


# --- the driver ----------------------------------------------------------------------------------


class Session:
    """One call's settings, log, wall-clock limits and results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work, self.dest = args, args.work, args.out
        self.start = time.monotonic()
        self.log = self.work / "tp_gpu.log"
        self.shape, self.rank_shape = ("tiny-llama", "tiny-llama") if args.tiny else ("llama-3-70b", None)
        self.limits = dict(equality=900, bench=600, rank=300) if args.tiny else dict(equality=240, bench=420, rank=240)

    def elapsed(self) -> int:
        return int(time.monotonic() - self.start)

    def echo(self, text: str) -> None:
        """``text`` on the console and in the log."""
        print(text, flush=True)
        with self.log.open("a") as log:
            log.write(text + "\n")

    def say(self, text: str) -> None:
        self.echo(f"[tp_gpu {time.strftime('%H:%M:%S')}] {text}")

    def limited(self, seconds: int, command: list[str], stdout: IO | None, stderr: IO, env: dict | None = None) -> int:
        """``command``'s exit code under a wall-clock limit, its own or what is left before the deadline
        (SIGTERM to its process group, on which torchrun stops its workers, then SIGKILL): a hung
        collective costs its limit, not the call's. ``stdout`` None: on the console and in the log."""
        seconds = min(seconds, self.args.deadline - self.elapsed() - 20)
        if seconds < 30:
            self.say(f"SKIP ({self.elapsed()} s of --deadline {self.args.deadline} gone): {' '.join(command)}")
            return 124
        pipe = subprocess.PIPE if stdout is None else stdout
        process = subprocess.Popen(command, stdout=pipe, stderr=stderr, env=env, text=True, start_new_session=True)
        copier = threading.Thread(target=self.copy, args=(process.stdout,))
        if stdout is None:
            copier.start()
        try:
            return process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
                return 124
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                return 137
        finally:
            if process.poll() is None:  # interrupted: take the workers down too
                os.killpg(process.pid, signal.SIGKILL)
            if copier.is_alive():
                copier.join()

    def copy(self, stream: IO) -> None:
        for line in stream:
            self.echo(line.rstrip("\n"))

    def publish(self) -> None:
        """What comes back: every raw report, the log's end and NCCL's warnings."""
        for path in (self.work / "results").glob("*.json"):
            shutil.copyfile(path, self.dest / f"tp_gpu_{path.name}")
        text = self.log.read_bytes()[-4_000_000:] if self.log.exists() else b""
        for path in sorted(self.work.glob("nccl.*.log")):
            if path.stat().st_size:
                text += f"--- {path}\n".encode() + path.read_bytes()[-20_000:]
        (self.dest / "tp_gpu.log").write_bytes(text)

    def equality(self) -> int:
        self.say("equality: tiny Llama, 2 ranks")
        tiny, result = self.work / "tiny", self.work / "results" / "equality.json"
        if not (tiny / "config.json").exists():
            with self.log.open("a") as log:
                built = subprocess.run([sys.executable, str(EQUALITY), "tiny-model", str(tiny)], stdout=log, stderr=log)
            if built.returncode:
                self.say("FAIL could not build the tiny model")
                return 1
        result.unlink(missing_ok=True)  # not an earlier call's
        artifact = self.work / "tiny-artifact"
        worker = [*DIST, "--nproc-per-node", "2", str(EQUALITY), "worker", str(tiny), str(artifact), str(result)]
        with self.log.open("a") as log:
            self.limited(self.limits["equality"], worker, None, log)
        if not result.exists():
            self.say("FAIL equality: no result (see tp_gpu.log)")
            return 1
        # the command line: infinigen generate under torchrun, infinigen at 1.0 against dense's text
        prompt, printed = self.work / "prompt.txt", self.work / "cli.out"
        prompt.write_text(json.loads(result.read_text())["cli_prompt"])
        generate = ["generate", str(tiny), "--artifact", str(artifact), "--prompt-file", str(prompt), "--policy"]
        generate += f"infinigen --budget 1.0 --dtype float32 --max-new-tokens {NEW_TOKENS} --json".split()
        with printed.open("w") as out, self.log.open("a") as log:
            code = self.limited(180, [*DIST, "--nproc-per-node", "2", "-m", "infinigen", *generate], out, log)
        with self.log.open("a") as log:
            log.write(f"generate exit code {code}\n")
        for line in cli_check(result, printed.read_text()):
            self.echo(line)
        return 0

    def graphs(self) -> str:
        """--graphs, or the first mode that ran without an error in the equality phase."""
        if self.args.graphs:
            return self.args.graphs
        try:
            usable = json.loads((self.work / "results" / "equality.json").read_text())["graphs_ok"]
        except (OSError, ValueError, KeyError):
            usable = {}
        return next((mode for mode in ("step", "selection", "off") if usable.get(mode, True)), "off")

    def bench(self, name: str, ranks: int, shape: str, policies: str, limit: int) -> int:
        """One `infinigen bench` run: under torchrun on ``ranks`` processes, or (0) on one GPU."""
        a = self.args
        launch, env = [*DIST, "--nproc-per-node", str(ranks), "-m", "infinigen"], None
        if ranks == 0:  # one GPU of the machine, as one rank sees it
            launch = [sys.executable, "-m", "infinigen"]
            env = os.environ | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        elif (gpus := 4 if self.args.tiny else torch.cuda.device_count()) < ranks:
            self.say(f"SKIP {name}: {ranks} GPUs needed, {gpus} here")
            return 0
        command = [*launch, "bench", "--shape", shape, "--layers", str(a.layers), "--sizes", a.sizes, "--gen-len"]
        command += [str(a.steps), "--policy", policies, "--budget", a.budget, "--graphs", self.graphs(), "--json"]
        command += a.bench_args.split()
        self.say(f"{name}: {' '.join(command)}")
        (self.work / "results" / f"{name}.json").unlink(missing_ok=True)  # not an earlier call's
        out, err, start = self.work / f"{name}.out", self.work / f"{name}.err", time.monotonic()
        with out.open("w") as stdout, err.open("w") as stderr:
            code = self.limited(limit, command, stdout, stderr, env)
        with err.open("rb") as errors, self.log.open("ab") as log:
            shutil.copyfileobj(errors, log)
        self.record(name, code, int(time.monotonic() - start), shape, ranks)
        return 0

    def record(self, name: str, code: int, seconds: int, shape: str, ranks: int) -> None:
        """The run's report (or the rows rank 0 finished, streamed on stderr) into results/, summed up."""
        text = (self.work / f"{name}.out").read_text(errors="replace")
        start = text.find("{\n")
        try:
            report = json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else None
        except ValueError:
            report = None
        if report is None:  # cut off or failed
            err = (self.work / f"{name}.err").read_text(errors="replace").splitlines()
            rows = [json.loads(line) for line in err if line.startswith('{"policy"')]
            self.echo(
                f"FAIL {name}: no report (exit code {code}, {seconds} s; {len(rows)} rows finished; see tp_gpu.log)"
            )
            if not rows:
                return
            report = dict(shape=shape, layers=self.args.layers, dtype="bfloat16", device=None, weights_gb=None)
            report |= dict(pinned_h2d_gb_s=None, ranks=max(ranks, 1), results=rows, partial=True)
        report |= {"name": name, "exit_code": code, "wall_s": seconds}
        (self.work / "results" / f"{name}.json").write_text(json.dumps(report, indent=2))
        steps = (
            f"{r['policy']} {r['batch']}x{r['prompt_len']}: {r.get('ms_per_step', r.get('error'))}"
            for r in report["results"]
        )
        self.echo(f"{name}: {seconds} s, exit code {code}; ms per step: {', '.join(steps)}")

    def phase(self, name: str) -> int:
        policies, limits = self.args.policies, self.limits
        match name:
            case "equality":
                return self.equality()
            case "bench2":
                return self.bench("tp2", 2, self.shape, policies, limits["bench"])
            case "bench4":  # the tiny shape's 2 KV heads do not split over 4 ranks
                return self.bench("tp4", 2 if self.args.tiny else 4, self.shape, policies, limits["bench"])
            case _:  # rank2, rank4: one rank's share of the 70B shape at that tensor-parallel size
                shape = self.rank_shape or f"llama-3-70b-tp{name[-1]}-rank"
                return self.bench(name, 0, shape, "infinigen", limits["rank"])

    def table(self) -> None:
        text = table_text(self.work / "results")
        print(text, flush=True)
        (self.work / "tp_gpu_table.txt").write_text(text + "\n")
        shutil.copyfile(self.work / "tp_gpu_table.txt", self.dest / "tp_gpu_table.txt")
        self.publish()


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phases", nargs="*", metavar="PHASE", help=", ".join(PHASES))
    parser.add_argument("--tiny", action="store_true", help="on the CPU: gloo, two processes, tiny shapes")
    parser.add_argument("--layers", type=int, help="layers of the shape built (16; tiny 3)")
    parser.add_argument("--steps", type=int, help="timed decode steps (8; tiny 2)")
    parser.add_argument("--sizes", help="batch x context (8x16384,1x131072; tiny 2x256,1x512)")
    parser.add_argument("--policies", default="full,infinigen,hf-offloaded")
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--bench-args", default="", help='more bench flags, e.g. --bench-args="--kv-bits 16,8"')
    parser.add_argument("--graphs", default="", help="bench's --graphs (default: what the equality phase saw work)")
    parser.add_argument("--deadline", type=int, help="seconds after which no command runs on (560; tiny 7200)")
    parser.add_argument("--out", type=Path, default=Path("/tmp"), help="where results are copied (/tmp)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tp_gpu"), help="working files (/tmp/tp_gpu)")
    args = parser.parse_args(argv)
    if unknown := [phase for phase in args.phases if phase not in PHASES]:
        parser.error(f"unknown phase {', '.join(unknown)}: {', '.join(PHASES)}")
    tiny = dict(layers=3, steps=2, sizes="2x256,1x512", deadline=7200)
    full = dict(layers=16, steps=8, sizes="8x16384,1x131072", deadline=560)
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out, args.work = args.out.resolve(), args.work.resolve()
    return args


def main(args: argparse.Namespace) -> int:
    os.chdir(REPO)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # NVLink multicast stays off (it can take a host's shared GPUs down), in every process started here
    os.environ |= dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    os.environ |= dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # NCCL's own warnings (its reason, if a collective fails) to files beside the log, not into stdout's JSON
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(args.work / "nccl.%h.%p.log"))
    if args.tiny:  # two ranks share a small CPU
        os.environ |= dict(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:  # torchrun's default of 1 slows the host-side work
        os.environ.setdefault("OMP_NUM_THREADS", "8")
    (args.work / "results").mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    session, status = Session(args), 0
    for phase in args.phases:
        if phase != "table":
            status |= session.phase(phase)
            session.publish()
    session.table()
    return status


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:])))
