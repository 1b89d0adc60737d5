"""Kept prompts: a prompt that starts with a kept one computes only the rest and ends in the state a cold run
reaches (every tensor bit for bit where the cut is a chunk boundary of both, to rounding inside a chunk; every
policy), in memory and through a prompt file; the cache's budget and eviction order; every damaged or foreign
prompt file refused in one line; a save that dies leaves the old file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import invoke
from helpers import tiny_setup

import infinigen
from infinigen.errors import InfinigenError
from infinigen.runtime.cache.kept import keep
from infinigen.runtime.cache.prompt_file import PromptFileError, check_prompt, load_prompt, save_prompt
from infinigen.runtime.cache.prompts import PromptCache
from infinigen.runtime.generation import prefill

CHUNK = 32  # the prefill chunk
SETTINGS = dict(block_tokens=16)


@pytest.fixture(scope="module")
def setup(tokenizer):
    return tiny_setup(tokenizer, "llama", "cpu")


def ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))


def answer(model, artifact, prompt, prompts=None, **settings) -> tuple[list[int], int]:
    with infinigen.cache_for(model, artifact, prompts=prompts, **(SETTINGS | settings)) as cache:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                             custom_generate=infinigen.decode, max_new_tokens=6, do_sample=False,
                             prefill_chunk_size=CHUNK, pad_token_id=1)  # fmt: skip
        return out[0, prompt.shape[1] :].tolist(), cache.summary()["cached_tokens"]


def state(kept) -> dict[str, torch.Tensor]:
    """Every tensor of a kept prompt, the pool's blocks as one (B, H, slots, 2, w) per layer."""
    tensors = {}
    for i, layer in enumerate(kept.layers):
        if layer.blocks:
            tensors[f"{i}.rows"] = torch.cat(layer.blocks, dim=2)[:, :, : kept.length]
        tensors |= {f"{i}.{name}": tensor.clone() for name, tensor in layer.tensors.items()}
    return tensors


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        bits = (t.cpu().contiguous().view(-1).view(torch.uint8) for t in (a[name], b[name]))  # codes: NaN patterns
        assert torch.equal(*bits), name


