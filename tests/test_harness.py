"""The lm-evaluation-harness model: scoring and generation through the runtime (lm-eval itself only
for the last tests, skipped without it)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EXACT, tiny_setup

from infinigen.errors import InfinigenError
from infinigen.eval.harness import HarnessModel, cut, harness_settings, runtime_settings

REQUESTS = [
    ("the cat sat on the", " mat and the dog"),
    ("one two three four five six seven eight nine ten eleven", " twelve"),
    ("", "a sentence without a context"),
    ("of the ", "same words"),
]


def dense_reference(model, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(log-likelihood, is greedy) from one plain transformers forward per pair."""
    scores = []
    with torch.no_grad():
        for context, continuation in pairs:
            logits = model(torch.tensor([context + continuation]), use_cache=False).logits[0, len(context) - 1 : -1]
            target = torch.tensor(continuation)
            logprob = logits.float().log_softmax(-1).gather(-1, target[:, None]).sum()
            scores.append((float(logprob), bool((logits.argmax(-1) == target).all())))
    return scores


def harness(tokenizer, arch: str = "llama", batch_size: int = 3, **settings) -> HarnessModel:
    model, artifact = tiny_setup(tokenizer, arch, "cpu")
    return HarnessModel(model, tokenizer, artifact, runtime_settings(settings), batch_size=batch_size)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_budget_one_gives_dense_loglikelihoods(tokenizer, arch):
    """policy=infinigen at budget 1.0 (no other setting), policy=dense and a plain forward agree."""
    sparse = harness(tokenizer, arch, policy="infinigen", **EXACT)
    dense = HarnessModel(sparse.model, tokenizer, sparse.artifact, {"policy": "dense"}, batch_size=2)
    pairs = [sparse.encode_pair(context, continuation) for context, continuation in REQUESTS]
    expected = dense_reference(sparse.model, pairs)
    for got in (sparse.loglikelihood(REQUESTS), dense.loglikelihood(REQUESTS)):
        assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
        for (logprob, _), (reference, _) in zip(got, expected, strict=True):
            assert math.isclose(logprob, reference, abs_tol=1e-4), (got, expected)


def test_requests_are_refused_where_their_batch_does_not_fit(tokenizer):
    """Each batch of requests is planned under the GPU budget before its cache is made: one that does not
    fit is one line (``InfinigenError``), scoring and generation alike."""
    model = harness(tokenizer, policy="infinigen", gpu_memory_gb=0.5)
    with pytest.raises(InfinigenError, match=r"^does not fit: \d x .* the weights alone do not fit"):
        model.loglikelihood(REQUESTS[:3])
    with pytest.raises(InfinigenError, match="^does not fit: 1 x .* the weights alone do not fit"):
        model.generate_until([("the cat", {"max_gen_toks": 2})])


def test_greedy_continuation_is_flagged(tokenizer):
    """A continuation made of the model's own argmax tokens is greedy; one token changed is not."""
    model = harness(tokenizer, policy="infinigen", **EXACT)
    context = model.encode("the cat sat on the")
    greedy = []
    with torch.no_grad():
        for _ in range(4):
            greedy.append(int(model.model(torch.tensor([context + greedy])).logits[0, -1].argmax()))
    other = greedy[:2] + [(greedy[2] + 1) % 512] + greedy[3:]
    scores = model.score_tokens([(context, greedy), (context, other), ([model.prefix_token_id], greedy)])
    assert scores[0][1] and not scores[1][1]
    assert scores[0][0] > scores[1][0]


def test_tokenization_follows_hflm(tokenizer):
    model = harness(tokenizer)
    context, continuation = model.encode_pair("the cat sat on the ", "mat")
    assert context + continuation == model.encode("the cat sat on the mat")
    assert model.encode_pair("", "mat") == ([tokenizer.bos_token_id], model.encode("mat", special=False))


def test_rolling_loglikelihood_covers_every_token(tokenizer):
    """Disjoint windows of max_length tokens: the sum over windows is the text's whole log-likelihood,
    the first token conditioned on BOS; with one window it equals a plain forward's."""
    model = harness(tokenizer, policy="infinigen", **EXACT)
    text = "the cat sat on the mat and the dog sat on the cat and the bird flew over them all"
    ids = model.encode(text, special=False)
    model.max_length = 8
    windows = model.rolling_windows(text)
    assert [len(c) for _, c in windows] == [8, 8, len(ids) - 16] and sum((c for _, c in windows), []) == ids
    assert windows[1][0] == [ids[7]]
    model.max_length = 512
    (whole,) = model.loglikelihood_rolling([text])
    ((reference, _),) = dense_reference(model.model, [([tokenizer.bos_token_id], ids)])
    assert math.isclose(whole, reference, abs_tol=1e-4)


def test_generation_is_greedy_decoding_cut_at_until(tokenizer):
    model = harness(tokenizer, policy="infinigen", **EXACT)
    prompt = "the cat sat on the"
    ids = model.encode(prompt)
    with torch.no_grad():
        expected = model.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=1)
    text = tokenizer.decode(expected[0, len(ids) :], skip_special_tokens=True)
    requests = [(prompt, {"max_gen_toks": 6, "until": []}), ("a longer prompt than the first one", {"max_gen_toks": 3})]
    outputs = model.generate_until(requests)
    assert outputs[0] == text and outputs[1]
    stop = text.split()[2]
    assert model.generate_until([(prompt, {"max_gen_toks": 6, "until": [stop]})]) == [cut(text, [stop])]
    assert cut("a b. c", ["\n", "."]) == "a b"


