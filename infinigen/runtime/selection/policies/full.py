"""full: the whole KV cache in CPU memory, every cached token fetched at every step, one layer ahead
(the FlexGen / offloaded-cache behaviour: the strongest full-fetch baseline)."""

from infinigen.runtime.selection.policies.base import Policy


class FullPolicy(Policy):
    name = "full"
