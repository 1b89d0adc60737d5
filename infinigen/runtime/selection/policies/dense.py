"""dense: the whole KV cache on the compute device; the exactness and speed reference."""

from infinigen.runtime.selection.policies.base import Policy


class DensePolicy(Policy):
    name = "dense"
    offloads = False
