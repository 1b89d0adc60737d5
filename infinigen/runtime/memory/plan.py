"""The memory plan: what one run takes on the GPU and in host memory, part by part, from the model's
config, the dtype, the workload (batch, prompt, new tokens, prefill chunk) and the runtime settings
alone, before any weight loads. The same inputs give the same plan on any machine.

Under a GPU budget the plan also makes the runtime's choices that cost GPU memory, each given up stated
(``MemoryPlan.shed``), in the order of ``shedding``.

Peaks: parts held through the run (``run``) add up; the prefill's (``prefill``: a chunk's workspace) and
decoding's (``decode``: fetched or resident rows, a step's workspace, exact decoding's verification) never
coexist: the peak is the held parts and the larger of the two (in a prefill layer, likewise its attention's and its
MLP's: ``layer_activations``). The budget is what PyTorch may allocate: a GPU memory size given
(``RuntimeConfig.gpu_memory_gb``) less the CUDA context (``CONTEXT_BYTES``), or the device's free memory,
with the allocator's slack (``SLACK``) beside the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from infinigen.architectures import decoder_layers
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.kernels.chunk_attention import ALIGN
from infinigen.runtime.memory import host_memory, reuse, shedding, streaming
from infinigen.runtime.memory.pool import row_bytes
from infinigen.runtime.memory.sizing import (
    Model,
    gb,
    largest,
    offloaded_layer_indices,
    pool_block_tokens,
    pool_size,
    slot_bytes,
    streamed_count,
    weight_slots,
)
from infinigen.runtime.memory.sizing import model_of as model_of  # the interface: a config's ``Model``
from infinigen.runtime.selection.policies import policy_class, row_bits
from infinigen.runtime.selection.policies.base import rows_bound
from infinigen.runtime.selection.speculation import padded_channels

STREAMED_WEIGHTS = "weights: streamed layers"  # the host part of the layers streamed from host memory
SLACK = 0.05  # of the planned peak: blocks the caching allocator holds but cannot hand out
CONTEXT_BYTES = 600 * 2**20  # the CUDA context and its libraries, outside PyTorch's allocator
CHUNK = 4096  # the prefill chunk the plan turns to when a one-shot prefill does not fit
# cuBLAS takes a workspace from PyTorch's allocator for each stream that runs a matmul, at its first matmul, and
# holds it: torch's default on Hopper (8 MiB on older cards). A prefill multiplies on the compute stream alone;
CUBLAS_WORKSPACE = 32 * 2**20  # decoding adds a CUDA graph's capture stream and a speculating policy's selection
# each chunk reads every earlier token of its rows again: chunks of at least 256 tokens, or of a 16th of a shorter
# prompt (a large batch of short prompts), keep those reads within 8 times the prompt's
SMALLEST_CHUNK, SHORTEST_CHUNK = 256, 32
Phase = str  # "run" | "prefill" | "decode"


@dataclass(frozen=True)
class Workload:
    batch: int
    context: int  # prompt tokens per row
    new_tokens: int = 0
    prefill_chunk: int | None = None  # None: the whole prompt in one forward
    # rows of different lengths, left-padded: every prefill attention then takes a mask, as an additive bias
    padded: bool = False
    # decode steps in transformers' own loop (not ``infinigen.decode``): each offloaded layer's selection is
    # then a CUDA graph of its own, whose memory pool keeps its workspace (``SelectionGraph``)
    layer_graphs: bool = False
    # its prompt may be kept (``cache.prompts``): pool blocks of the asked size, whatever the run's length, so
    # that prompts of any length share one row layout
    keeps: bool = False
    # each row's prompt prefilled alone in a cache of its own, then restored into the batch (kept prompts: each
    # row served and kept): the prefill's workspace is one row's, and each row's kept copy sits beside the pool
    rowwise: bool = False

    @property
    def tokens(self) -> int:
        return self.context + self.new_tokens

    @property
    def chunk(self) -> int:
        return min(self.prefill_chunk or self.context, self.context)


@dataclass(frozen=True)
class Part:
    name: str
    where: str  # "gpu" | "host"
    nbytes: int
    phase: Phase = "run"


@dataclass(frozen=True)
class MemoryPlan:
    policy: str
    workload: Workload
    config: RuntimeConfig  # the settings that run: the choices below applied
    parts: tuple[Part, ...]
    budget: int | None  # GPU bytes, or None: no budget given
    shed: tuple[str, ...] = ()  # what the budget made the plan give up, in order
    reuse: bool = False  # row reuse on (budgeted policies)
    model: Model | None = None  # what it planned for, in which dtype (``refusal`` plans around it)
    dtype: torch.dtype | None = None
    weights_loaded: bool = False  # the model is loaded: its streamed layers hold their host memory already
    asked: RuntimeConfig | None = None  # the settings it was asked to plan

    def gpu(self, phase: Phase | None = None) -> int:
        return sum(p.nbytes for p in self.parts if p.where == "gpu" and (phase is None or p.phase == phase))

    @property
    def peak_gpu(self) -> int:
        """The most PyTorch allocates at once: the held parts and the larger workspace."""
        return self.gpu("run") + max(self.gpu("prefill"), self.gpu("decode"))

    @property
    def needed_gpu(self) -> int:
        """What PyTorch's allocator must be able to take for the run: the peak and its slack."""
        return int(self.peak_gpu * (1 + SLACK))

    @property
    def host(self) -> int:
        return sum(p.nbytes for p in self.parts if p.where == "host")

    @property
    def fits(self) -> bool:
        return self.budget is None or self.needed_gpu <= self.budget


