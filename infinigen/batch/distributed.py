"""A batch job over Ray Data: one actor per worker (per GPU where the workers have GPUs), each loading the
model and artifact once; the driver forms the batches as one process would (from the model's config and
tokenizer alone, no weights), hands them out as a dataset, and appends each batch's rows to the output as
it arrives. Output and resume are one process's: the same batches, the same rows, each written once.
Ray restarts a failed actor and retries its batch. ``ray`` is an optional extra (``pip install ".[ray]"``).
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinigen.batch.records import Request, Work
from infinigen.batch.runner import Job, Planner, Prepared, Progress, begin, record, run_batch
from infinigen.errors import InfinigenError
from infinigen.runtime.config import config_from
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.throughput import measured_rates
from infinigen.runtime.text import Sampling

RETRIES = 3  # restarts of a failed actor, and retries of the batch it was running


@dataclass(frozen=True)
class Cluster:
    address: str | None = None  # None: a local cluster on this machine
    workers: int = 0  # actors, each with the model loaded once; 0: one per GPU of the cluster (1 on CPUs)
    gpus_per_worker: float = 0  # 0: the workers run on CPUs


@dataclass(frozen=True)
class Loading:
    """How each worker loads what it decodes with (``infinigen.models.load_model``'s arguments)."""

    model: str | None
    artifact: str | None
    device: str
    dtype: str | None


def driver_planner(loading: Loading, settings: dict, **options) -> Planner:
    """The job's planner from the model's config and tokenizer alone. The budget: ``gpu_memory_gb``, else
    this machine's device where it is the workers' (the driver may have no GPU: then ask for a size)."""
    from infinigen.models import model_tokenizer, parse_dtype

    config, tokenizer = model_tokenizer(loading.model)
    dtype = parse_dtype(loading.dtype, loading.device)
    gpu_memory_gb = config_from(settings).gpu_memory_gb
    if gpu_memory_gb is None and loading.device.startswith("cuda") and not torch.cuda.is_available():
        raise InfinigenError("this machine has no GPU to plan the workers' batches by: give --gpu-memory-gb")
    device = torch.device(loading.device)
    budget = memory.budget_bytes(gpu_memory_gb, device)
    # a shared prefix's groups as one process forms them where this machine has the workers' kind of GPU
    rates = measured_rates(device, dtype) if device.type == "cuda" and torch.cuda.is_available() else None
    return Planner(tokenizer, memory.model_of(config, dtype), dtype, settings, budget, rates=rates, **options)


class BatchDecoder:
    """A Ray Data actor: the model and artifact loaded once; each item one batch of the driver's."""

    def __init__(self, loading: Loading, planner: dict, sampling: Sampling) -> None:
        from infinigen.artifacts import open_artifact
        from infinigen.models import load_model

        loaded = load_model(loading.model, device=loading.device, dtype=loading.dtype)
        artifact = open_artifact(loading.artifact, loaded.model) if loading.artifact is not None else None
        self.job = Job.of(loaded.model, loaded.tokenizer, artifact, sampling=sampling, **planner)

    def __call__(self, item: dict) -> dict:
        batch = [Prepared(Request(rid, 0), *rest) for rid, *rest in json.loads(item["batch"])]
        return {"index": item["index"], "rows": json.dumps(run_batch(self.job, batch, item["index"]))}


def run_on_ray(
    cluster: Cluster,
    loading: Loading,
    planner: Planner,
    sampling: Sampling,
    work: Work,
    *,
    on_batch: Callable[[Progress], None] = lambda progress: None,
    stop: Callable[[], bool] = lambda: False,
) -> Progress:
    """``runner.run_job`` with the batches decoded by ``cluster``'s workers."""
    try:
        import ray
    except ImportError:
        raise InfinigenError('--ray needs Ray: pip install ".[ray]"') from None
    left = begin(planner, work)
    progress = left.progress
    if not left.batches:
        return progress
    items = [
        {"index": index, "batch": json.dumps([[p.request.id, p.ids, p.new_tokens, p.prefix] for p in batch])}
        for index, batch in left.batches
    ]
    # the workers plan each batch's cache exactly as the driver formed it: its budget, its options
    options = {
        "settings": planner.settings,
        "budget": planner.budget,
        "max_new_tokens": planner.max_new_tokens,
        "prefill_chunk": planner.prefill_chunk,
        "max_batch": planner.max_batch,
        "rates": planner.rates,  # the batches are formed: a worker measures none
    }
    started = not ray.is_initialized()
    if started:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the command's own bar counts requests
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0)) if cluster.gpus_per_worker else 0
        dataset = ray.data.from_items(items, override_num_blocks=len(items)).map(
            BatchDecoder,
            fn_constructor_args=(loading, options, sampling),
            concurrency=min(cluster.workers or max(gpus, 1), len(items)),
            num_cpus=1,
            num_gpus=cluster.gpus_per_worker or None,
            ray_remote_args_fn=lambda: {"max_restarts": RETRIES, "max_task_retries": RETRIES},
        )
        start = time.perf_counter()
        threads_before = set(threading.enumerate())
        rows = iter(dataset.iter_rows())
        try:
            for done in rows:
                record(work.output, json.loads(done["rows"]), progress, left.done_ids, start)
                on_batch(progress)
                if stop() and progress.batches < len(items):
                    progress.interrupted = True
                    break
        finally:
            close = getattr(rows, "close", None)
            if close is not None:
                close()
            del rows
            gc.collect()  # the executor shuts down (its workers' tasks with it) when its iterator goes
            _join_block_readers(threads_before)
    finally:
        if started:
            ray.shutdown()
    return progress


def _join_block_readers(threads_before: set[threading.Thread], seconds: float = 120.0) -> None:
    """Wait for the threads Ray Data started to read this job's blocks: after a job left early, one may
    still wait on a batch, and a reader that reaches Ray after ``ray.shutdown`` ends the whole process
    ("the core worker has already been shutdown", exit code 1). Its parked block prefetcher is left: it
    waits on a condition, not on Ray."""
    deadline = time.monotonic() + seconds
    for thread in set(threading.enumerate()) - threads_before:
        if thread.name != "Prefetcher":
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