def test_requests_alone_start_from_the_prompts_they_share(tokenizer):
    """batch_size 1: a request scored or generated alone is served the longest kept prompt it shares (here every
    choice's context and the passage before each question), and scores and answers as it does computed whole."""
    settings = {"policy": "infinigen", "budget": 0.25, "kv_bits": 16}  # 8-bit rows: cut past the first chunk only
    kept = harness(tokenizer, batch_size=1, **settings)
    whole = HarnessModel(kept.model, tokenizer, kept.artifact, settings | {"prompt_cache_gb": 0}, batch_size=1)
    passage = " ".join(["the cat sat on the mat and the dog sat on the cat"] * 4)
    choices = [(passage + " and then the", ending) for ending in (" bird", " dog ran", " cat")]
    asked = [(passage + question, {"max_gen_toks": 4, "until": []}) for question in (" where", " who sat on the")]
    assert whole.prompts is None and kept.prompts is not None
    scores = kept.loglikelihood(choices)
    assert kept.prompts.hits == 2  # the second and third choices: their context, kept by the first
    for (logprob, greedy), (reference, greedy_whole) in zip(scores, whole.loglikelihood(choices), strict=True):
        assert math.isclose(logprob, reference, abs_tol=1e-4) and greedy == greedy_whole
    assert kept.generate_until(asked) == whole.generate_until(asked)
    assert kept.prompts.hits == 3  # the second question: the passage, kept by the first


def test_model_args_are_runtime_settings():
    assert runtime_settings({"policy": "quest", "budget": 1, "alpha": "inf", "reuse_rows": True}) == {
        "policy": "quest",
        "budget": 1.0,
        "alpha": math.inf,
        "reuse_rows": "on",
    }
    with pytest.raises(InfinigenError, match="unknown model args budgets"):
        runtime_settings({"budgets": 0.1})
    with pytest.raises(InfinigenError, match="budget"):
        runtime_settings({"budget": 2})


def test_lm_eval_model_scores_instances(tokenizer):
    """The registered lm-eval model answers Instance requests with the harness model's scores."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from infinigen.eval.harness import InfinigenLM

    assert get_model("infinigen") is InfinigenLM
    model = harness(tokenizer, policy="infinigen", **EXACT)
    lm = InfinigenLM.of(model)
    requests = [
        Instance("loglikelihood", {}, (context, continuation), i) for i, (context, continuation) in enumerate(REQUESTS)
    ]
    pairs = [model.encode_pair(context, continuation) for context, continuation in REQUESTS]
    expected = dense_reference(model.model, pairs)
    got = lm.loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in expected]
    assert all(math.isclose(a, b, abs_tol=1e-4) for (a, _), (b, _) in zip(got, expected, strict=True))
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("the cat sat",), 0)])
    assert rolling[0] < 0
    generated = lm.generate_until([Instance("generate_until", {}, ("the cat", {"max_gen_toks": 2}), 0)])
    assert len(generated) == 1 and isinstance(generated[0], str)


def test_model_args_win_over_lm_evals_own_flags(checkpoint):
    """lm-eval passes its --batch_size / --device beside --model_args: both may be given, and the
    model args win (a duplicate keyword was a traceback)."""
    pytest.importorskip("lm_eval")
    from infinigen.eval.harness import InfinigenLM

    folder = checkpoint("llama")
    flags = {"batch_size": 1, "max_batch_size": None, "device": "cuda:7"}
    lm = InfinigenLM.create_from_arg_string(f"pretrained={folder},policy=dense,device=cpu,batch_size=2", flags)
    assert lm.harness.batch_size == 2 and lm.device.type == "cpu"
    assert (
        InfinigenLM.create_from_arg_string(f"pretrained={folder},policy=dense,device=cpu", flags).harness.batch_size
        == 1
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_lm_evals_default_device_falls_back_to_the_cpu(capsys):
    """lm-eval names cuda unless told otherwise: without a GPU its default becomes the CPU (said on stderr);
    a device in the model args is the user's own and stays (refused where it cannot run)."""
    settings = harness_settings({"pretrained": "smollm2-135m"}, {"device": "cuda:0", "batch_size": 4})
    assert settings == {"pretrained": "smollm2-135m", "device": "cpu", "batch_size": 4}
    assert "no CUDA device: running on the CPU instead of lm-eval's cuda:0" in capsys.readouterr().err
    asked = harness_settings({"device": "cuda"}, {"device": "cuda:0", "batch_size": None})
    assert asked == {"device": "cuda"}
    assert harness_settings({"batch_size": 2}, {"batch_size": 8}) == {"batch_size": 2}


def test_the_harness_entry_point_without_lm_eval_is_one_line():
    """``python -m infinigen.eval.harness`` where lm-eval is not installed: one line and exit code 2."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm-eval is installed here")
    command = [sys.executable, "-m", "infinigen.eval.harness", "--tasks", "x"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: lm-eval is not installed: pip install 'infinigen[lm-eval]'"
    ]


def test_load_checks_the_policy_against_its_artifact_at_once(prepared):
    """``HarnessModel.load`` (lm-eval's entry) opens a cache once: a policy without the artifact it needs is
    refused before any request, in one line."""
    folder, out = prepared("llama")
    loaded = HarnessModel.load(str(folder), str(out), device="cpu", policy="infinigen", budget="0.5")
    assert loaded.settings["policy"] == "infinigen" and loaded.settings["budget"] == 0.5
    with pytest.raises(InfinigenError, match="needs an artifact"):
        HarnessModel.load(str(folder), None, device="cpu", policy="infinigen")
