"""``infinigen generate``: text from prompts, with the KV cache in CPU memory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infinigen.cli.app import command
from infinigen.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelArg, runtime_options
from infinigen.cli.render import console, err_console, human_bytes, print_pairs, printed_json
from infinigen.errors import InfinigenError
from infinigen.tensor_parallel import rank, world_size


@command
@runtime_options(sweep=False)
def generate(
    runtime: dict,
    model: ModelArg = None,
    artifact: Annotated[str | None, typer.Option(help="Artifact folder or Hub id (speculating policies).")] = None,
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file.")] = None,
    batch_file: Annotated[Path | None, typer.Option(help="One prompt per line, decoded as one batch.")] = None,
    input: Annotated[
        Path | None,
        typer.Option(
            "--input",
            help='A batch job: JSON lines {"id", "prompt" | "messages", "max_new_tokens"?}, in batches the memory '
            "plan forms (a prefix requests share computed once); results appended to --output as each batch ends "
            "(a rerun continues).",
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option(help="With --input: the results, JSON lines.")] = None,
    max_batch: Annotated[int, typer.Option(help="With --input: the most requests a batch takes.")] = 64,
    ray: Annotated[
        bool, typer.Option(help="With --input: decode on the workers of a local Ray cluster (the package's ray extra).")
    ] = False,
    ray_address: Annotated[
        str | None, typer.Option(help="With --input: decode on the workers of this running Ray cluster.")
    ] = None,
    ray_workers: Annotated[
        int, typer.Option(help="With --ray: workers (0: one per GPU of the cluster, 1 on CPUs).")
    ] = 0,
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            help="A prompt file: where it holds the start of this prompt, only the rest is computed; after the prompt, "
            "it is written (unless it served all it would)."
        ),
    ] = None,
    prompt_cache_ro: Annotated[
        bool,
        typer.Option(
            "--prompt-cache-ro",
            help="With --prompt-cache: read the file, never write it (a document's file then serves each question "
            "about it without a write, or a copy of the prompt, each time).",
        ),
    ] = False,
    chat: Annotated[bool, typer.Option(help="Wrap prompts in the tokenizer's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy; above 0: sample at this temperature.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Sampling: the smallest set of tokens with this probability.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sampling: the k most likely tokens only (0: no cut).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling: the random seed (repeatable outputs).")] = None,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prefill long prompts in chunks of this many tokens (bounds GPU memory); 0: one pass.")
    ] = 4096,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate text with the KV cache in CPU memory, streaming tokens, then print the run's stats.

    Examples:\n
      infinigen generate --artifact skewed/ --prompt "The old house on the corner"\n
      infinigen generate opt-6.7b --artifact me/opt67-infinigen --prompt-file long.txt --budget 0.1\n
      infinigen generate --artifact skewed/ --batch-file prompts.txt --policy full --json\n
      infinigen generate --artifact skewed/ --input requests.jsonl --output results.jsonl [--ray]
    """
    import torch

    from infinigen.artifacts import open_artifact, read_artifact
    from infinigen.models import load_model
    from infinigen.runtime import RuntimeConfig, cache_for, host_pool_size, reserve_host_memory
    from infinigen.runtime.memory import plan as memory
    from infinigen.runtime.text import Sampling, generate_text

    if input is not None and (prompt or prompt_file or batch_file or chat):
        raise InfinigenError("--input takes no --prompt, --prompt-file, --batch-file or --chat (chats: messages)")
    prompts = _prompts(prompt, prompt_file, batch_file) if input is None else []
    if prompt_cache is not None:
        from infinigen.runtime.cache.prompt_file import read_manifest

        if len(prompts) != 1:
            raise InfinigenError("--prompt-cache takes one prompt (--prompt or --prompt-file)")
        if prompt_cache.exists():
            read_manifest(prompt_cache)  # a damaged file refused before the model loads
        elif prompt_cache_ro:
            raise InfinigenError(f"--prompt-cache-ro: {prompt_cache} does not exist (a run without -ro writes it)")
    elif prompt_cache_ro:
        raise InfinigenError("--prompt-cache-ro reads the file of --prompt-cache: give one")
    config = RuntimeConfig(**runtime)  # bad settings fail here, before the model loads
    if prompt_cache is not None and config.cpu_pool_gb is not None:
        raise InfinigenError("--prompt-cache needs an unlimited CPU pool (a limited one rewrites its slots)")
    sampling = Sampling(temperature, top_p, top_k, seed)
    for name, value in (("--max-new-tokens", max_new_tokens), ("--max-batch", max_batch)):
        if value < 1:
            raise InfinigenError(f"{name} must be at least 1, got {value}")
    if input is not None:
        from infinigen.cli.jobs import job_requests, run_batch_job

        requests = job_requests(input, output)  # the files refused before anything loads
    # a missing or corrupted artifact is refused before the weights load (a batch job's, where it loads them)
    read = read_artifact(artifact) if input is None else None
    if device is None and not torch.cuda.is_available():
        err_console.print("no CUDA device: running on the CPU (slowly)")
    if input is not None:
        options = dict(max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk or None, max_batch=max_batch)
        loading = dict(model=model, artifact=artifact, device=device, dtype=dtype)
        cluster = (ray_address or ("local" if ray else None), ray_workers)
        run_batch_job(loading, vars(config), sampling, options, cluster, requests, input, output, as_json)
        return
    planned: list[memory.MemoryPlan] = []

    def plan_and_pin(model_config, tokenizer, torch_dtype: torch.dtype, on: torch.device) -> RuntimeConfig | None:
        """Before the weights load: the memory plan (a run that cannot fit is refused here), then the
        prompts' pools pinned on worker threads while the weights load: a process's first prefill would
        otherwise wait for its blocks (BENCHMARKS.md, "Prefill")."""
        lengths = {len(ids) for ids in tokenizer(_templated(prompts, tokenizer, chat))["input_ids"]}
        longest, tokens = max(lengths), max(lengths) + max_new_tokens
        if tokens > getattr(model_config, "max_position_embeddings", tokens):
            return  # refused once the model is loaded, with the reason
        subject = memory.model_of(model_config, torch_dtype)
        chunk, padded = prefill_chunk or None, len(lengths) > 1
        work = memory.Workload(len(prompts), longest, max_new_tokens, chunk, padded, keeps=prompt_cache is not None)
        budget = memory.budget_bytes(config.gpu_memory_gb, on)
        found = memory.plan(subject, torch_dtype, work, config, budget, ranks=world_size())
        if why := memory.why_not(found):
            raise InfinigenError(why)
        planned.append(found)
        size = host_pool_size(model_config, len(prompts), tokens, torch_dtype, world_size(), **vars(found.config))
        if size.blocks:
            reserve_host_memory(size.reservation_bytes(), on)
        return found.config  # its streamed layers, if any, load in host memory

    loaded = load_model(model, device=device, dtype=dtype, before_weights=plan_and_pin)
    checked = open_artifact(read, loaded.model) if read is not None else None
    tokenizer = loaded.tokenizer
    prompts = _templated(prompts, tokenizer, chat)
    chunk = planned[0].workload.prefill_chunk or 0 if planned else prefill_chunk
    with cache_for(loaded.model, checked, **({"plan": planned[0]} if planned else vars(config))) as cache:
        if prompt_cache is not None:
            ids = torch.tensor(tokenizer(prompts)["input_ids"][0])
            cache.prompts = _prompt_file_cache(prompt_cache, cache, ids, prompt_cache_ro)
        texts, stats = generate_text(
            loaded.model,
            tokenizer,
            prompts,
            cache,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            prefill_chunk=chunk,
            stream=not as_json and rank() == 0,  # every rank decodes the same tokens: one prints them
        )
    if prompt_cache is not None and not prompt_cache_ro:
        _save_prompt_file(prompt_cache, cache, stats)
    if planned:
        stats["memory_plan"] = memory.summary(planned[0])
    if printed_json({"outputs": texts, "stats": stats}, as_json):
        return
    if len(prompts) > 1:
        for i, text in enumerate(texts):
            console.print(f"[bold]\\[{i}][/] {text}", highlight=False)
    console.print()
    shown = {key: human_bytes(value) if "bytes" in key else value for key, value in stats.items() if key != "per_layer"}
    shown |= {key: value for key, value in shown.pop("memory_plan", {}).items() if value is not None}
    ranks = world_size()  # the statistics are rank 0's: the bytes of its KV heads
    print_pairs(f"{config.policy} on {loaded.model.device}" + (f", rank 0 of {ranks}" if ranks > 1 else ""), shown)


