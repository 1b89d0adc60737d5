#!/usr/bin/env bash
# Tensor parallel on GPUs (issue 20), from the repository root:
#
#   bash benchmarks/tp_gpu.sh PHASE...        phases run in the order given, then the table
#     equality  a tiny random Llama saved to disk and loaded through infinigen's own loading path under
#               torchrun (2 ranks, NCCL): dense, full and infinigen at budget 1.0 give the same tokens
#               (float32; bfloat16 reported), step graphs equal eager steps where selection counts
#               across ranks (finite alpha: an NCCL all-reduce inside the captured step), and
#               `infinigen generate` under torchrun prints rank 0's JSON alone, with dense's text
#     bench2    `torchrun --nproc-per-node 2 -m infinigen bench --shape llama-3-70b` at 8 x 16K and
#               1 x 128K: full, infinigen at 10%, transformers' offloaded cache (its error, if it refuses)
#     bench4    the same on 4 GPUs
#     rank2     one GPU, plain python: llama-3-70b-tp2-rank (one rank's share of the model), same sizes
#     rank4     llama-3-70b-tp4-rank likewise
#     table     the summary of every result so far (run after every other phase anyway)
#   TINY=1 bash benchmarks/tp_gpu.sh equality bench2 rank2
#               the same phases on the CPU: gloo, two processes, tiny shapes and lengths
#
# The 70B shape keeps each layer's size and builds LAYERS of its 80 layers (default 16): at TP=2 its
# ~72 GB of weights per rank leave ~12 GB of an 80 GB H100, less than bench's one-pass prefill of
# 131,072 tokens needs (its MLP activations alone are ~11 GB per rank), and a prefill of all 80 layers
# at 128K takes most of a minute, four per run. A decode step and the memory beyond the weights grow
# by layer; the table says how many layers ran.
# Settings: LAYERS (16), STEPS (8 timed decode steps after 3 warm-up), SIZES (8x16384,1x131072),
# POLICIES (full,infinigen,hf-offloaded), BUDGET (0.1), BENCH_ARGS (more bench flags, e.g.
# "--reuse-rows auto,off" or "--kv-bits 16,8": such rows get their own policy label; full / this compares
# like with like where full ran in the same row format), GRAPHS (step unless the equality phase saw step graphs raise: then
# selection, else off), DEADLINE (560: seconds from the start after which no command runs on; each phase's commands are cut to what is left, so a call of
# at most 600 s returns what finished). Results, copied after every phase: $OUT if set, else /tmp:
# tp_gpu_<phase>.json (each run's raw report), tp_gpu_table.txt, tp_gpu.log; working files in
# $TP_GPU_WORK (/tmp/tp_gpu), kept between calls on a machine that stays up: `table` shows them all.
# Elsewhere: copy the returned tp_gpu_*.json into DIR/results, then TP_GPU_WORK=DIR bash ... table.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (it can take a host's shared GPUs down), in every process started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEST=${OUT:-/tmp}
WORK=${TP_GPU_WORK:-/tmp/tp_gpu}
# NCCL's own warnings (its reason, if a collective fails) to files beside the log, not into stdout's JSON
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_DEBUG_FILE=${NCCL_DEBUG_FILE:-$WORK/nccl.%h.%p.log}
START=$SECONDS
mkdir -p "$DEST" "$WORK/results"
LOG="$WORK/tp_gpu.log"
PY=${PYTHON:-python3}

if [[ ${TINY:-0} == 1 ]]; then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1  # two ranks share a small CPU
    SHAPE=tiny-llama RANK_SHAPE=tiny-llama
    LAYERS=${LAYERS:-3} STEPS=${STEPS:-2} SIZES=${SIZES:-2x256,1x512}
    LIMIT_EQUALITY=900 LIMIT_BENCH=600 LIMIT_RANK=300 DEADLINE=${DEADLINE:-7200}
else
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # torchrun's default of 1 slows the host-side work
    SHAPE=llama-3-70b RANK_SHAPE=""
    LAYERS=${LAYERS:-16} STEPS=${STEPS:-8} SIZES=${SIZES:-8x16384,1x131072}
    LIMIT_EQUALITY=240 LIMIT_BENCH=420 LIMIT_RANK=240 DEADLINE=${DEADLINE:-560}