def assert_close(a: dict, b: dict, used: int) -> None:
    """The states of two runs over their first ``used`` slots (past them: unused), floats to rounding."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = (t[:, :, :used] if t.dim() > 2 else t for t in (a[name], b[name]))
        if x.is_floating_point():
            finite = x.isfinite()
            assert torch.equal(finite, y.isfinite()), name
            torch.testing.assert_close(x[finite], y[finite], atol=1e-4, rtol=1e-4, msg=name)
        else:
            assert torch.equal(x, y), name


def cut_cold(model, artifact, prompt, at: int, **settings) -> tuple[list[int], dict]:
    """A run without kept prompts whose prefill stops at token ``at`` and goes on from there (in chunks ending
    at multiples of CHUNK, as the rest of a served prompt): its tokens, and its state after the prompt."""
    mask, settings = torch.ones_like(prompt), SETTINGS | settings
    with torch.no_grad(), infinigen.cache_for(model, artifact, **settings) as cache:
        prefill(model, cache, prompt[:, :at], mask[:, :at], CHUNK)
        prefill(model, cache, prompt, mask, CHUNK, start=at)
        cold = state(keep(cache, prompt[0]))
    with torch.no_grad(), infinigen.cache_for(model, artifact, **settings) as cache:
        prefill(model, cache, prompt[:, :at], mask[:, :at], CHUNK)
        out = model.generate(prompt, attention_mask=mask, past_key_values=cache, custom_generate=infinigen.decode,
                             max_new_tokens=6, do_sample=False, prefill_chunk_size=CHUNK, pad_token_id=1)  # fmt: skip
    return out[0, prompt.shape[1] :].tolist(), cold


@pytest.mark.parametrize("policy", ["dense", "full", "infinigen", "quest", "oracle", "int4"])
def test_a_kept_prefix_gives_the_cold_state_and_tokens(setup, policy):
    model, artifact = setup
    prefix = ids(0, 2 * CHUNK)
    first, second = (torch.cat([prefix, ids(seed, 20)], dim=1) for seed in (1, 2))
    prompts = PromptCache()
    answer(model, artifact, first, prompts, policy=policy)
    kept_first = state(prompts.newest)
    tokens, cached = answer(model, artifact, second, prompts, policy=policy)
    assert cached == 2 * CHUNK  # the common prefix in whole chunks
    warm = state(prompts.newest)
    cold_prompts = PromptCache()
    cold_tokens, cold_cached = answer(model, artifact, second, cold_prompts, policy=policy)
    assert cold_cached == 0 and tokens == cold_tokens
    assert_same(warm, state(cold_prompts.newest))  # every row, scale, partial key, page bound
    assert_same(kept_first, state(next(iter(prompts.entries.values()))))  # the shared prefix left unchanged


def test_a_conversation_prefills_each_new_turn_only(setup):
    model, artifact = setup  # each turn served whole: a cold run's tokens and state cut where the turn began
    turns = [ids(0, 2 * CHUNK), ids(1, CHUNK), ids(2, CHUNK + 5), ids(3, CHUNK)]
    prompts, previous = PromptCache(), 0
    for i in range(1, len(turns)):
        prompt = torch.cat(turns[: i + 1], dim=1)
        tokens, cached = answer(model, artifact, prompt, prompts, policy="infinigen")
        assert cached == previous
        if previous:
            cold_tokens, cold = cut_cold(model, artifact, prompt, previous, policy="infinigen")
            assert tokens == cold_tokens
            assert_same(state(prompts.newest), cold)
        previous = prompt.shape[1]


@pytest.mark.parametrize("policy", ["dense", "full", "infinigen", "quest", "oracle", "int4"])
def test_a_cut_inside_a_chunk_serves_the_common_prefix(setup, policy):
    model, artifact = setup  # the kept rows of the cut chunk were computed in a longer forward: equal to rounding
    prefix = ids(0, 2 * CHUNK + 10)
    first, second = (torch.cat([prefix, ids(seed, 20)], dim=1) for seed in (1, 2))
    prompts = PromptCache()
    answer(model, artifact, first, prompts, policy=policy)
    tokens, cached = answer(model, artifact, second, prompts, policy=policy)
    paged = policy == "quest"  # its page bounds: cut on whole pool blocks
    assert cached == (2 * CHUNK if paged else prefix.shape[1])
    cold_tokens, cold = cut_cold(model, artifact, second, cached, policy=policy)
    assert tokens == cold_tokens
    (assert_same if paged else assert_close)(state(prompts.newest), cold, *([] if paged else [second.shape[1]]))
    assert tokens == answer(model, artifact, second, None, policy=policy)[0]  # a cold run's, not cut


def test_8_bit_rows_are_cut_past_their_first_chunk_only(setup):
    model, artifact = setup  # a row's channel factors come from its first chunk, later tokens of it included
    for length, served in ((CHUNK - 6, 0), (CHUNK + 6, CHUNK + 6)):
        prefix = ids(0, length)
        prompts = PromptCache()
        answer(model, artifact, torch.cat([prefix, ids(1, 60)], dim=1), prompts, policy="full", kv_bits=8)
        second = torch.cat([prefix, ids(2, 20)], dim=1)[0]
        assert prompts.newest.usable(second) == served
        if not served:  # as a prompt file, refused in one line that says why
            with pytest.raises(PromptFileError, match="8-bit rows serve only past their first chunk of 32 tokens"):
                check_prompt(prompts.newest, prompts.newest.key, second, "doc.prompt")
    assert answer(model, artifact, torch.cat([prefix, ids(1, 60), ids(3, 4)], dim=1), prompts, policy="full")[1] == 98


def test_h2o_serves_only_prompts_that_extend_it_whole(setup):
    model, artifact = setup
    prefix = ids(0, 2 * CHUNK)
    prompts = PromptCache()
    answer(model, artifact, torch.cat([prefix, ids(1, CHUNK)], dim=1), prompts, policy="h2o")
    assert answer(model, artifact, torch.cat([prefix, ids(2, 20)], dim=1), prompts, policy="h2o")[1] == 0
    whole = torch.cat([prefix, ids(1, CHUNK), ids(3, 4)], dim=1)
    assert answer(model, artifact, whole, prompts, policy="h2o")[1] == 3 * CHUNK


def test_other_settings_find_nothing(setup):
    model, artifact = setup
    prompt = torch.cat([ids(0, 2 * CHUNK), ids(1, 8)], dim=1)
    prompts = PromptCache()
    answer(model, artifact, prompt, prompts, policy="full")
    assert answer(model, artifact, prompt, prompts, policy="full", kv_bits=16)[1] == 0
    assert answer(model, artifact, prompt, prompts, policy="infinigen")[1] == 0
    assert answer(model, artifact, prompt, prompts, policy="full")[1] == prompt.shape[1] - 2  # a forward of two


def test_the_budget_evicts_the_least_recently_used(setup):
    model, artifact = setup
    documents = [ids(seed, 2 * CHUNK) for seed in range(3)]
    unbounded = PromptCache()
    answer(model, artifact, torch.cat([documents[0], ids(9, 4)], dim=1), unbounded, policy="full")
    one = unbounded.nbytes
    prompts = PromptCache(gb=2.5 * one / 1e9)  # room for two
    for document in documents[:2]:
        answer(model, artifact, torch.cat([document, ids(9, 4)], dim=1), prompts, policy="full")
    assert answer(model, artifact, torch.cat([documents[0], ids(8, 4)], dim=1), prompts, policy="full")[1] > 0
    answer(model, artifact, torch.cat([documents[2], ids(9, 4)], dim=1), prompts, policy="full")  # evicts 1
    assert len(prompts) <= 3 and prompts.nbytes <= prompts.budget and prompts.evicted >= 1
    assert answer(model, artifact, torch.cat([documents[1], ids(8, 4)], dim=1), prompts, policy="full")[1] == 0
    assert answer(model, artifact, torch.cat([documents[2], ids(8, 4)], dim=1), prompts, policy="full")[1] > 0
    with pytest.raises(InfinigenError, match="prompt_cache_gb"):
        PromptCache(gb=-1)
    newest = PromptCache(most=1)  # the newest alone: it serves a prompt that starts with it
    for seed in (4, 5):
        answer(model, artifact, torch.cat([ids(seed, 2 * CHUNK), ids(9, 4)], dim=1), newest, policy="full")
    assert len(newest) == 1 and newest.evicted == 1 and newest.newest.tokens[0] == ids(5, 1)[0, 0]


def test_a_limited_cpu_pool_keeps_no_prompts():
    """Its slots are rewritten: a prompt cache asked beside it is refused in one line, the default one is none."""
    from infinigen.runtime.config import RuntimeConfig

    with pytest.raises(InfinigenError, match="kept prompts need an unlimited CPU pool"):
        RuntimeConfig(cpu_pool_gb=1, prompt_cache_gb=2)
    assert (
        PromptCache.of(RuntimeConfig(cpu_pool_gb=1)) is None
        and PromptCache.of(RuntimeConfig(prompt_cache_gb=0)) is None
    )
    assert PromptCache.of(RuntimeConfig(prompt_cache_gb=0.5)).budget == 500_000_000


def test_a_read_only_cache_serves_and_keeps_nothing(setup):
    model, artifact = setup
    document = ids(0, 2 * CHUNK)
    prompts = PromptCache()
    answer(model, artifact, torch.cat([document, ids(1, 4)], dim=1), prompts, policy="full")
    read_only = PromptCache(read_only=True)
    read_only.add(prompts.newest)
    question = torch.cat([document, ids(2, 8)], dim=1)
    cold = answer(model, artifact, question, policy="full")[0]
    assert answer(model, artifact, question, read_only, policy="full") == (cold, 2 * CHUNK)
    assert len(read_only) == 1 and read_only.newest is prompts.newest  # the question's prompt not kept


def test_a_prompt_file_round_trip_and_every_damage(setup, tmp_path):
    model, artifact = setup
    prefix = ids(0, 2 * CHUNK)
    prompts = PromptCache()
    answer(model, artifact, torch.cat([prefix, ids(1, 20)], dim=1), prompts, policy="infinigen")
    path = tmp_path / "doc.prompt"
    size = save_prompt(prompts.newest, path)
    assert size == path.stat().st_size and size <= prompts.newest.nbytes + 8192  # the tensors and a header
    loaded = load_prompt(path, "cpu")
    assert_same(state(loaded), state(prompts.newest))
    second = torch.cat([prefix, ids(2, 9)], dim=1)
    from_file = PromptCache()
    from_file.add(loaded)
    cold = answer(model, artifact, second, None, policy="infinigen")[0]
    assert answer(model, artifact, second, from_file, policy="infinigen") == (cold, 2 * CHUNK)
    import safetensors.torch  # the file is plain safetensors

    assert torch.equal(safetensors.torch.load_file(path)["tokens"], loaded.tokens)
    data = path.read_bytes()
    for cut in (4, 100, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.prompt").write_bytes(data[:cut])
        with pytest.raises(PromptFileError, match="cut|no prompt file|damaged"):
            load_prompt(tmp_path / "cut.prompt", "cpu")
    for at in (len(data) // 3, len(data) - 10):
        flipped = bytearray(data)
        flipped[at] ^= 0xFF
        (tmp_path / "flipped.prompt").write_bytes(bytes(flipped))
        with pytest.raises(PromptFileError, match="damaged"):
            load_prompt(tmp_path / "flipped.prompt", "cpu")
    key = dict(loaded.key)
    for name, value in (("model", "0" * 16), ("artifact", "f" * 64), ("kv_bits", 16), ("prefill_chunk", 64)):
        with pytest.raises(PromptFileError, match=name):
            check_prompt(loaded, key | {name: value}, second[0], path)
    with pytest.raises(PromptFileError, match="does not start with"):
        check_prompt(loaded, key, ids(5, 80)[0], path)


def test_a_save_that_dies_leaves_the_previous_file(setup, tmp_path, monkeypatch):
    model, artifact = setup
    prompts = PromptCache()
    answer(model, artifact, torch.cat([ids(0, 2 * CHUNK), ids(1, 4)], dim=1), prompts, policy="full")
    path = tmp_path / "doc.prompt"
    save_prompt(prompts.newest, path)
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_prompt(prompts.newest, path)
    assert path.read_bytes() == before


def test_generate_prompt_cache_across_runs(prepared, tokenizer, tmp_path):
    folder, artifact = prepared("llama")
    words = ["the", "old", "house", "on", "the", "corner", "of", "the", "street"]
    document = ""
    while len(tokenizer(document)["input_ids"]) < 128:  # two whole chunks: a run that extends it is served whole
        document = (document + " " + words[len(document.split()) % len(words)]).strip()
    assert len(tokenizer(document)["input_ids"]) == 128
    path, first, second = tmp_path / "doc.prompt", tmp_path / "q1.txt", tmp_path / "q2.txt"
    first.write_text(document)
    second.write_text(document + " where is it")
    base = ["generate", str(folder), "--artifact", str(artifact), "--device", "cpu", "--max-new-tokens", "4"]
    base += ["--prefill-chunk", "64", "--json"]

    def run(prompt_file, *more):
        result = invoke(*base, "--prompt-file", str(prompt_file), *more)
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{") :])

    cold = run(second, "--prompt-cache", str(tmp_path / "other.prompt"))  # the same settings, nothing kept
    made = run(first, "--prompt-cache", str(path))
    assert made["stats"]["cached_tokens"] == 0 and path.exists()
    warm = run(second, "--prompt-cache", str(path))
    assert warm["stats"]["cached_tokens"] == 128 and warm["outputs"] == cold["outputs"]
    shown = invoke("inspect", str(path), "--json")
    assert shown.exit_code == 0 and json.loads(shown.output)["tokens"] == 131  # the new prompt, which serves more
    before = path.read_bytes()
    third = tmp_path / "q3.txt"
    third.write_text(document + " who lives there")
    read_only = run(third, "--prompt-cache", str(path), "--prompt-cache-ro")  # served, the file left as it was
    assert read_only["stats"]["cached_tokens"] >= 128 and path.read_bytes() == before
    assert read_only["outputs"] == run(third)["outputs"]
    for more in (["--prompt-cache-ro"], ["--prompt-cache", str(tmp_path / "none.prompt"), "--prompt-cache-ro"]):
        lone = invoke(*base, "--prompt-file", str(third), *more)
        assert lone.exit_code == 2 and "--prompt-cache" in lone.output and "Traceback" not in lone.output
    refused = invoke(*base, "--prompt", "a new story", "--prompt-cache", str(path))
    assert refused.exit_code == 2 and "does not start with" in refused.output and "Traceback" not in refused.output
    other = invoke(*base, "--prompt-file", str(second), "--prompt-cache", str(path), "--kv-bits", "16")
    assert other.exit_code == 2 and "kv_bits" in other.output
    limited = invoke(*base, "--prompt-file", str(second), "--prompt-cache", str(path), "--cpu-pool-gb", "1")
    assert limited.exit_code == 2 and "unlimited CPU pool" in limited.output and "Traceback" not in limited.output
    path.write_bytes(path.read_bytes()[:1000])
    for command in (base + ["--prompt-file", str(second)], ["inspect"]):
        cut = invoke(*command, *(["--prompt-cache"] if command != ["inspect"] else []), str(path))
        assert cut.exit_code == 2 and "cut" in cut.output and "Traceback" not in cut.output


_SETUPS: dict[str, tuple] = {}


@pytest.fixture
def setup_on(tokenizer, device):
    """``setup`` on each device (made once per device)."""
    if device not in _SETUPS:
        _SETUPS[device] = tiny_setup(tokenizer, "llama", device)
    return _SETUPS[device]


def batch_of(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (1, n) left-padded into ids and a mask (B, T), on the rows' device."""
    n, device = max(row.shape[1] for row in rows), rows[0].device
    padded = torch.ones(len(rows), n, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), n, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        padded[i, n - row.shape[1] :], mask[i, n - row.shape[1] :] = row[0], 1
    return padded, mask


