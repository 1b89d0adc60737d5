"""Teacher-forced scoring through the runtime."""

from __future__ import annotations

import json
import math

import torch
from helpers import EXACT, tiny_setup

from infinigen.eval.decoding import dense_forward_nll, read_text, teacher_forced_nll
from infinigen.eval.perplexity import perplexity
from infinigen.runtime import cache_for
from infinigen.runtime.config import DEFAULT_RESIDENT_EXTRA


def test_dense_runtime_perplexity_equals_full_forward(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(0))
    reference = dense_forward_nll(model, ids, prefix=40)
    through_runtime = teacher_forced_nll(model, cache_for(model, artifact, policy="dense"), ids, prefix=40)
    assert through_runtime.shape == (2, 56)
    assert math.isclose(float(through_runtime.mean().exp()), float(reference.mean().exp()), rel_tol=1e-4)
    exact_sparse = teacher_forced_nll(model, cache_for(model, artifact, **EXACT), ids, prefix=40)
    torch.testing.assert_close(exact_sparse, reference, rtol=1e-4, atol=1e-4)


def test_perplexity_report(tokenizer):
    model, artifact = tiny_setup(tokenizer, "qwen3", "cpu")
    ids = torch.randint(3, 512, (3, 80), generator=torch.Generator().manual_seed(1))
    report = perplexity(model, artifact, ids, 16, batch=2, block=32, policy="infinigen", budget=0.25)
    assert report["tokens_scored"] == 3 * 64 and len(report["block_perplexity"]) == 2
    assert 0 < report["fraction_fetched"] <= 0.25 + 1 / 16 and report["perplexity"] > 1
    json.dumps(report)


def test_perplexity_runs_as_the_memory_plan_says(tokenizer):
    """Each row reports its plan; under a budget its weights alone exceed, the row says so and the sweep
    goes on (no cache made)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (2, 80), generator=torch.Generator().manual_seed(1))
    fits = perplexity(model, artifact, ids, 16, batch=2, policy="infinigen", gpu_memory_gb=1.0)
    assert fits["perplexity"] > 1 and 0.1 < fits["memory_plan"]["planned_peak_gpu_gb"] < 0.11
    short = perplexity(model, artifact, ids, 16, batch=2, policy="infinigen", gpu_memory_gb=0.5)
    assert short["error"].startswith("does not fit: 2 x 16 tokens (+63 new) with infinigen needs")
    assert short["error"].endswith("the weights alone do not fit") and "perplexity" not in short


def test_gutenberg_header_is_stripped(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(
        "licence blah\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nThe story.\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nmore licence"
    )
    assert read_text(book).strip() == "The story."


def test_limited_pool_evicts_during_evaluation(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(3))
    report = perplexity(model, artifact, ids, 40, batch=2, pool_fraction=0.5, policy="infinigen", budget=0.5)
    assert report["evicted_tokens"] == 2 * (95 - 48)  # 48-slot pool, 95 tokens stored per row
    assert report["pool_fraction"] == 0.5 and report["perplexity"] > 1


def test_selection_recall_is_one_for_the_oracle_and_below_for_speculation(tokenizer):
    """The probe scores the step's selection against the exact top-k: the oracle's recall is 1, also
    where row reuse holds its rows in other positions, and where rows of earlier steps are attended
    beside the selection (the default resident_extra: they are not scored)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(4))
    scored = dict(batch=2, recall=True, resident_extra=0.0, kv_bits=16)  # the oracle scores the rows as moved
    oracle = perplexity(model, artifact, ids, 48, **scored, policy="oracle", budget=0.25)
    assert oracle["recall"] == 1.0 and set(oracle["recall_per_layer"]) == {2} and oracle["kv_bits_applied"] == 16
    assert oracle["resident_extra_applied"] == 0.0 and oracle["fraction_attended"] == oracle["fraction_fetched"]
    blocks = perplexity(model, artifact, ids, 48, **scored, policy="oracle", budget=0.25, block_tokens=16)
    assert blocks["recall"] == 1.0  # the true scores are read block by block from the pool
    reused = perplexity(model, artifact, ids, 48, **scored, policy="oracle", budget=0.25, reuse_rows="on")
    assert reused["recall"] == 1.0 and reused["fraction_moved"] < reused["fraction_fetched"]
    wider = perplexity(model, artifact, ids, 48, batch=2, recall=True, policy="oracle", budget=0.25, kv_bits=16)
    assert wider["resident_extra_applied"] == DEFAULT_RESIDENT_EXTRA
    assert wider["fraction_attended"] > wider["fraction_fetched"]
    assert wider["recall"] == 1.0
    speculated = perplexity(model, artifact, ids, 48, **scored, policy="quest", budget=0.25)
    assert 0 < speculated["recall"] < 1
    exact = perplexity(model, artifact, ids, 48, **(scored | EXACT), policy="infinigen")
    assert exact["recall"] == 1.0


def test_selection_recall_reads_8_bit_rows_as_their_values(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(4))
    wide, narrow = (
        perplexity(model, artifact, ids, 48, batch=2, recall=True, policy="infinigen", budget=0.25, kv_bits=bits)
        for bits in (16, 8)
    )
    assert 0 < narrow["recall"] < 1 and abs(narrow["recall"] - wide["recall"]) < 0.05


def test_pool_fraction_holds_the_asked_tokens_for_every_row_size(tokenizer):
    """--cpu-pool-fraction sizes the pool by the rows a policy stores: compressed int4 rows hold as
    many tokens as 16-bit ones are asked to, not several times more."""
    from infinigen.eval.perplexity import pool_settings

    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    for policy in ("full", "int4", "infinigen"):
        settings = {"policy": policy, "budget": 0.5} | pool_settings(model, {"policy": policy}, tokens=64, batch=2)
        cache = cache_for(model, artifact, **settings)
        assert cache.pool_limit(2, model.dtype) == 64, policy


def test_auto_batch_is_the_most_windows_the_plan_admits(tokenizer):
    """``eval ppl --batch 0`` off a GPU: the most rows whose plan fits the budget, at most the windows; all of
    them without a budget; 1 where not even one fits (that row then says why)."""
    from infinigen.eval.decoding import auto_batch, planned
    from infinigen.runtime.memory.plan import CONTEXT_BYTES

    model, _ = tiny_setup(tokenizer, "llama", "cpu")
    settings = dict(policy="infinigen", budget=0.5, streamed_layers=0)
    assert auto_batch(model, settings, 3, 32, 31) == 3

    def least(batch: int) -> int:  # GPU bytes with everything shed (the plan's last try under a tiny budget)
        return planned(model, settings | {"gpu_memory_gb": 0.01}, batch, 32, 31).needed_gpu

    below_three = settings | {"gpu_memory_gb": (least(3) - 1 + CONTEXT_BYTES) / 1e9}
    assert planned(model, below_three, 2, 32, 31).fits and not planned(model, below_three, 3, 32, 31).fits
    assert auto_batch(model, below_three, 3, 32, 31) == 2
    assert auto_batch(model, settings | {"gpu_memory_gb": 0.5}, 3, 32, 31) == 1  # the weights alone do not fit
