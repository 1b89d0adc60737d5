"""The equality phase of ``tp_gpu.py``, in its own processes: the tiny random Llama it checks, and the
worker torchrun runs on each rank.

    python benchmarks/tp_equality.py tiny-model FOLDER
    torchrun --nproc-per-node 2 benchmarks/tp_equality.py worker FOLDER ARTIFACT_FOLDER REPORT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

import infinigen
from infinigen.artifacts import Artifact, open_artifact, save_artifact
from infinigen.models import load_model
from infinigen.prepare import prepare_artifact
from infinigen.prepare.calibration import bundled_text
from infinigen.runtime import cache_argument
from infinigen.runtime.text import generate_text
from infinigen.tensor_parallel import leave_group, rank, together, world_size

NEW_TOKENS = 40
BLOCK = 256  # pool blocks of 256 tokens: row A's 500-token prompt grows its pool mid-decode (a recapture)
DTYPES = ("float32", "bfloat16")
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
ALPHA_2 = dict(policy="infinigen", budget=0.2, alpha=2.0)
ALPHA = [
    ("alpha 2, eager", ALPHA_2 | dict(cuda_graphs=False), "step", None, True),
    ("alpha 2", ALPHA_2, "step", "alpha 2, eager", True),
    # transformers' loop without selection graphs: tells the loop's own effect from the capture's
    ("alpha 2, transformers' loop, eager", ALPHA_2 | dict(cuda_graphs=False), "loop", "alpha 2, eager", True),
    ("alpha 2, transformers' loop", ALPHA_2, "loop", "alpha 2, eager", True),
]


def make_tiny_model(folder: str) -> None:
    """A tiny random Llama (4 layers, 8 query / 4 KV heads of 128 dims: divisible by 2 and 4 ranks) and a
    word-level tokenizer trained on the bundled calibration text, saved as a checkpoint folder."""
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
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def say0(*parts: object) -> None:
    if rank() == 0:
        print(*parts, flush=True)


def prompt_text(tokenizer: PreTrainedTokenizerFast, start: int, tokens: int) -> str:
    """The most words of the bundled text from word ``start`` that make at most ``tokens`` tokens."""
    words = bundled_text().split()[start:]
    n = tokens
    while len(tokenizer(" ".join(words[:n])).input_ids) > tokens:
        n -= 1
    return " ".join(words[:n])


def generated(model: PreTrainedModel, inputs: dict, artifact: Artifact, settings: dict, how: str) -> tuple[list, float]:
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


def equality_worker(folder: str, artifact_folder: str, out: str) -> None:
    """Under torchrun: one checkpoint loaded through infinigen's loading path (transformers' tensor
    parallelism) in float32 and bfloat16, its artifact prepared on the sharded model, then token equality
    between caches. The report is rewritten after every check: a run cut off keeps what it finished."""
    report: dict = {"ranks": world_size(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        report |= {"device": torch.cuda.get_device_name(), "nccl": str(torch.cuda.nccl.version())}
    report |= {"checks": [], "passed": False, "complete": False, "graphs_ok": {}}
    say0(f"equality: {report}")

    def save() -> None:
        if rank() == 0:
            Path(out).write_text(json.dumps(report, indent=2))

    subjects, results = {}, {}
    raised = set()  # the modes (step, selection, off) of the runs that raised an error, not a token difference
    for dtype in DTYPES:
        loaded = load_model(folder, dtype=dtype)  # sharded over the ranks: WORLD_SIZE > 1
        model, tokenizer = loaded.model, loaded.tokenizer
        if dtype == "float32":
            prepared = prepare_artifact(loaded, tokens=512)  # every rank gathers every head
            if rank() == 0:
                save_artifact(prepared, artifact_folder, card="tiny random Llama (tp_gpu.py)", force=True)
            together()
        artifact = open_artifact(artifact_folder, model)  # checked against the sharded weights
        tokenizer.padding_side = "left"
        texts = [prompt_text(tokenizer, 0, 500), prompt_text(tokenizer, 1000, 300)]
        inputs = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
        say0(f"{dtype}: {model.device}, prompts of {inputs['attention_mask'].sum(-1).tolist()} tokens")
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
                    got = results[dtype, name]
                    verdict = "equal" if reference is None else divergence(got, results[dtype, reference])
                except Exception as exc:  # noqa: BLE001 - a failure is this check's result
                    verdict, seconds = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}", 0.0
                    results[dtype, name], hard, ran = None, True, False
                    if not isinstance(exc, (TypeError, KeyError)):  # those: its reference failed
                        eager = settings.get("cuda_graphs") is False
                        raised.add("off" if eager else {"loop": "selection"}.get(how, how))
                rounding = ran and dtype != "float32" and reference == "dense"
                label = "PASS" if verdict == "equal" else ("FAIL" if hard and not rounding else "INFO")
                what = name if reference is None else f"{name} vs {reference}"
                say0(f"  {label} {dtype:8} {what}: {verdict} ({seconds:.1f} s)")
                check = dict(dtype=dtype, check=what, verdict=verdict, label=label, seconds=round(seconds, 2))
                report["checks"].append(check)
                report["passed"] = all(c["label"] != "FAIL" for c in report["checks"])
                # what bench's --graphs may use: a mode whose runs raised (a capture failing with NCCL, say) is not
                report["graphs_ok"] = {mode: mode not in raised for mode in ("step", "selection", "off")}
                save()
    report["complete"] = True
    save()
    say0(f"equality (API): {'PASS' if report['passed'] else 'FAIL'}")
    leave_group()


def cli_check(path: Path, printed_text: str) -> list[str]:
    """Whether `infinigen generate` under torchrun printed rank 0's JSON alone, with dense's text; the
    check joins the report at ``path``."""
    report = json.loads(path.read_text())
    try:
        printed = json.loads(printed_text)  # rank 0's JSON alone: a second rank's output would break it
        verdict = "equal" if printed["outputs"][0] == report["cli_reference"] else "differs"
        stats = printed["stats"]
    except (ValueError, KeyError, IndexError) as exc:
        verdict, stats = f"no single JSON report on stdout ({type(exc).__name__}): {printed_text[:200]!r}", {}
    label = "PASS" if verdict == "equal" else "FAIL"
    check = "infinigen generate (CLI) vs dense"
    report["checks"].append(dict(dtype="float32", check=check, verdict=verdict, label=label))
    report["cli_stats"] = {k: v for k, v in stats.items() if k != "per_layer"}
    report["passed"] = report["passed"] and label == "PASS"
    path.write_text(json.dumps(report, indent=2))
    return [
        f"  {label} float32  infinigen generate --budget 1.0 under torchrun vs dense's text: {verdict}",
        f"equality: {'PASS' if report['passed'] else 'FAIL'}"
        + ("" if report["complete"] else " (cut off: checks missing)"),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:  # under torchrun: FOLDER ARTIFACT_FOLDER REPORT
        equality_worker(*sys.argv[2:5])
    elif sys.argv[1:2] == ["tiny-model"]:  # FOLDER
        make_tiny_model(sys.argv[2])
    else:
        sys.exit(f"usage: {__doc__}")