def batch_answer(model, artifact, rows, prompts, **settings) -> tuple[list[list[int]], list[int] | None]:
    padded, mask = batch_of(rows)
    with infinigen.cache_for(model, artifact, prompts=prompts, **(SETTINGS | settings)) as cache:
        out = model.generate(padded, attention_mask=mask, past_key_values=cache, custom_generate=infinigen.decode,
                             max_new_tokens=6, do_sample=False, prefill_chunk_size=CHUNK, pad_token_id=1)  # fmt: skip
        return out[:, padded.shape[1] :].tolist(), cache.reused_rows


def row_state(cache, row: int, offset: int) -> dict[str, torch.Tensor]:
    """Row ``row`` of a batch cache from slot ``offset`` on, as ``state`` has a kept prompt (a batch of one)."""
    tensors, n = {}, cache.get_seq_length() - offset
    for i, layer in enumerate(cache.layers):
        per_slot = {"valid": layer.valid}
        if hasattr(layer, "pool"):
            tensors[f"{i}.rows"] = torch.cat(layer.pool.blocks, dim=2)[row : row + 1, :, offset : offset + n]
            if layer.pool.kv_bits == 8:
                per_slot["scales"] = layer.pool.scales
                tensors[f"{i}.factors"] = layer.pool.factors[row : row + 1]
            per_slot |= {f"policy.{k}": v for k, v in vars(layer.policy).items() if isinstance(v, torch.Tensor)}
        else:
            per_slot |= {"keys": layer.keys, "values": layer.values}
        tensors |= {f"{i}.{name}": t[row : row + 1, :, offset : offset + n] for name, t in per_slot.items()}
    return tensors


