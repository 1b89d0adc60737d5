"""The artifact's model card: Hub metadata plus the evidence that skewing works."""

from __future__ import annotations

from infinigen.artifacts.manifest import DEFAULT_METHOD, Manifest


def render_card(manifest: Manifest) -> str:
    base = manifest.base_model
    spec = manifest.spec
    front = ["---", "library_name: infinigen"]
    if base.hub_id:
        front.append(f"base_model: {base.hub_id}")
    front += ["tags:", "- infinigen", "- kv-cache", "- long-context", "- offloading", "---", ""]
    energy_before, energy_after = manifest.mean_energy()
    sources = ", ".join(f"{s.name} ({s.tokens} tokens)" for s in manifest.calibration.sources)
    lines = [
        f"# InfiniGen skew artifact for {base.model_id}",
        "",
        "Per-layer, per-KV-head skew matrices and partial-channel indices for InfiniGen's speculative",
        "KV-cache prefetch (OSDI 2024), made with the `infinigen` tool:",
        "",
        "```bash",
        f'infinigen generate --artifact <this repo> {base.model_id} --prompt "..."',
        "```",
        "",
        "| | |",
        "| --- | --- |",
        f"| base model | `{base.model_id}` (revision `{base.revision or 'n/a'}`) |",
        f"| q/k fingerprint | `{base.fingerprint}` |",
        f"| architecture | {spec.model_type}: {spec.n_layers} layers, {spec.n_heads} heads, "
        f"{spec.n_kv_heads} KV heads, head_dim {spec.head_dim} |",
        f"| kept channels | {manifest.n_channels} of {spec.head_dim} (ratio {manifest.ratio}) |",
        f"| method | skew {manifest.method['skew']}, channels {manifest.method['channels']}"
        + (" (an ablation, not InfiniGen)" if manifest.method != DEFAULT_METHOD else "")
        + " |",
        f"| calibration | {sources} |",
        f"| created | {manifest.created} with {', '.join(f'{k} {v}' for k, v in manifest.versions.items())} |",
        "",
        "## Score energy carried by the kept channels",
        "",
        "Share of the attention-score energy ‖Q K_cᵀ‖²_F (calibration q/k of each KV head, keys centred",
        "over tokens; mean over KV heads) that the kept channels reproduce, with the channels chosen",
        "the same way from unskewed (before) and skewed (after) q/k. Higher means the partial query",
        f"and key cache predict attention better. Mean over layers: {energy_before:.3f} → {energy_after:.3f}.",
        "",
        "| layer | before | after |",
        "| ---: | ---: | ---: |",
        *(f"| {e.layer} | {e.before:.3f} | {e.after:.3f} |" for e in manifest.energy),
        "",
    ]
    return "\n".join(front + lines)
