"""Selection: which cached tokens each offloaded layer fetches. The policies, one file each behind one
small interface (``policies.base.Policy``: ``stored`` / ``select`` / ``attended``, flags, an optional row
codec), and their registry (``policies``); InfiniGen's speculation of a layer's query and partial keys
from the previous layer (``speculation``); adaptive per-layer budgets from the artifact's missed-mass
curves (``allocation``). Tensors in, slots out: this room never touches a pool or a cache, only
``kernels`` and the config."""