@pytest.mark.parametrize("policy", ["dense", "full", "infinigen", "oracle", "int4", "h2o"])
def test_a_batch_prefills_a_row_at_a_time_each_row_as_alone(setup_on, policy):
    """Where prompts are kept, each row of a batch is prefilled in a cache of its own and restored right-aligned:
    its logits, its slots and the prompt it keeps are those it has alone, bit for bit, padding in front."""
    from infinigen.runtime.cache.planning import plan_run
    from infinigen.runtime.generation import served_prefill
    from infinigen.runtime.memory.plan import Workload

    model, artifact = setup_on
    rows = [ids(i, n).to(model.device) for i, n in ((1, 2 * CHUNK + 6), (2, CHUNK + 13), (3, 3 * CHUNK - 4))]
    alone = []
    for row in rows:
        prompts = PromptCache()
        with torch.no_grad(), infinigen.cache_for(model, artifact, prompts=prompts, **SETTINGS, policy=policy) as c:
            plan_run(c, Workload(1, row.shape[1], 6, CHUNK, keeps=True))
            logits, _ = served_prefill(model, c, row, torch.ones_like(row), CHUNK)
            alone.append((logits, state(keep(c, row[0]))))
    padded, mask = batch_of(rows)
    prompts = PromptCache()
    with torch.no_grad(), infinigen.cache_for(model, artifact, prompts=prompts, **SETTINGS, policy=policy) as cache:
        found = plan_run(cache, Workload(3, padded.shape[1], 6, CHUNK, True, keeps=True, rowwise=True))
        assert found.workload.rowwise
        logits, keeps = served_prefill(model, cache, padded, mask, CHUNK)
        assert not keeps and cache.reused_rows == [0, 0, 0]
        for b, (row, (row_logits, row_kept)) in enumerate(zip(rows, alone, strict=True)):
            assert torch.equal(logits[b], row_logits[0])
            offset = padded.shape[1] - row.shape[1]
            n = row.shape[1]  # a kept tensor's slots past the prompt's are unused (factors: 2 along dim 2)
            assert_same(row_state(cache, b, offset), {name: t[:, :, :n] for name, t in row_kept.items()})
            assert not cache.layers[0].valid[b, :, :offset].any()  # its padding
    assert len(prompts) == 3
    for kept, (_, row_kept) in zip(prompts.entries.values(), alone, strict=True):
        assert_same(state(kept), row_kept)