fi
POLICIES=${POLICIES:-full,infinigen,hf-offloaded}
BUDGET=${BUDGET:-0.1}
GRAPHS=${GRAPHS:-}  # empty: step, unless the equality phase saw step graphs fail (then selection, else off)
DIST=("$PY" -m torch.distributed.run --standalone)  # torchrun, from the python that runs everything

exec 3>&1  # the console, also from inside commands whose output goes to a file
say() { echo "[tp_gpu $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&3; }

# a command under a wall-clock limit, its own or what is left before DEADLINE (SIGTERM, on which
# torchrun stops its workers, then SIGKILL): a hung collective costs its limit, not the call's
limited() {
    local seconds=$1
    shift
    local left=$((DEADLINE - (SECONDS - START) - 20))
    ((left < seconds)) && seconds=$left
    if ((seconds < 30)); then
        say "SKIP ($((SECONDS - START)) s of DEADLINE=$DEADLINE gone): $*"
        return 124
    fi
    timeout -k 30 "$seconds" "$@"
}

# what comes back: every raw report, the log's end
publish() {
    for path in "$WORK"/results/*.json; do
        [[ -f $path ]] && cp "$path" "$DEST/tp_gpu_$(basename "$path")"
    done
    {
        tail -c 4000000 "$LOG"
        for path in "$WORK"/nccl.*.log; do
            [[ -s $path ]] && echo "--- $path" && tail -c 20000 "$path"
        done
    } >"$DEST/tp_gpu.log"
}

gpus() {
    if [[ ${TINY:-0} == 1 ]]; then echo 4; else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi
}

# --- equality ------------------------------------------------------------------------------------

make_tiny_model() {
    [[ -f $WORK/tiny/config.json ]] && return 0
    "$PY" - "$WORK/tiny" <<'EOF'
"""A tiny random Llama (4 layers, 8 query / 4 KV heads of 128 dims: divisible by 2 and 4 ranks) and a
word-level tokenizer trained on the bundled calibration text, saved as a checkpoint folder."""
import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from infinigen.prepare.calibration import bundled_text

backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
backend.train_from_iterator([bundled_text()], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>"]))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>")
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=1024,  # above the tokenizer's ~800 words; divisible by the ranks (the lm_head is split)
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=2048,
    max_position_embeddings=4096,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=None,  # every row generates every token
)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
EOF
}

write_equality_script() {
    cat >"$WORK/equality.py" <<'EOF'
"""Under torchrun: one checkpoint loaded through infinigen's loading path (transformers' tensor
parallelism) in float32 and bfloat16, its artifact prepared on the sharded model, then token equality
between caches. The report is rewritten after every check: a run cut off keeps what it finished."""
import json
import sys
import time

import torch
import transformers

import infinigen
from infinigen.artifacts import open_artifact, save_artifact
from infinigen.models import load_model
from infinigen.prepare import prepare_artifact
from infinigen.prepare.calibration import bundled_text
from infinigen.runtime import cache_argument
from infinigen.runtime.text import generate_text
from infinigen.tensor_parallel import leave_group, rank, together, world_size

folder, artifact_folder, out = sys.argv[1:4]
NEW_TOKENS = 40
BLOCK = 256  # pool blocks of 256 tokens: row A's 500-token prompt grows its pool mid-decode (a recapture)
DTYPES = ("float32", "bfloat16")


def say(*parts) -> None:
    if rank() == 0:
        print(*parts, flush=True)


def prompt_text(tokenizer, start: int, tokens: int) -> str:
    """The most words of the bundled text from word ``start`` that make at most ``tokens`` tokens."""
    words = bundled_text().split()[start:]
    n = tokens
    while len(tokenizer(" ".join(words[:n])).input_ids) > tokens:
        n -= 1
    return " ".join(words[:n])


def generated(model, inputs, artifact, settings: dict, how: str) -> tuple[list, float]:
    """New tokens (B, NEW_TOKENS) of a greedy generate: ``how`` step (infinigen.decode, each step a
    CUDA graph), loop (transformers' own loop, each selection a CUDA graph) or hf (no infinigen cache)."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=model.config.pad_token_id)
    start = time.perf_counter()
    if how == "hf":
        out = model.generate(**inputs, **kwargs)
    else:
        with infinigen.cache_for(model, artifact, block_tokens=BLOCK, **settings) as cache:
            if how == "step":
                kwargs["custom_generate"] = infinigen.decode
            out = model.generate(**inputs, **{cache_argument(model): cache}, **kwargs)
            graphs = settings.get("cuda_graphs", True) and model.device.type == "cuda"
            if how == "step" and graphs and not cache.replayed_steps:
                raise RuntimeError("no decode step was replayed from a CUDA graph")
    return out[:, inputs["input_ids"].shape[1] :].tolist(), time.perf_counter() - start


def divergence(got: list, want: list) -> str:
    """'equal', or where the first row that differs first differs."""
    for row, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return f"row {row} differs from new token {i}"
    return "equal"


# (name, settings, how, compared with, hard): a hard check's failure is a FAIL (in bfloat16 only where
# it compares a mode with another of the same cache: against dense, rounding may differ); the rest INFO
VARIANTS = [
    ("dense", dict(policy="dense"), "step", None, True),
    ("dense, transformers' loop", dict(policy="dense"), "loop", "dense", True),
    ("full", dict(policy="full"), "step", "dense", True),
    ("infinigen 1.0", dict(policy="infinigen", budget=1.0), "step", "dense", True),
    ("infinigen 1.0, eager", dict(policy="infinigen", budget=1.0, cuda_graphs=False), "step", "dense", True),
    ("infinigen 1.0, transformers' loop", dict(policy="infinigen", budget=1.0), "loop", "dense", True),
    ("infinigen 0.1, eager", dict(policy="infinigen", budget=0.1, cuda_graphs=False), "step", None, True),
    ("infinigen 0.1", dict(policy="infinigen", budget=0.1), "step", "infinigen 0.1, eager", True),
    ("transformers' cache", {}, "hf", "dense", False),  # other attention kernels: reported only
]
# last, after every dtype's checks above: a finite alpha all-reduces each layer's count over the ranks,
# inside the captured step, and (transformers' loop) inside a selection graph replayed beside the
# compute stream's eager all-reduces: the runs most likely to hang a collective
ALPHA = [
    ("alpha 2, eager", dict(policy="infinigen", budget=0.2, alpha=2.0, cuda_graphs=False), "step", None, True),
    ("alpha 2", dict(policy="infinigen", budget=0.2, alpha=2.0), "step", "alpha 2, eager", True),
    # transformers' loop without selection graphs: tells the loop's own effect from the capture's
    ("alpha 2, transformers' loop, eager", dict(policy="infinigen", budget=0.2, alpha=2.0, cuda_graphs=False), "loop",
     "alpha 2, eager", True),
    ("alpha 2, transformers' loop", dict(policy="infinigen", budget=0.2, alpha=2.0), "loop", "alpha 2, eager", True),
]

report = {"ranks": world_size(), "torch": torch.__version__, "transformers": transformers.__version__}
if torch.cuda.is_available():
    report |= {"device": torch.cuda.get_device_name(), "nccl": str(torch.cuda.nccl.version())}
report |= {"checks": [], "passed": False, "complete": False, "graphs_ok": {}}
say(f"equality: {report}")


def save() -> None:
    if rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


subjects, results = {}, {}
raised = set()  # the modes (step, selection, off) of the runs that raised an error, not a token difference
for dtype in DTYPES:
    loaded = load_model(folder, dtype=dtype)  # sharded over the ranks: WORLD_SIZE > 1
    model, tokenizer = loaded.model, loaded.tokenizer
    if dtype == "float32":
        prepared = prepare_artifact(loaded, tokens=512)  # every rank gathers every head
        if rank() == 0:
            save_artifact(prepared, artifact_folder, card="tiny random Llama (tp_gpu.sh)", force=True)
        together()
    artifact = open_artifact(artifact_folder, model)  # checked against the sharded weights
    tokenizer.padding_side = "left"
    texts = [prompt_text(tokenizer, 0, 500), prompt_text(tokenizer, 1000, 300)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    say(f"{dtype}: {model.device}, prompts of {inputs['attention_mask'].sum(-1).tolist()} tokens")
    subjects[dtype] = (model, artifact, inputs)
    if dtype == "float32":  # the text `infinigen generate` must print (one prompt, greedy, as it decodes)
        with infinigen.cache_for(model, artifact, policy="dense") as cache:
            text, _ = generate_text(model, tokenizer, texts[:1], cache, max_new_tokens=NEW_TOKENS)
        report["cli_prompt"], report["cli_reference"] = texts[0], text[0]
save()  # the command line's check needs the prompt and text, even if a check below hangs

for variants in (VARIANTS, ALPHA):
    for dtype in DTYPES:
        model, artifact, inputs = subjects[dtype]
        for name, settings, how, reference, hard in variants:
            ran = True
            try:
                results[dtype, name], seconds = generated(model, inputs, artifact, settings, how)
                verdict = "equal" if reference is None else divergence(results[dtype, name], results[dtype, reference])
            except Exception as exc:  # noqa: BLE001 - a failure is this check's result
                verdict, seconds = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}", 0.0
                results[dtype, name], hard, ran = None, True, False
                if not isinstance(exc, (TypeError, KeyError)):  # those: its reference failed
                    raised.add("off" if settings.get("cuda_graphs") is False else {"loop": "selection"}.get(how, how))
            rounding = ran and dtype != "float32" and reference == "dense"
            label = "PASS" if verdict == "equal" else ("FAIL" if hard and not rounding else "INFO")
            what = name if reference is None else f"{name} vs {reference}"
            say(f"  {label} {dtype:8} {what}: {verdict} ({seconds:.1f} s)")
            report["checks"].append(dict(dtype=dtype, check=what, verdict=verdict, label=label, seconds=round(seconds, 2)))
            report["passed"] = all(c["label"] != "FAIL" for c in report["checks"])
            # what bench's --graphs may use: a mode whose runs raised (a capture failing with NCCL, say) is not
            report["graphs_ok"] = {mode: mode not in raised for mode in ("step", "selection", "off")}
            save()
report["complete"] = True
save()
say(f"equality (API): {'PASS' if report['passed'] else 'FAIL'}")
leave_group()
EOF
}

phase_equality() {
    say "equality: tiny Llama, 2 ranks"
    make_tiny_model >>"$LOG" 2>&1 || { say "FAIL could not build the tiny model"; return 1; }
    write_equality_script
    rm -f "$WORK/results/equality.json"  # not an earlier call's
    limited "$LIMIT_EQUALITY" "${DIST[@]}" --nproc-per-node 2 "$WORK/equality.py" \
        "$WORK/tiny" "$WORK/tiny-artifact" "$WORK/results/equality.json" 2>>"$LOG" | tee -a "$LOG"
    [[ -f $WORK/results/equality.json ]] || { say "FAIL equality: no result (see tp_gpu.log)"; return 1; }
    # the command line: infinigen generate under torchrun, infinigen at 1.0 against dense's text
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["cli_prompt"], end="")' \
        "$WORK/results/equality.json" >"$WORK/prompt.txt"
    limited 180 "${DIST[@]}" --nproc-per-node 2 -m infinigen generate "$WORK/tiny" \
        --artifact "$WORK/tiny-artifact" --prompt-file "$WORK/prompt.txt" --policy infinigen --budget 1.0 \
        --dtype float32 --max-new-tokens 40 --json >"$WORK/cli.out" 2>>"$LOG"
    echo "generate exit code $?" >>"$LOG"
    "$PY" - "$WORK/results/equality.json" "$WORK/cli.out" <<'EOF' | tee -a "$LOG"
import json
import sys

path, cli = sys.argv[1:3]
report = json.load(open(path))
text = open(cli).read()
try:
    printed = json.loads(text)  # rank 0's JSON alone: a second rank's output would break it
    verdict = "equal" if printed["outputs"][0] == report["cli_reference"] else "differs"
    stats = printed["stats"]
except (ValueError, KeyError, IndexError) as exc:
    verdict, stats = f"no single JSON report on stdout ({type(exc).__name__}): {text[:200]!r}", {}
label = "PASS" if verdict == "equal" else "FAIL"
print(f"  {label} float32  infinigen generate --budget 1.0 under torchrun vs dense's text: {verdict}")
report["checks"].append(dict(dtype="float32", check="infinigen generate (CLI) vs dense", verdict=verdict, label=label))
report["cli_stats"] = {k: v for k, v in stats.items() if k != "per_layer"}
report["passed"] = report["passed"] and label == "PASS"
json.dump(report, open(path, "w"), indent=2)
print(f"equality: {'PASS' if report['passed'] else 'FAIL'}" + ("" if report["complete"] else " (cut off: checks missing)"))
EOF
}

# --- benchmarks ----------------------------------------------------------------------------------

bench_run() {  # name, ranks (0: one process), shape, policies, limit
    local name=$1 ranks=$2 shape=$3 policies=$4 limit=$5
    local launch=("$PY" -m infinigen)
    if ((ranks > 0)); then
        if (($(gpus) < ranks)); then
            say "SKIP $name: $ranks GPUs needed, $(gpus) here"
            return 0
        fi
        launch=("${DIST[@]}" --nproc-per-node "$ranks" -m infinigen)
    fi
    local args=(bench --shape "$shape" --layers "$LAYERS" --sizes "$SIZES" --gen-len "$STEPS"
        --policy "$policies" --budget "$BUDGET" --graphs "$(graphs)" --json)
    read -r -a extra <<<"${BENCH_ARGS:-}"
    args+=("${extra[@]}")
    say "$name: ${launch[*]} ${args[*]}"
    rm -f "$WORK/results/$name.json"  # not an earlier call's
    local start=$SECONDS
    if ((ranks > 0)); then
        limited "$limit" "${launch[@]}" "${args[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err"
    else  # one GPU of the machine, as one rank sees it
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-0} limited "$limit" "${launch[@]}" "${args[@]}" \
            >"$WORK/$name.out" 2>"$WORK/$name.err"
    fi
    local code=$?
    cat "$WORK/$name.err" >>"$LOG"
    "$PY" - "$WORK" "$name" "$code" "$((SECONDS - start))" "$shape" "$LAYERS" "$ranks" <<'EOF' | tee -a "$LOG"
import json
import sys

work, name, code, seconds, shape, layers, ranks = sys.argv[1:8]
text = open(f"{work}/{name}.out").read()
start = text.find("{\n")
try:
    report, _ = json.JSONDecoder().raw_decode(text[start:]) if start >= 0 else (None, 0)
except ValueError:
    report = None
if report is None:  # cut off or failed: the rows rank 0 finished, streamed on stderr
    rows = [json.loads(line) for line in open(f"{work}/{name}.err") if line.startswith('{"policy"')]
    print(f"FAIL {name}: no report (exit code {code}, {seconds} s; {len(rows)} rows finished; see tp_gpu.log)")
    if not rows:
        sys.exit(0)
    report = {"shape": shape, "layers": int(layers), "dtype": "bfloat16", "device": None, "weights_gb": None,
              "pinned_h2d_gb_s": None, "ranks": max(int(ranks), 1), "results": rows, "partial": True}
report |= {"name": name, "exit_code": int(code), "wall_s": int(seconds)}
json.dump(report, open(f"{work}/results/{name}.json", "w"), indent=2)
rows = ", ".join(f"{r['policy']} {r['batch']}x{r['prompt_len']}: {r.get('ms_per_step', r.get('error'))}" for r in report["results"])
print(f"{name}: {seconds} s, exit code {code}; ms per step: {rows}")
EOF
}

graphs() {  # GRAPHS, or the first mode that ran without an error in the equality phase
    if [[ -n $GRAPHS ]]; then
        echo "$GRAPHS"
        return
    fi
    "$PY" - "$WORK/results/equality.json" <<'EOF'
import json
import sys

try:
    usable = json.load(open(sys.argv[1]))["graphs_ok"]
except (OSError, ValueError, KeyError):
    usable = {}
print(next((mode for mode in ("step", "selection", "off") if usable.get(mode, True)), "off"))
EOF
}

rank_shape() {  # one rank's share of the 70B shape at tensor-parallel size $1
    if [[ -n $RANK_SHAPE ]]; then echo "$RANK_SHAPE"; else echo "llama-3-70b-tp$1-rank"; fi
}

phase_bench2() { bench_run tp2 2 "$SHAPE" "$POLICIES" "$LIMIT_BENCH"; }
phase_bench4() {
    if [[ ${TINY:-0} == 1 ]]; then  # the tiny shape's 2 KV heads do not split over 4 ranks
        bench_run tp4 2 "$SHAPE" "$POLICIES" "$LIMIT_BENCH"
    else
        bench_run tp4 4 "$SHAPE" "$POLICIES" "$LIMIT_BENCH"
    fi
}
phase_rank2() { bench_run rank2 0 "$(rank_shape 2)" infinigen "$LIMIT_RANK"; }
phase_rank4() { bench_run rank4 0 "$(rank_shape 4)" infinigen "$LIMIT_RANK"; }

# --- the table -----------------------------------------------------------------------------------

phase_table() {
    "$PY" - "$WORK/results" <<'EOF' | tee "$WORK/tp_gpu_table.txt"
"""The equality checks, one table of every bench report so far, and the issue's targets."""
import json
import sys
from pathlib import Path

from infinigen.bench.shapes import SHAPES

reports = {path.stem.removeprefix("tp_gpu_"): json.load(open(path)) for path in sorted(Path(sys.argv[1]).glob("*.json"))}
lines = []
equality = reports.get("equality")
if equality:
    lines.append(
        f"token equality ({equality.get('ranks')} ranks, {equality.get('device', 'cpu')}, torch {equality.get('torch')}, "
        f"transformers {equality.get('transformers')}): {'PASS' if equality.get('passed') else 'FAIL'}"
        + ("" if equality.get("complete") else " (cut off: checks missing)")
    )
    lines += [f"  {c['label']} {c['dtype']:8} {c['check']}: {c['verdict']}" for c in equality["checks"]]
    lines.append("")


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


def rows_of(name: str) -> dict:
    """(policy, batch, context) -> the row, with the memory beyond the weights and the dense KV share
    (a row set apart by ``variant`` is its own policy)."""
    report = reports.get(name) or {"results": []}
    found = {}
    for row in report["results"]:
        peak, dense = row.get("decode_peak_gpu_gb"), dense_kv_gb(report, row)
        weights = report.get("weights_gb")
        beyond = peak - weights if peak is not None and weights is not None else None
        policy = row["policy"] + variant(row)
        found[policy, row["batch"], row["prompt_len"]] = row | {"beyond_gb": beyond, "dense_kv_gb": dense}
    return found


def cell(value, form: str = "{}") -> str:
    return "" if value is None else form.format(value)


header = ("run", "policy", "batch x context", "step ms", "full / this", "hf-off / this", "beyond W GB",
          "of dense KV", "fetched", "H2D GB/s", "error")
table = []
for name in ("tp2", "tp4", "rank2", "rank4"):
    report = reports.get(name)
    if not report:
        continue
    ranks = report.get("ranks", 1)
    lines.append(
        f"{name}: {report['shape']}, {report['layers']} layers, {report['dtype']}, {ranks} rank(s), {report['device']}; "
        f"weights {report['weights_gb']} GB per rank; pinned H2D {report['pinned_h2d_gb_s']} GB/s per rank"
        + (f", {report.get('pinned_h2d_all_ranks_gb_s')} GB/s all ranks copying at once" if ranks > 1 else "")
        + f"; {report.get('wall_s')} s, exit code {report.get('exit_code')}"
        + (" (cut off: the rows it finished)" if report.get("partial") else "")
    )
    rows = rows_of(name)
    for (policy, batch, context), row in rows.items():
        step = row.get("ms_per_step")

        def speedup(other: str) -> str:  # against the same row format where the other ran in it
            same = rows.get((other + variant(row), batch, context)) or rows.get((other, batch, context), {})
            theirs = same.get("ms_per_step")
            return f"{theirs / step:.1f}x" if step and theirs and other != row["policy"] else ""

        beyond, dense = row["beyond_gb"], row["dense_kv_gb"]
        table.append((
            name, policy + cell(row.get("budget"), " {}"), f"{batch} x {context}", cell(step, "{:.2f}"),
            speedup("full"), speedup("hf-offloaded"), cell(beyond, "{:.2f}"),
            f"{beyond / dense:.0%}" if beyond is not None and dense else "", cell(row.get("fraction_fetched"), "{:.3f}"),
            cell(row.get("h2d_gb_s")), (row.get("error") or "")[:70],
        ))
if table:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *table)]
    lines += ["", *("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in (header, *table))]
    lines.append(
        "full / this, hf-off / this: that policy's step over this row's (the speed-up); beyond W: the decode "
        "steps' peak of GPU memory (allocator) less the weights, per rank; of dense KV: that over the rank's share "
        "of a dense 16-bit KV cache of the same layers"
    )

# the issue's targets, where the runs for them exist
targets = []
tp2, tp4, one2, one4 = (rows_of(name) for name in ("tp2", "tp4", "rank2", "rank4"))
for (policy, batch, context), row in tp2.items():
    if not policy.startswith("infinigen") or "reuse off" in policy or not row.get("ms_per_step"):
        continue
    size, step = f"{batch} x {context}", row["ms_per_step"]
    for other, bound in (("full", 10), ("hf-offloaded", 10)):
        theirs = tp2.get((other + variant(row), batch, context)) or tp2.get((other, batch, context), {})
        if theirs.get("ms_per_step"):
            ratio = theirs["ms_per_step"] / step
            label = other + variant(theirs)
            targets.append(f"TP=2 {size}: {policy} {ratio:.1f}x faster than {label} (>= {bound}x: "
                           f"{'met' if ratio >= bound else 'not met'})")
        elif theirs.get("error"):
            targets.append(f"TP=2 {size}: {other} did not run: {theirs['error']}")
    if row["beyond_gb"] is not None and row["dense_kv_gb"]:
        share = row["beyond_gb"] / row["dense_kv_gb"]
        targets.append(f"TP=2 {size}: GPU memory beyond the weights {row['beyond_gb']:.2f} GB per rank = {share:.0%} "
                       f"of its dense KV share {row['dense_kv_gb']:.2f} GB (<= 25%: {'met' if share <= 0.25 else 'not met'})")
    four = tp4.get((policy, batch, context), {}).get("ms_per_step")
    if four:
        targets.append(f"TP=4 / TP=2 {size}: {four / step:.2f} (<= 0.6: {'met' if four / step <= 0.6 else 'not met'})")
    for ranks, per_rank, tp_rows in ((2, one2, tp2), (4, one4, tp4)):
        alone = per_rank.get((policy, batch, context), {}).get("ms_per_step")
        mine = tp_rows.get((policy, batch, context), {}).get("ms_per_step")
        if alone and mine:
            targets.append(f"TP={ranks} {size}: rank step / one GPU's on the per-rank shape {mine / alone:.2f} "
                           f"(<= 1.2: {'met' if mine / alone <= 1.2 else 'not met'})")
if targets:
    layers = (reports.get("tp2") or {}).get("layers")
    lines += ["", f"targets (infinigen at the budget run; {layers} of the shape's layers):", *(f"  {t}" for t in targets)]
print("\n".join(lines))
EOF
    cp "$WORK/tp_gpu_table.txt" "$DEST/tp_gpu_table.txt"
    publish
}

status=0
for phase in "$@"; do
    case $phase in
    equality | bench2 | bench4 | rank2 | rank4)
        "phase_$phase" || status=1
        publish
        ;;
    table) ;;
    *)
        echo "unknown phase $phase: equality, bench2, bench4, rank2, rank4, table" >&2
        exit 2
        ;;
    esac
done
phase_table
exit $status
