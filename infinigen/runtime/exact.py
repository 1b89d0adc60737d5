"""Exact answers (``RuntimeConfig.exact``): the policy drafts, the model verifies, the tokens are dense decoding's.

A cycle drafts ``draft_tokens`` tokens (0: as many as the run so far says pay best, ``Verified.adapted``) with
the policy's decode steps (CUDA graphs, a share of the rows moved),
cuts their KV off again (``rollback``: it was computed from selected rows), and runs one forward over the last
token and the drafts that attends every cached row, as a prefill chunk does: its logits are the model's own at
each of those positions, and it writes their exact KV. The longest run of drafts equal to its greedy tokens is
accepted with the token after it (the verification's own: a correction, or one more where all were accepted),
and the cache is cut back past them. In a batch every row advances by the smallest run any unfinished row
accepted, plus one: each row's tokens are its verification's, so every row is exact.
"""

from __future__ import annotations

import time

import torch

from infinigen.architectures import sliding_windows
from infinigen.errors import InfinigenError
from infinigen.runtime.cache import InfinigenCache
from infinigen.runtime.cache.rollback import refusal
from infinigen.runtime.config import MOST_DRAFTS


def check(model, cache: InfinigenCache, generation_config) -> None:
    """Refuse, in one line, a run whose tokens exact decoding could not make dense decoding's."""
    config, policy = cache.config, cache.policy_type
    if generation_config.do_sample:
        raise InfinigenError("exact decoding is greedy: leave sampling off (do_sample=False, temperature 0)")
    if policy.codec is not None:
        raise InfinigenError(f"exact decoding needs the model's own KV: the {policy.name} policy's rows are lossy")
    if config.cpu_pool_gb is not None:
        raise InfinigenError("exact decoding cuts drafts off: it needs an unlimited CPU pool (leave --cpu-pool-gb out)")
    windows = [w for w in sliding_windows(model.config) if w is not None]
    if windows and min(windows) < generation_config.max_length:
        raise InfinigenError(
            f"exact decoding cuts drafts off the cache: a sliding window of {min(windows)} tokens cannot be cut back "
            f"once {generation_config.max_length} tokens have passed it"
        )
    reason = refusal(cache)
    if reason is not None:
        raise InfinigenError(f"exact decoding cuts drafts off the cache, which cannot be: {reason}")


FIRST_DRAFTS = 4  # adaptive drafting's first cycle, before any is timed


class Verified:
    """A run's cycles: tokens drafted, drafts accepted, verifying forwards, and where each cycle's time went
    (marks at its start, after its drafts, after its verification: CUDA events, read once that cycle is done)."""

    def __init__(self, device: torch.device) -> None:
        self.drafted = self.accepted = self.verifications = 0
        self.device, self.marks = device, []  # per cycle: (start, drafted, verified)
        self.drafting = self.verifying = 0.0  # seconds of the cycles read so far
        self.timed = 0  # cycles read so far

    def mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self) -> None:
        """Fold the cycles not yet read into the totals (every recorded cycle is done: its tokens were read)."""
        for start, drafted, verified in self.marks[self.timed :]:
            self.drafting += _seconds(start, drafted)
            self.verifying += _seconds(drafted, verified)
        self.timed = len(self.marks)

    def adapted(self) -> int:
        """The draft count of the most tokens a second the cycles so far promise: a draft accepted with the
        rate seen (each after the one before), a cycle's time its drafts' at their mean and a verification's."""
        self.read()
        if not self.timed or not self.drafted:
            return FIRST_DRAFTS
        accepted = (self.accepted + 1) / (self.drafted + 2)  # never 0 or 1
        draft, verify = self.drafting / self.drafted, self.verifying / self.timed

        def rate(n: int) -> float:  # the tokens a cycle gives (its accepted drafts and one more) a second
            return (1 - accepted ** (n + 1)) / (1 - accepted) / (n * draft + verify)

        return max(range(1, MOST_DRAFTS + 1), key=rate)

    def summary(self) -> dict:
        counts = {"drafted": self.drafted, "accepted": self.accepted, "verifications": self.verifications}
        counts["acceptance"] = round(self.accepted / self.drafted, 4) if self.drafted else None
        self.read()
        cycles = max(1, self.timed)
        return counts | {
            "drafts_per_cycle": round(self.drafted / cycles, 2),
            "draft_ms": round(self.drafting * 1e3 / cycles, 3),  # a cycle's drafts and their cut
            "verify_ms": round(self.verifying * 1e3 / cycles, 3),  # its verifying forward
            "verification_share": round(self.verifying / (self.drafting + self.verifying), 4) if self.timed else None,
        }


def _seconds(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def cycles(model, cache, argument: str, step, emit, mask, position: torch.Tensor, token: torch.Tensor) -> None:
    """Draft-and-verify cycles until ``emit`` (``generation.Emitter``: each new token from its logits) says every
    row is done; ``argument``: the keyword ``model`` takes the cache under, ``step``: its ``StepGraph``. ``token``
    (B,): the latest token, not yet cached, to go at ``position`` (B, 1) + 1; ``mask`` (B, T): the attention mask
    of the tokens so far, which end with ``token``."""
    verified = cache.verified = Verified(token.device)
    while True:
        wanted = cache.config.draft_tokens or verified.adapted()  # 0: adaptive
        # at least one draft: a forward of one token would be a decode step, over the policy's selection
        k = max(1, min(wanted, emit.max_length - emit.input_ids.shape[1] - 1))
        drafts, drafted, at, start = [], token, position, verified.mark()
        for _ in range(k):
            at = at + 1
            drafted = step(drafted[:, None], at).argmax(-1)
            drafts.append(drafted)
        cache.crop(-k)  # their KV came from selected rows: the verification writes the model's own
        drafted_at = verified.mark()
        candidates = torch.stack([token, *drafts], dim=1)  # (B, k + 1)
        ones = torch.ones_like(candidates)
        positions = position + 1 + torch.arange(k + 1, device=candidates.device)  # (B, k + 1)
        inputs = {"attention_mask": torch.cat([mask, ones[:, 1:]], dim=1), "position_ids": positions}
        logits = model(candidates, **{argument: cache}, use_cache=True, logits_to_keep=k + 1, **inputs).logits
        verified.marks.append((start, drafted_at, verified.mark()))
        verified.verifications += 1
        verified.drafted += k
        # each position's token in order, while the drafts agree with them (the first that does not is the last)
        accepted = 0
        for j in range(k + 1):
            token = emit(logits[:, j])
            if token is None:
                return
            if j == k or not bool(((token == drafts[j]) | ~emit.live).all()):  # finished rows agree with anything
                break
            accepted += 1
        verified.accepted += accepted
        cache.crop(-(k - accepted))  # the last token and the accepted drafts stay, with their verified KV
        position = position + 1 + accepted
        mask = torch.cat([mask, ones[:, : accepted + 1]], dim=1)