def test_a_batch_of_kept_rows_gives_each_row_its_alone_tokens_and_serves_the_next_questions(setup_on):
    model, artifact = setup_on
    rows = [ids(i, n).to(model.device) for i, n in ((1, 2 * CHUNK + 6), (2, CHUNK + 13), (3, 3 * CHUNK - 4))]
    prompts = PromptCache()
    tokens, served = batch_answer(model, artifact, rows, prompts, policy="full")
    assert served == [0, 0, 0] and tokens == [
        answer(model, artifact, row, PromptCache(), policy="full")[0] for row in rows
    ]
    questions = [torch.cat([row, ids(9 + i, 7).to(row.device)], dim=1) for i, row in enumerate(rows)]
    tokens, served = batch_answer(model, artifact, questions, prompts, policy="full")
    assert served == [row.shape[1] for row in rows]  # each row's document, kept by the batch before
    assert len(prompts) == 6
    for question, row_tokens in zip(questions, tokens, strict=True):
        warm = PromptCache()
        warm.add(next(k for k in prompts.entries.values() if torch.equal(k.tokens, question[0, : k.length].cpu())))
        assert row_tokens == answer(model, artifact, question, warm, policy="full")[0]


def test_a_paged_policy_or_no_kept_prompts_prefill_a_batch_whole(setup):
    model, artifact = setup
    rows = [ids(1, CHUNK + 6), ids(2, CHUNK + 13)]
    assert batch_answer(model, artifact, rows, PromptCache(), policy="quest")[1] is None
    assert batch_answer(model, artifact, rows, None, policy="full")[1] is None


