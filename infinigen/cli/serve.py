"""``infinigen serve``: an OpenAI-compatible server (``infinigen.serve``; the package's ``serve`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infinigen.cli.app import command
from infinigen.cli.options import ArtifactOpt, DeviceOpt, DtypeOpt, ModelArg, runtime_options
from infinigen.cli.render import err_console
from infinigen.errors import InfinigenError
from infinigen.runtime.config import KEPT_CHUNK
from infinigen.serve import MAX_BATCH


@command
@runtime_options(sweep=False)
def serve(
    runtime: dict,
    model: ModelArg = None,
    artifact: ArtifactOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_name: Annotated[
        str | None, typer.Option(help="The model's name in the API (default: MODEL as given, or smollm2-135m).")
    ] = None,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prefill in chunks of this many tokens where prompts are kept.")
    ] = KEPT_CHUNK,
    max_batch: Annotated[
        int, typer.Option(help="Most requests decoded together (fewer where the memory plan admits fewer).")
    ] = MAX_BATCH,
    ray: Annotated[
        bool, typer.Option(help="Serve through Ray Serve's proxy, one replica per GPU of a local Ray cluster.")
    ] = False,
    ray_address: Annotated[
        str | None, typer.Option(help="Serve through Ray Serve on this running Ray cluster ('auto': the local one).")
    ] = None,
    ray_replicas: Annotated[
        int, typer.Option(help="With Ray: replicas (0: one per GPU of the cluster, 1 on CPUs).")
    ] = 0,
    prompt_cache_dir: Annotated[
        Path | None,
        typer.Option(help="Read kept prompts from this directory at start; write them there when SIGTERM drains it."),
    ] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
) -> None:
    """Serve the model over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    Examples:\n
      infinigen serve --artifact skewed/\n
      infinigen serve llama-3-8b --artifact me/llama3-infinigen --gpu-memory-gb 24 --port 8000\n
      infinigen serve --artifact skewed/ --prompt-cache-dir prompts/   # kept prompts survive a restart\n
      infinigen serve llama-3-8b --artifact skewed/ --ray-address auto   # a replica per GPU of a Ray cluster
    """
    try:
        from infinigen.serve.app import run
        from infinigen.serve.engine import Engine
    except ImportError as exc:
        raise InfinigenError(f"infinigen serve needs the serve extra: pip install 'infinigen[serve]' ({exc})") from None
    if not 0 < port < 65536:
        raise InfinigenError(f"--port must be in 1..65535, got {port}")
    if prefill_chunk < 1 or max_batch < 1 or ray_replicas < 0:
        raise InfinigenError("--prefill-chunk and --max-batch must be at least 1, --ray-replicas at least 0")
    from infinigen.artifacts import read_artifact
    from infinigen.runtime import RuntimeConfig

    settings = RuntimeConfig(**runtime)  # bad settings fail here, before the model loads
    on_ray = ray or ray_address is not None
    if prompt_cache_dir is not None and (settings.prompt_cache_gb == 0 or prompt_cache_dir.is_file() or on_ray):
        raise InfinigenError("--prompt-cache-dir needs a directory, kept prompts (--prompt-cache-gb above 0), no Ray")
    name = served_name or model or "smollm2-135m"
    options = {"prefill_chunk": prefill_chunk, "max_batch": max_batch}
    load = {"model": model, "artifact": artifact, "settings": runtime, "name": name, "device": device, "dtype": dtype}
    if on_ray:
        from infinigen.serve.replicas import serve_on_ray

        read_artifact(artifact)  # a missing or corrupted artifact fails here, before any replica starts
        serve_on_ray(load | options, host, port, ray_address, ray_replicas)
        return
    engine = Engine.load(**load, **options, prompt_dir=prompt_cache_dir)
    err_console.print(f"serving {engine.name} on http://{host}:{port}/v1 ({engine.device}); SIGTERM drains it")
    run(engine, host, port)
