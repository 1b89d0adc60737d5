"""The command line, through typer's test runner."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import invoke
from helpers import EXACT, tiny_setup
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM

from infinigen import __version__
from infinigen.artifacts import load_artifact
from infinigen.cli import app
from infinigen.runtime import cache_for
from infinigen.runtime.config import DEFAULT_RESIDENT_EXTRA
from infinigen.runtime.text import generate_text


def test_runtime_options_come_from_runtime_config():
    """Every command's runtime options are built from RuntimeConfig's fields: same names, help and
    defaults (a sweep's default is the field's unless the command compares others)."""
    import dataclasses

    import typer.main

    from infinigen.cli.options import DECODE_ONLY, cli_fields, option_name
    from infinigen.runtime import RuntimeConfig

    fields = cli_fields()
    assert {f.name for f in fields} >= {"policy", "budget", "alpha", "partial_key_bits", "reuse_rows", "reuse_gpu_gb"}
    group = typer.main.get_command(app)
    commands = {"generate": group.commands["generate"], "bench": group.commands["bench"]}
    commands |= {f"eval {name}": group.commands["eval"].commands[name] for name in ("ppl", "tasks", "needle")}
    for label, command in commands.items():
        params = {p.name: p for p in command.params}
        decodes = label in ("generate", "eval needle")  # the others time single steps or score teacher-forced
        for f in fields:
            if f.name in DECODE_ONLY and not decodes:
                assert f.name not in params, (label, f.name)
                continue
            param = params[f.name]
            assert param.help.startswith(f.metadata["help"]), (label, f.name)
            assert option_name(f.name) in param.opts, (label, f.name)
        if label == "generate":
            assert all(params[f.name].default == f.default for f in fields)
    assert {f.name for f in dataclasses.fields(RuntimeConfig)} - {f.name for f in fields} == {
        f.name for f in dataclasses.fields(RuntimeConfig) if not f.metadata["cli"]
    }


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_models_json():
    listing = json.loads(invoke("models", "--json").stdout)
    assert listing["aliases"]["opt-13b"] == "facebook/opt-13b" and "qwen3" in listing["architectures"]


def test_prepare_opt_checkpoint_with_skewed_model(checkpoint, tmp_path):
    folder = checkpoint("opt")
    out = tmp_path / "skewed"
    result = invoke(
        "prepare", str(folder), "--out", str(out), "--tokens", "128", "--save-model", "--json", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out) and summary["calibration_tokens"] == 128
    assert load_artifact(out).manifest.spec["model_type"] == "opt"
    # The skewed checkpoint is plain transformers and gives the original's logits.
    original = AutoModelForCausalLM.from_pretrained(folder)
    skewed = AutoModelForCausalLM.from_pretrained(out / "skewed-model")
    ids = torch.randint(0, 512, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(skewed(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)


def test_prepare_llama_checkpoint_and_inspect(checkpoint, tmp_path):
    out = tmp_path / "skewed"
    calibration = tmp_path / "text.txt"
    calibration.write_text("the house was old and the street was narrow " * 40)
    result = invoke(
        "prepare", str(checkpoint("llama")), "--out", str(out), "--calibration", str(calibration), "--ratio", "0.5"
    )
    assert result.exit_code == 0, result.output
    assert "score energy in the kept channels" in result.output
    assert result.output.count("skew per layer") == 1, "one progress bar per stage, not one per layer"
    manifest = json.loads(invoke("inspect", str(out), "--json").stdout)
    assert manifest["n_channels"] == 8 and manifest["calibration"]["sources"][0]["name"] == str(calibration)
    table = " ".join(invoke("inspect", str(out)).output.split())  # words only: long lines wrap
    assert "energy after" in table and "llama (3 layers, 4 heads, 2 KV heads, head_dim 16)" in table


def test_main_job_default_model(tmp_path):
    """The README's main job: prepare, then generate, on the embedded SmolLM2."""
    out = tmp_path / "skewed"
    result = invoke("prepare", "--out", str(out), "--tokens", "512", "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["base_model"] == "smollm2-135m" and summary["energy_after"] > summary["energy_before"]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (out / "README.md").read_text()
    prompt = "The old house on the corner of the street had stood there for a hundred years, and it was"
    result = invoke("generate", "--artifact", str(out), "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "decode tok s" in result.stdout and "fraction fetched" in result.stdout


@pytest.mark.parametrize(("arch", "offloaded"), [("llama", {"2"}), ("gemma3", {"3", "5"})])
def test_generate_batch_json(prepared, tmp_path, arch, offloaded):
    """Prepare a checkpoint folder, then decode a batch from it; on tiny Gemma 3 only the full-attention
    layers are offloaded (the sliding-window ones keep their window on the device). On the CPU auto
    reuses rows only to attend rows of earlier steps; with the selection alone, reuse keeps the text
    and moves fewer bytes."""
    folder, out = prepared(arch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the house was old\nand the street was narrow and the walls were\n")
    args = ("generate", str(folder), "--artifact", str(out), "--batch-file", str(prompts))
    args += ("--max-new-tokens", "6", "--json", "--device", "cpu", "--budget", "0.5")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["outputs"]) == 2 and report["stats"]["batch"] == 2
    assert report["stats"]["new_tokens"] == 6 and 0 < report["stats"]["fraction_fetched"] <= 1
    assert report["stats"]["bytes_host_to_device"] > 0 and set(report["stats"]["per_layer"]) == offloaded
    assert report["stats"]["reuse_rows"] == "on (auto: CPU, to attend rows of earlier steps as on a GPU)"
    assert report["stats"]["resident_extra"] == DEFAULT_RESIDENT_EXTRA
    assert report["stats"]["kv_bits"] == 8 and report["stats"]["resident_bits"] == 16  # the defaults, as they ran
    assert report["stats"]["fraction_attended"] > report["stats"]["fraction_fetched"]
    selection_only = ("--resident-extra", "0")
    plain = invoke(*args, *selection_only)  # nothing to attend besides the selection: auto leaves reuse off
    assert plain.exit_code == 0, plain.output
    plain_report = json.loads(plain.stdout)
    assert plain_report["stats"]["reuse_rows"] == "off (auto: CPU, no transfers to save)"
    assert plain_report["stats"]["fraction_attended"] == plain_report["stats"]["fraction_fetched"]
    reusing = invoke(*args, "--reuse-rows", "on", *selection_only)  # rows kept between steps: same text, fewer bytes
    assert reusing.exit_code == 0, reusing.output
    again = json.loads(reusing.stdout)
    assert again["outputs"] == plain_report["outputs"] and again["stats"]["reuse_rows"] == "on (asked)"
    assert again["stats"]["resident_extra"] == 0.0
    assert again["stats"]["bytes_host_to_device"] < plain_report["stats"]["bytes_host_to_device"]


def test_generate_plans_its_memory_before_the_weights_load(prepared, monkeypatch):
    """Under a GPU budget the run is planned from the config: a budget that fits gives the same text as
    none, with the plan in the summary; one the weights alone exceed is refused in one line, before any
    weight loads."""
    folder, out = prepared("llama")
    args = ("generate", str(folder), "--artifact", str(out), "--prompt", "the house was old", "--device", "cpu")
    args += ("--max-new-tokens", "6", "--json")
    free, planned = invoke(*args), invoke(*args, "--gpu-memory-gb", "2")
    assert free.exit_code == 0 and planned.exit_code == 0, planned.output
    report = json.loads(planned.stdout)
    assert report["outputs"] == json.loads(free.stdout)["outputs"]
    plan = report["stats"]["memory_plan"]
    assert (
        plan["gpu_budget_gb"] == float(f"{2 - 600 * 2**20 / 1e9:.4g}") and 0.1 < plan["planned_peak_gpu_gb"] < 0.2
    )  # cuBLAS: 0.1
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    refused = invoke(*args, "--gpu-memory-gb", "0.6")
    assert refused.exit_code == 2 and "does not fit:" in refused.output and "the weights alone" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not loads


def test_generate_pins_its_pools_while_the_weights_load(prepared, monkeypatch):
    """The prompt's pools are reserved before the weights load (beside it), and the prefill's blocks
    are carved from that reservation; a policy without a pool reserves nothing."""
    from infinigen.runtime.memory import host_memory

    folder, out = prepared("llama")
    events: list[str] = []
    reserve, load = host_memory.reserve_host_memory, AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(host_memory, "_reserved", host_memory.defaultdict(list))
    monkeypatch.setattr(host_memory, "_retired", [])  # no blocks of an earlier test's caches to reuse
    monkeypatch.setattr(host_memory, "reserve_host_memory", lambda *a: (events.append("reserve"), reserve(*a))[1])
    loading = lambda *a, **k: (events.append("weights"), load(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loading)
    carve = host_memory._carve
    carved: list[torch.Tensor | None] = []
    monkeypatch.setattr(host_memory, "_carve", lambda *a: (carved.append(carve(*a)), carved[-1])[1])
    args = ("generate", str(folder), "--artifact", str(out), "--prompt", "the house was old", "--device", "cpu")
    result = invoke(*args, "--max-new-tokens", "6", "--budget", "0.5")
    assert result.exit_code == 0, result.output
    assert events == ["reserve", "weights"] and carved and all(block is not None for block in carved)
    events.clear()
    assert invoke(*args, "--policy", "dense").exit_code == 0
    assert events == ["weights"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "0"], "budget must be in (0, 1]"),
        (["--alpha", "-1"], "alpha must be non-negative"),
        (["--max-new-tokens", "600"], "exceeds the model's context of 512 tokens"),
        (["--cpu-pool-gb", "1e-9"], "fewer than the"),
        (["--policy", "infinigen", "--no-artifact"], "needs an artifact"),
    ],
)
def test_generate_bad_input(prepared, tmp_path, extra, message):
    folder, out = prepared("qwen3")
    artifact = [] if "--no-artifact" in extra else ["--artifact", str(out)]
    extra = [x for x in extra if x != "--no-artifact"]
    result = invoke("generate", str(folder), *artifact, "--prompt", "the house", "--device", "cpu", *extra)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_errors_are_one_line(checkpoint, tmp_path):
    out = tmp_path / "skewed"
    assert invoke("prepare", str(checkpoint("qwen3")), "--out", str(out), "--tokens", "64").exit_code == 0
    again = invoke("prepare", str(checkpoint("qwen3")), "--out", str(out))
    assert again.exit_code == 2 and "already exists: pass --force" in again.output
    (out / "skew.safetensors").write_bytes(b"\0" * 10)
    broken = invoke("inspect", str(out))
    assert broken.exit_code == 2 and "corrupted" in broken.output and "Traceback" not in broken.output
    assert len(broken.output.strip().splitlines()) == 1
    bad_ratio = invoke("prepare", str(checkpoint("qwen3")), "--out", str(tmp_path / "x"), "--ratio", "1.5")
    assert bad_ratio.exit_code == 2 and "--ratio must be in (0, 1]" in bad_ratio.output
    llama_save = invoke("prepare", str(checkpoint("llama")), "--out", str(tmp_path / "y"), "--save-model")
    assert llama_save.exit_code == 2 and "OPT only" in llama_save.output


