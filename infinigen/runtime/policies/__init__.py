"""KV selection policies: one file each, one interface (``Policy``), one runtime path."""

from infinigen.errors import InfinigenError
from infinigen.runtime.config import PolicyName, RuntimeConfig
from infinigen.runtime.policies.base import Policy, Selection
from infinigen.runtime.policies.dense import DensePolicy
from infinigen.runtime.policies.full import FullPolicy
from infinigen.runtime.policies.h2o import H2OPolicy
from infinigen.runtime.policies.infinigen import InfinigenPolicy
from infinigen.runtime.policies.int4 import Int2Policy, Int4Policy
from infinigen.runtime.policies.oracle import OraclePolicy
from infinigen.runtime.policies.quest import QuestPolicy

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
    if config.kv_bits != 16 and not (policy.offloads and policy.plain_rows):
        where = "keeps its KV on the device" if not policy.offloads else "stores rows in its own codes"
        raise InfinigenError(f"kv_bits {config.kv_bits} is for policies that offload rows: {config.policy!r} {where}")
    return policy


def make_policy(config: RuntimeConfig) -> Policy:
    """A policy instance for one offloaded layer (it keeps that layer's selection state)."""
    return policy_class(config.policy)(config)


__all__ = ["POLICIES", "Policy", "Selection", "make_policy", "policy_class", "supported_policy"]
