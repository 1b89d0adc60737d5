"""What ``GET /metrics`` shows, in Prometheus' text format: requests waiting and running, their outcomes,
tokens in and out, first-token and inter-token latency histograms, and the latest request's planned
against measured GPU peak and planned host memory."""

from __future__ import annotations

import bisect
import threading
import time

# seconds: first tokens of long prompts take tens of seconds on a small card, a decode step milliseconds
FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            self.counts[index] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [f"# TYPE {name} histogram"], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued = self.active = 0
        self.outcomes: dict[str, int] = {}  # by HTTP status class: "2xx", "4xx", "5xx"
        self.prompt_tokens = self.generated_tokens = self.cached_tokens = 0
        self.batches = self.batched_rows = 0  # batches decoded, and the requests in them
        self.kept = (0, 0, 0)  # kept prompts: how many, their host bytes, how many evicted
        self.decode_seconds = 0.0
        self.first_token = Histogram(FIRST_TOKEN_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self.planned_gpu = self.measured_gpu = self.planned_host = None

    def add(self, gauge: str, n: int) -> None:
        """The gauge ``gauge`` ("queued": requests waiting their batch, "active": running) moved by ``n``."""
        with self.lock:
            setattr(self, gauge, getattr(self, gauge) + n)

    def answered(self, status: int) -> None:
        with self.lock:
            key = f"{status // 100}xx"
            self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def batched(self, rows: int) -> None:
        with self.lock:
            self.batches += 1
            self.batched_rows += rows

    def finished(self, started: float, times, prompt: int, generated: int, found, peak, cached=0, prompts=None) -> None:
        """A decoded request: ``times`` when each piece of its text came (the first: its first token); ``cached``: its
        prompt tokens from a kept prompt; ``prompts``: the kept prompts after it."""
        with self.lock:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            if prompts is not None:
                self.kept = (len(prompts), prompts.nbytes, prompts.evicted)
            self.generated_tokens += generated
            if times:
                self.first_token.observe(times[0] - started)
                for before, after in zip(times, times[1:], strict=False):
                    self.inter_token.observe(after - before)
                self.decode_seconds += time.perf_counter() - times[0]
            self.planned_gpu, self.planned_host, self.measured_gpu = found.peak_gpu, found.host, peak

    def text(self) -> str:
        with self.lock:
            lines = [
                "# TYPE infinigen_requests_waiting gauge",
                f"infinigen_requests_waiting {self.queued}",
                "# TYPE infinigen_requests_running gauge",
                f"infinigen_requests_running {self.active}",
                "# TYPE infinigen_requests_total counter",
                *(f'infinigen_requests_total{{status="{k}"}} {v}' for k, v in sorted(self.outcomes.items())),
                "# TYPE infinigen_batches_total counter",
                f"infinigen_batches_total {self.batches}",
                "# TYPE infinigen_batch_rows_total counter",
                f"infinigen_batch_rows_total {self.batched_rows}",
                "# TYPE infinigen_prompt_tokens_total counter",
                f"infinigen_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE infinigen_prompt_tokens_cached_total counter",
                f"infinigen_prompt_tokens_cached_total {self.cached_tokens}",
                "# TYPE infinigen_kept_prompts gauge",
                f"infinigen_kept_prompts {self.kept[0]}",
                "# TYPE infinigen_kept_prompt_bytes gauge",
                f"infinigen_kept_prompt_bytes {self.kept[1]}",
                "# TYPE infinigen_kept_prompts_evicted_total counter",
                f"infinigen_kept_prompts_evicted_total {self.kept[2]}",
                "# TYPE infinigen_generated_tokens_total counter",
                f"infinigen_generated_tokens_total {self.generated_tokens}",
                "# TYPE infinigen_decode_seconds_total counter",
                f"infinigen_decode_seconds_total {self.decode_seconds:.6f}",
                *self.first_token.lines("infinigen_time_to_first_token_seconds"),
                *self.inter_token.lines("infinigen_inter_token_latency_seconds"),
            ]
            for name, value in (
                ("infinigen_last_planned_peak_gpu_bytes", self.planned_gpu),
                ("infinigen_last_measured_peak_gpu_bytes", self.measured_gpu),
                ("infinigen_last_planned_host_bytes", self.planned_host),
            ):
                if value is not None:
                    lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"