def test_a_batch_of_rows_alone_is_planned_with_one_rows_prefill_and_their_kept_copies():
    from transformers import AutoConfig

    from infinigen.runtime.config import RuntimeConfig
    from infinigen.runtime.memory.plan import Workload, model_of, plan

    shape = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = model_of(AutoConfig.for_model("llama", intermediate_size=1024, vocab_size=1000, **shape), torch.float16)
    config = RuntimeConfig(policy="full")
    whole, rowwise, one = (
        plan(model, torch.float16, Workload(b, 8192, 64, 2048, keeps=True, rowwise=r), config)
        for b, r in ((4, False), (4, True), (1, False))
    )
    parts = {
        name: {p.name: p.nbytes for p in found.parts}
        for name, found in [("whole", whole), ("rowwise", rowwise), ("one", one)]
    }
    prefill = [name for name in parts["whole"] if name.startswith("prefill:")]
    assert all(parts["rowwise"][name] == parts["one"][name] for name in prefill)
    assert rowwise.gpu("prefill") < whole.gpu("prefill") and rowwise.gpu("decode") == whole.gpu("decode")
    kept = parts["rowwise"]["the rows' kept prompts"]
    prompt_only = {
        p.name: p.nbytes for p in plan(model, torch.float16, Workload(4, 8192, 0, 2048, keeps=True), config).parts
    }
    assert kept == prompt_only["CPU KV pool"] + prompt_only["dense layers' KV"]  # each row's prompt, as kept
    assert rowwise.host == whole.host + kept