def test_push(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "skewed"
    invoke("prepare", str(checkpoint("qwen2")), "--out", str(out), "--tokens", "64")
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(
        HfApi, "upload_folder", lambda self, **kw: SimpleNamespace(commit_url=f"https://hf.co/{kw['repo_id']}/commit/1")
    )
    result = invoke("push", str(out), "--repo-id", "me/tiny")
    assert result.exit_code == 0 and "https://hf.co/me/tiny/commit/1" in result.output


def test_generate_out_of_memory_is_one_line(prepared, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    folder, out = prepared("llama")

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LlamaForCausalLM, "generate", no_memory)
    result = invoke("generate", str(folder), "--artifact", str(out), "--prompt", "the house", "--device", "cpu")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "out of cpu memory: weights" in result.output and "1 of 3 layers offloaded" in result.output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--bogus"], "No such option: --bogus"),
        (["generate", "--budget", "abc"], "Invalid value for '--budget'"),
        (["eval", "ppl", "--text", "x.txt", "--window", "many"], "Invalid value for '--window'"),
        (["evaluate"], "No such command 'evaluate'"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["generate", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
        (["generate", "--input", "x.jsonl", "--output", "y", "--max-batch", "0"], "--max-batch must be at least 1"),
        (["generate", "--input", "missing.jsonl", "--output", "y.jsonl", "--chat"], "--input takes no"),
        (["generate", "--input", "missing.jsonl", "--output", "y.jsonl"], "cannot read missing.jsonl"),
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt", "x", "--alpha", "nan"], "alpha must be non-negative"),
        (["generate", "--prompt", "x", "--budget", "nan"], "budget must be in (0, 1]"),
        (["generate", "--prompt", "x", "--policy", "best"], "unknown policy 'best'"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["bench", "--policy", "dense,best"], "--policies takes dense, full"),
        (["bench", "--budget", "0.1,x"], "--budgets takes float values"),
        (["bench", "--reuse-rows", "maybe"], "--reuse-rows takes auto, on, off"),
        (["eval", "ppl", "--text", "x.txt", "--alpha", "nan"], "--alpha takes a number"),
        (["eval", "ppl", "--text", "x.txt", "--cpu-pool-fraction", "2"], "--cpu-pool-fraction must be in (0, 1]"),
        (["generate", "--prompt", "x", "--artifact", "./no-artifact"], "artifact './no-artifact' not found"),
        (["eval", "ppl", "--text", __file__, "--artifact", "./no-artifact"], "artifact './no-artifact' not found"),
        (["bench", "--model", "smollm2-135m", "--artifact", "./no-artifact"], "artifact './no-artifact' not found"),
    ],
)
def test_bad_command_lines_are_one_line_before_any_model_loads(argv, message, monkeypatch):
    """Flags a user can fix: one line, exit code 2, and no model loaded to find out."""

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the command line was checked")

    monkeypatch.setattr("infinigen.models.load_model", no_loading)
    result = invoke(*argv)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ratio", "1.5"], "--ratio must be in (0, 1]"),
        (["--ratio", "nan"], "--ratio must be in (0, 1]"),
        (["--tokens", "4"], "--tokens must be at least 16"),
        (["--calibration", "missing.txt"], "cannot read calibration file missing.txt"),
        (["--skew", "qr"], "--skew takes svd, identity"),
    ],
)
def test_prepare_checks_its_options_before_loading_the_model(extra, message, monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("infinigen.models.load_model", no_loading)
    result = invoke("prepare", "--out", str(tmp_path / "out"), *extra)
    assert result.exit_code == 2 and message in result.output, result.output


def test_generate_samples_with_a_seed(prepared):
    """--temperature samples; the same --seed gives the same text, and greedy (the default) is repeatable."""
    folder, out = prepared("llama")
    args = ["generate", str(folder), "--artifact", str(out), "--prompt", "the house", "--device", "cpu", "--json"]
    args += ["--max-new-tokens", "8"]

    def text(*extra: str) -> str:
        result = invoke(*args, *extra)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["outputs"][0]

    sampled = [text("--temperature", "1.5", "--top-k", "50", "--seed", str(seed)) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    assert text() == text()


def test_unsupported_architecture_refused_from_its_config(tmp_path, monkeypatch):
    """The architecture is checked from config.json: the weights are never read."""
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    folder.mkdir()
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the architecture was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    result = invoke("generate", str(folder), "--prompt", "x", "--policy", "dense", "--device", "cpu")
    assert result.exit_code == 2 and "unsupported architecture 'gpt2'" in result.output, result.output


def test_generate_text_left_pads_without_touching_the_tokenizer(tokenizer):
    """A batch of two prompts, left-padded by generate_text itself: each decodes as it does alone, and
    the caller's tokenizer keeps its padding side and pad token."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    prompts = ["the quick brown fox jumps", "over"]
    batch, _ = generate_text(model, tokenizer, prompts, cache_for(model, artifact, **EXACT), max_new_tokens=4)
    alone = [
        generate_text(model, tokenizer, [p], cache_for(model, artifact, **EXACT), max_new_tokens=4)[0][0]
        for p in prompts
    ]
    assert batch == alone
    assert (tokenizer.padding_side, tokenizer.pad_token) == (side, pad)