def _prompt_file_cache(path: Path, cache, ids, read_only: bool):
    """Kept prompts for ``--prompt-cache``: the file's, where it exists (refused in one line where it cannot
    serve ``ids``: another model, artifact or settings, another prompt, damage)."""
    from infinigen.runtime.cache.prompt_file import check_prompt, load_prompt
    from infinigen.runtime.cache.prompts import PromptCache

    prompts = PromptCache(read_only=read_only)
    if path.exists():
        kept = load_prompt(path, cache.device)
        check_prompt(kept, cache.prompt_key, ids, path)
        prompts.add(kept)
    return prompts


def _save_prompt_file(path: Path, cache, stats: dict) -> None:
    """The run's prompt written to ``path``, unless the file already served all it would (``KeptPrompt.usable``)."""
    from infinigen.runtime.cache.prompt_file import save_prompt
    from infinigen.runtime.cache.prompts import HASHED_TOKENS

    kept = cache.prompts.newest
    if kept is None:  # ``PromptCache.add`` keeps none shorter
        err_console.print(f"{path} not written: the prompt is shorter than {HASHED_TOKENS} tokens")
    elif cache.reused_tokens < kept.length:
        stats["prompt_file_bytes"] = save_prompt(kept, path)


def _templated(prompts: list[str], tokenizer, chat: bool) -> list[str]:
    """The prompts as the model reads them: in the tokenizer's chat template with ``chat``."""
    if not chat:
        return prompts
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def _prompts(prompt: str | None, prompt_file: Path | None, batch_file: Path | None) -> list[str]:
    given = [x for x in (prompt, prompt_file, batch_file) if x is not None]
    if len(given) != 1:
        raise InfinigenError("give exactly one of --prompt, --prompt-file, --batch-file")
    if prompt is not None:
        prompts = [prompt]
    else:
        try:
            text = (prompt_file or batch_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InfinigenError(f"cannot read {prompt_file or batch_file}: {exc}") from exc
        prompts = [text] if prompt_file else [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(p.strip() for p in prompts):
        raise InfinigenError("the prompt is empty")
    return prompts
