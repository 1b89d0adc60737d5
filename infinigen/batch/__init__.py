"""Batch jobs: a JSON-lines file of requests through the runtime, results appended as each batch ends,
resumable (``records``: the files; ``runner``: batches by the memory plan, one device)."""

from infinigen.batch.records import BadLine, Request, Work, read_requests
from infinigen.batch.runner import Job, Progress, run_job

__all__ = ["BadLine", "Job", "Progress", "Request", "Work", "read_requests", "run_job"]
