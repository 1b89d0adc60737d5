"""KV selection policies: one file each, one interface (``Policy``), one runtime path."""

import itertools

from infinigen.errors import InfinigenError
from infinigen.runtime.config import RUNTIME_FIELDS, PolicyName, RuntimeConfig
from infinigen.runtime.selection.policies.base import Policy, Selection
from infinigen.runtime.selection.policies.dense import DensePolicy
from infinigen.runtime.selection.policies.full import FullPolicy
from infinigen.runtime.selection.policies.h2o import H2OPolicy
from infinigen.runtime.selection.policies.infinigen import InfinigenPolicy
from infinigen.runtime.selection.policies.int4 import Int2Policy, Int4Policy
from infinigen.runtime.selection.policies.oracle import OraclePolicy
from infinigen.runtime.selection.policies.quest import QuestPolicy

POLICIES: dict[PolicyName, type[Policy]] = {
    p.name: p
    for p in (DensePolicy, FullPolicy, InfinigenPolicy, H2OPolicy, QuestPolicy, OraclePolicy, Int4Policy, Int2Policy)
}


def policy_class(name: str) -> type[Policy]:
    """The registered policy ``name`` (its flags are class attributes)."""
    if name not in POLICIES:
        raise InfinigenError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


def supported_policy(config: RuntimeConfig, has_artifact: bool) -> type[Policy]:
    """The policy ``config`` names, once what a cache cannot run with it is refused (before anything
    is allocated)."""
    policy = policy_class(config.policy)
    if policy.speculates and not has_artifact:
        raise InfinigenError(f"policy {config.policy!r} needs an artifact: run `infinigen prepare` first")
    if config.reuse_rows == "on" and policy.codec is not None:
        raise InfinigenError(f"reuse_rows keeps decoded rows: not for {config.policy!r}, whose rows move compressed")
    if config.resident_bits == 8 and row_bits(config) != 8:
        raise InfinigenError("resident_bits 8 keeps rows as they are moved: it needs kv_bits 8")
    if row_bits(config) != 16 and not (policy.offloads and policy.plain_rows):
        where = "keeps its KV on the device" if not policy.offloads else "stores rows in its own codes"
        raise InfinigenError(f"kv_bits {row_bits(config)} is for policies that offload rows: {config.policy!r} {where}")
    return policy


def row_bits(config: RuntimeConfig) -> int:
    """Bits per K/V value of the rows ``config``'s policy keeps in the CPU pool and moves: ``kv_bits`` as
    given, else 8 for policies that offload plain rows, 16 for the others and for exact decoding."""
    if config.kv_bits is not None:
        return config.kv_bits
    if config.exact:
        return 16
    policy = policy_class(config.policy)
    return 8 if policy.offloads and policy.plain_rows else 16


def make_policy(config: RuntimeConfig) -> Policy:
    """A policy instance for one offloaded layer (it keeps that layer's selection state)."""
    return policy_class(config.policy)(config)


def settings_grid(values: dict[str, list]) -> list[dict]:
    """Rows of settings, one per combination of ``values`` (field -> values; ``policy`` first): a
    field varies only for the policies it applies to (its ``applies_to`` flags) and is None for the
    others, which then run with its default. Names that are no policy (transformers' own caches,
    in a benchmark) get no runtime settings at all."""
    rows = []
    for name in values["policy"]:
        policy = POLICIES.get(name)
        axes = {}
        for f in RUNTIME_FIELDS:
            if f.name == "policy" or f.name not in values:
                continue
            applies = policy is not None and all(getattr(policy, flag) for flag in f.metadata["applies_to"])
            axes[f.name] = values[f.name] if applies else [None]
        for combination in itertools.product(*axes.values()):
            row = {"policy": name, **dict(zip(axes, combination, strict=True))}
            if row not in rows:
                rows.append(row)
    return rows


__all__ = [
    "POLICIES",
    "Policy",
    "Selection",
    "make_policy",
    "policy_class",
    "row_bits",
    "settings_grid",
    "supported_policy",
]