def plan_parts(model: Model, dtype: torch.dtype, work: Workload, config: RuntimeConfig, reuse_on: bool, **opts):
    """The parts of a run with these settings (``plan``'s inner step; ``opts``: channels, layer_budgets,
    ranks)."""
    spec, e = model.spec, dtype.itemsize
    policy = policy_class(config.policy)
    ranks = opts.get("ranks", 1)
    kv, d, heads, batch = spec.n_kv_heads // ranks, spec.head_dim, spec.n_heads // ranks, work.batch
    windows = model.windows
    offloaded = offloaded_layer_indices(windows, config.dense_layers, policy.offloads)
    offloaded_set = set(offloaded)
    dense = [i for i, w in enumerate(windows) if w is None and i not in offloaded_set]
    block = config.block_tokens
    capacity = -(-work.tokens // block) * block  # an offloaded pool's slots (whole blocks)
    kv_row = kv * d * 2 * e  # one token's K and V of every KV head of one batch row, on the GPU
    streamed = streamed_count(config, spec.n_layers)
    parts = [Part("weights", "gpu", model.weight_bytes // ranks - streamed * model.layer_bytes)]
    parts.append(Part("cuBLAS workspace", "gpu", CUBLAS_WORKSPACE))
    side_streams = int(config.cuda_graphs) + int(policy.speculates)
    if side_streams:
        parts.append(Part("decode: side streams' cuBLAS workspaces", "gpu", side_streams * CUBLAS_WORKSPACE, "decode"))
    if streamed:
        slots = weight_slots(config.policy, streamed) * model.layer_bytes
        parts.append(Part("weights: streaming slots", "gpu", slots))
        parts.append(Part(STREAMED_WEIGHTS, "host", streamed * model.layer_bytes))
    # at the run's length from the start: the decode loops tell the cache (``InfinigenCache.expect``)
    parts.append(Part("dense layers' KV", "gpu", len(dense) * batch * kv_row * work.tokens))
    sliding = sum(min(w, work.tokens) for w in windows if w is not None)
    parts.append(Part("sliding windows' KV", "gpu", batch * kv_row * sliding))
    if offloaded:
        channels = opts.get("channels") or padded_channels(math.ceil(d * 0.5))  # the default artifact's half
        kv_bits = row_bits(config)
        per_slot = 1 + (8 if kv_bits == 8 else 0) + (20 if config.cpu_pool_gb is not None else 0)
        per_slot += policy.slot_bytes(config, d, e, channels)
        factors = kv * 2 * d * 4 if kv_bits == 8 else 0  # 8-bit rows' channel factors a row, float32
        state = int(len(offloaded) * batch * (kv * capacity * per_slot + factors))
        parts.append(Part("offloaded layers' slot state", "gpu", state))
        if policy.speculates:  # partial key columns; the query's per head (OPT: folded rows over the hidden size)
            query = heads * channels * (d if spec.rope else model.hidden + 1)
            projections = len(offloaded) * (query + kv * d * channels) * e
            parts.append(Part("speculators' projections", "gpu", projections))
            if work.rowwise:
                parts.append(Part("prefill: a row's own cache's projections", "gpu", projections, "prefill"))
        budgets = opts.get("layer_budgets") or [config.budget] * len(offloaded)
        if reuse_on:
            extra, bits = config.resident_extra_or_default, config.resident_bits or 16
            resident = reuse.resident_bytes(batch, kv, d, e, capacity, budgets, config.min_tokens, extra, bits)
            parts.append(Part("decode: resident rows", "gpu", resident, "decode"))
        else:  # two staging buffers (layers alternate), each the largest fetch
            k = max(rows_bound(b, capacity, config.min_tokens) for b in set(budgets)) if policy.budgeted else capacity
            parts.append(Part("decode: fetch staging", "gpu", 2 * batch * kv_row * (k + 1), "decode"))
        pool = pool_size(spec, len(offloaded), batch, work.tokens, dtype, ranks, config)
        parts.append(Part("CPU KV pool", "host", pool.nbytes))
        if work.rowwise:  # each row's prompt as kept, its rows and its dense layers' KV, until it is restored
            kept = pool_size(spec, len(offloaded), batch, work.context, dtype, ranks, config).nbytes
            parts.append(Part("the rows' kept prompts", "host", kept + len(dense) * batch * kv_row * work.context))
        alone = 1 if work.rowwise else batch  # the rows a prefill forward takes
        stored = row_bytes(d, dtype, policy.codec, kv_bits) // 2  # one K or V, as the pool keeps it
        decoded = kv_bits == 8 and policy.codec is None  # 8-bit rows: dequantised beside their codes
        read = d * e if decoded else stored  # as a read leaves it
        staging = 2 * alone * kv * min(config.prefill_block_tokens, work.context) * 2 * (stored + decoded * read)
        parts.append(Part("prefill: earlier chunks' blocks", "gpu", staging, "prefill"))
        if config.prefill_fetch_ahead and not policy.observes_attention and work.chunk < work.context:
            past = work.chunk * ((work.context - 1) // work.chunk)  # at the last chunk
            parts.append(Part(FETCHED_AHEAD, "gpu", alone * kv * past * 2 * read, "prefill"))
        if config.exact:  # a verification reads every row as a chunk does, the decode's parts held meanwhile
            ahead = work.tokens * read if config.prefill_fetch_ahead and not policy.observes_attention else 0
            rows = batch * kv * 2 * (2 * config.prefill_block_tokens * (stored + decoded * read) + ahead)
            parts.append(Part("decode: exact decoding's verification", "gpu", rows, "decode"))
        selection = 3 * 4 * batch * kv * capacity  # scores, their ranks and counts, float32 / int32
        parts.append(Part("decode: selection workspace", "gpu", selection, "decode"))
        if work.layer_graphs and config.cuda_graphs:
            graphs = (len(offloaded) - 1) * selection
            parts.append(Part("decode: the other layers' selection graphs", "gpu", graphs, "decode"))
    prefilled = replace(work, batch=1, padded=False) if work.rowwise else work  # a forward's rows
    parts += _prefill_parts(model, prefilled, config, kv, heads, d, e)
    step = batch * (4 * model.hidden + 3 * model.intermediate + model.vocab) * e * 2
    parts.append(Part("decode: a step's activations", "gpu", step, "decode"))
    return parts


def _prefill_parts(model: Model, work: Workload, config: RuntimeConfig, kv: int, heads: int, d: int, e: int):
    """A prefill chunk's workspace, at the last chunk (the most keys): one layer's activations, the
    attention mask transformers builds over every key (booleans) where the prompt is chunked or padded, and
    the attention's (``attention_workspace``)."""
    batch, chunk, context = work.batch, work.chunk, work.context
    attention, mlp = layer_activations(model, heads, kv, d, batch * chunk * e)
    parts = [Part("prefill: a layer's activations", "gpu", attention, "prefill")]
    workspace = 0
    if chunk < context or work.padded:
        parts.append(Part("prefill: attention mask", "gpu", batch * chunk * context, "prefill"))
        workspace = attention_workspace(work, config, heads, d, e)
        parts.append(Part("prefill: attention", "gpu", workspace, "prefill"))
    parts.append(Part(MLP_BEYOND, "gpu", max(0, mlp - attention - workspace), "prefill"))
    parts.append(Part("prefill: logits", "gpu", batch * model.vocab * 4, "prefill"))
    return parts


MLP_BEYOND = "prefill: the MLP's activations beyond the attention's"
FETCHED_AHEAD = "prefill: the next layer's earlier blocks, fetched ahead"


def layer_activations(model: Model, heads: int, kv: int, d: int, token_bytes: int) -> tuple[int, int]:
    """A decoder layer's activations over a prefill chunk: while its attention runs (the residual and its
    normed copy, the projections before and after rotary, the output and its projection) and while its MLP
    runs (the residual and its normed copy, the MLP's three), for ``token_bytes`` (the chunk's tokens times
    the dtype's bytes). They are never live together, nor are the attention's workspace and the MLP's: the
    plan takes the larger moment (``MLP_BEYOND``)."""
    attention = 4 * model.hidden + 2 * (heads + 2 * kv) * d
    mlp = 2 * model.hidden + 3 * model.intermediate
    return token_bytes * attention, token_bytes * mlp


def attention_workspace(work: Workload, config: RuntimeConfig, heads: int, d: int, e: int) -> int:
    """The larger of a prefill's two attentions. The first chunk's is transformers' SDPA, which with a mask
    (padded rows) repeats the KV for every query head and takes the mask as a bias (``sdpa_bias_bytes``).
    A later chunk's runs over blocks of earlier keys (``kernels.chunk_attention``): a block's KV repeated
    for every query head (a masked block's, or the chunk's own), its output in 16 bits and in float32 beside
    the running float32 sum, and with padding the block's bias."""
    batch, chunk, context = work.batch, work.chunk, work.context
    first = batch * 3 * heads * chunk * d * e + sdpa_bias_bytes(batch, chunk, chunk, e) if work.padded else 0
    if chunk == context:
        return first

    def later(past: int) -> int:  # the chunk after ``past`` tokens: one block of them at a time
        queries = min(chunk, context - past)
        # only masked blocks (padding) and the chunk's own (causal) repeat their KV; the others fold each
        # KV head's query group into its queries (``chunk_attention``), within the chunk's own block's bytes
        keys = min(config.prefill_block_tokens, past) if work.padded else queries
        block = batch * heads * (2 * keys * d * e + queries * d * (e + 8))
        return block + (batch * queries * _aligned(keys) * e if work.padded else 0)

    # more keys make a chunk larger; only the last chunk has fewer queries: the last and the last full one
    last, last_full = chunk * ((context - 1) // chunk), chunk * ((context - chunk) // chunk)
    return max(first, later(last), later(last_full) if last_full >= chunk else 0)


def sdpa_bias_bytes(batch: int, queries: int, keys: int, e: int) -> int:
    """PyTorch's SDPA given a boolean mask: the mask as an additive bias in the query's dtype, copied again
    with its rows padded to 16 elements where they are not (the efficient kernel's alignment)."""
    copies = 1 if keys % ALIGN == 0 else 2
    return copies * batch * queries * _aligned(keys) * e


def _aligned(keys: int) -> int:
    """A bias row's elements: ``keys`` rounded up to the efficient kernel's alignment."""
    return -(-keys // ALIGN) * ALIGN


def plan(
    model: Model, dtype: torch.dtype, work: Workload, config: RuntimeConfig, budget: int | None = None, **opts
) -> MemoryPlan:
    """The plan of a run; under ``budget`` (GPU bytes) the first settings, in the shedding order of the
    module's docstring, whose run fits. Where none fits, the last tried: ``fits`` is False."""
    if not work.keeps:
        config = replace(config, block_tokens=pool_block_tokens(config.block_tokens, work.tokens))
    policy = policy_class(config.policy)
    auto_reuse = policy.budgeted and config.reuse_rows == "auto" and config.cpu_pool_gb is None
    reuse_on = policy.budgeted and (config.reuse_rows == "on" or auto_reuse)

    def planned(settings: RuntimeConfig, reused: bool, workload: Workload, streamed: int | None = None) -> MemoryPlan:
        if streamed is not None:
            settings = replace(settings, streamed_layers=streamed)
        parts = plan_parts(model, dtype, workload, settings, reused, **opts)
        shed = tuple(shedding.shed_steps(config, settings, reuse_on, reused, work, workload))
        return MemoryPlan(
            config.policy, workload, settings, tuple(parts), budget, shed, reused, model, dtype, asked=config
        )

    # 8-bit rows by default, 16-bit ones where nothing fits with their scales on the GPU
    behind = replace(config, prefill_fetch_ahead=False)  # kept last, where room is left (speed alone)
    formats = [behind] if row_bits(config) == 16 or config.kv_bits else [behind, replace(behind, kv_bits=16)]
    chunks, chunk = [work.prefill_chunk], work.prefill_chunk  # the asked, then halving from CHUNK to the smallest
    smallest = max(SHORTEST_CHUNK, min(SMALLEST_CHUNK, work.context // 16))
    while (chunk := CHUNK if chunk is None or chunk > CHUNK else chunk // 2) >= smallest:
        chunks += [chunk] if chunk < work.chunk else []
    candidates = [
        (settings, reused, replace(work, prefill_chunk=chunk))
        for asked in formats
        for settings, reused, chunk in shedding.candidates(asked, policy, tuple(chunks), auto_reuse, reuse_on)
    ]
    for i, (settings, *rest) in enumerate(candidates):
        if (tried := planned(settings, *rest)).fits:
            return shedding.fetching_ahead(config, candidates[i:], planned) or tried
    if config.streamed_layers is not None or not model.layer_bytes or opts.get("ranks", 1) > 1:
        return tried
    # the last resort: streamed weights, with the settings that move the fewest bytes (``streaming``)
    return streaming.least_moved(candidates, planned, model.spec.n_layers) or tried


def resident_room(
    model: Model, dtype: torch.dtype, batch: int, capacity: int, config: RuntimeConfig, budget: int, **opts
) -> int:
    """The GPU bytes a cache's resident rows may take while it decodes with pools of ``capacity`` slots: the
    budget less its slack and every other part held while decoding (auto reuse's room)."""
    work = Workload(batch, capacity)
    parts = plan_parts(model, dtype, work, config, reuse_on=False, **opts)
    held = [p for p in parts if p.where == "gpu" and p.phase != "prefill" and p.name != "decode: fetch staging"]
    return max(0, int(budget / (1 + SLACK)) - sum(p.nbytes for p in held))


def loaded_model(model, ranks: int = 1) -> Model:
    """``Model`` of a loaded model: its weights as loaded (every tensor-parallel rank's, quantised ones at their
    stored size) and its largest decoder layer (a streaming slot's size, wherever its parameters are now)."""
    from infinigen.tensor_parallel import quantised, weight_bytes

    if any(quantised(p) for p in model.parameters()):  # quantised weights do not stream (``StreamedWeights``)
        return Model(model.config, weight_bytes(model) * ranks)
    largest = max(
        slot_bytes(p.numel() * p.element_size() for p in layer.parameters()) for layer in decoder_layers(model)
    )
    return Model(model.config, weight_bytes(model) * ranks, largest)


def plan_for(model, config: RuntimeConfig, work: Workload, budget: int | None) -> MemoryPlan:
    """The plan of a run of a loaded ``model``."""
    from infinigen.tensor_parallel import world_size

    param, ranks = next(model.parameters()), world_size()
    found = plan(loaded_model(model, ranks), param.dtype, work, config, budget, ranks=ranks)
    return replace(found, weights_loaded=True)


def cache_settings(found: MemoryPlan) -> dict:
    """The ``RuntimeConfig`` fields a cache runs the plan with: its settings, row reuse as planned."""
    settings = {f: getattr(found.config, f) for f in found.config.__dataclass_fields__}
    if policy_class(found.policy).budgeted and found.config.reuse_rows == "auto":
        if found.budget is not None:
            settings["reuse_rows"] = "on" if found.reuse else "off"
            settings["resident_extra"] = found.config.resident_extra_or_default if found.reuse else None
        elif found.asked is not None:  # no budget: auto decides them as the pools grow, as asked
            settings |= {f: getattr(found.asked, f) for f in ("resident_extra", "resident_bits")}
    return settings


def summary(found: MemoryPlan) -> dict:
    """What a run's summary says of its plan."""
    return {
        "gpu_budget_gb": None if found.budget is None else gb(found.budget),
        "planned_peak_gpu_gb": gb(found.peak_gpu),
        "planned_host_gb": gb(found.host),
        "given_up": "; ".join(found.shed) or None,
        "streamed_layers": found.config.streamed_layers or 0,
    }


def budget_bytes(gpu_memory_gb: float | None, device: torch.device) -> int | None:
    """The plan's budget: ``gpu_memory_gb`` less the CUDA context, else the device's free memory now and
    what PyTorch holds already (the weights, where they are loaded: the plan counts them); None on the
    CPU without a size given."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * 1e9) - CONTEXT_BYTES
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


def why_not(found: MemoryPlan, **opts) -> str | None:
    """Why a run with this plan cannot start, in one line, or None where it can: its GPU memory over the
    budget (``refusal``), or its CPU pool over the host memory available now (pinned pages cannot be
    swapped: a pool larger than the free memory ends the process in the host's out-of-memory killer)."""
    if not found.fits:
        return "does not fit: " + refusal(found, **opts)
    if not fits_host(found):
        work, available = found.workload, host_available_bytes()
        weights = 0 if found.weights_loaded else _streamed_weights(found)
        what = f" and streamed weights ({gb(weights)} GB)" if weights else ""
        return (
            f"does not fit in host memory: {work.batch} x {work.context} tokens (+{work.new_tokens} new) with "
            f"{found.policy} needs {gb(_host_needed(found))} GB for its CPU KV pool{what}, {gb(available)} GB is "
            f"available; {'--kv-bits 8 halves the pool, ' if row_bits(found.config) == 16 else ''}--cpu-pool-gb caps "
            "it (evicting), or a shorter context or batch"
        )
    return None


def fits_host(found: MemoryPlan) -> bool:
    available = host_available_bytes()
    return available is None or _host_needed(found) <= available


def _host_needed(found: MemoryPlan) -> int:
    """The host memory a run must still take: its plan's, less streamed weights loaded already."""
    return found.host - (_streamed_weights(found) if found.weights_loaded else 0)


def _streamed_weights(found: MemoryPlan) -> int:
    return sum(p.nbytes for p in found.parts if p.name == STREAMED_WEIGHTS)


def host_available_bytes() -> int | None:
    """The host memory a new pool can have now: Linux's MemAvailable and the retired blocks of dropped
    pools (``host_memory``: reused or freed by the next plan); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            free = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return None if free is None else free + host_memory.retired_bytes()


def refusal(found: MemoryPlan, **opts) -> str:
    """One line for a plan that does not fit: what it needs against the budget, and the nearest settings
    that would fit (a shorter context, a smaller batch, 8-bit rows)."""
    work, config, model, dtype = found.workload, found.config, found.model, found.dtype
    need, budget = gb(found.needed_gpu), gb(found.budget)
    line = f"{work.batch} x {work.context} tokens (+{work.new_tokens} new) with {config.policy} needs {need} GB"
    line += f" of GPU memory, the budget is {budget} GB (the weights alone {gb(model.weight_bytes)} GB)"

    def fits(**changes) -> bool:
        workload = replace(work, **{k: v for k, v in changes.items() if k in ("batch", "context")})
        settings = replace(config, **{k: v for k, v in changes.items() if k not in ("batch", "context")})
        return plan(model, dtype, workload, settings, found.budget, **opts).fits

    nearest = []
    context = largest(lambda n: fits(context=n), 1, work.context) if work.context > 1 else 0
    if context >= 1:
        nearest.append(f"--context {context}")
    batch = largest(lambda n: fits(batch=n), 1, work.batch) if work.batch > 1 else 0
    if batch >= 1:
        nearest.append(f"--batch {batch}")
    policy = policy_class(config.policy)
    if policy.plain_rows and policy.offloads and row_bits(config) == 16 and fits(kv_bits=8):
        nearest.append("--kv-bits 8")
    if found.budget is not None and model.weight_bytes > found.budget:
        return line + ": the weights alone do not fit"
    return line + (f"; nearest that fits: {', or '.join(nearest)}" if nearest else "; nothing smaller fits either")
