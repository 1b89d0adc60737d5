"""A kept prompt in a file (llama.cpp's ``--prompt-cache FILE``): one safetensors file, its JSON manifest in
the header's metadata, every tensor as the cache holds it (pool rows as stored, scales, partial keys, dense
layers' KV), each with a CRC-32.

Written to a temporary file beside the target and renamed over it: a process killed while saving leaves the
previous file whole. Read straight into pinned host blocks made ahead on worker threads (``host_memory``),
the checksums computed on other threads as the reads go on. A file that is cut, altered, of another format
version, or made for another model, artifact or settings is refused in one line (``PromptFileError``).

    layers.{i}.block.{j}   an offloaded layer's pool blocks (B, kv_heads, block_tokens, 2, width)
    layers.{i}.{name}      the layer's other state (``kept.LayerState.tensors``)
    tokens                 the prompt's token ids (N,) int64
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from infinigen.errors import InfinigenError
from infinigen.runtime.cache.kept import KeptPrompt, LayerState
from infinigen.runtime.memory.host_memory import HostBlocks, as_bytes

FORMAT, VERSION = "infinigen-prompt", 1
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_CHECKSUMS = ThreadPoolExecutor(4, thread_name_prefix="infinigen-crc")  # zlib releases the GIL over a buffer


class PromptFileError(InfinigenError):
    """A prompt file that cannot serve this run: one line, exit code 2."""


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(tensor).numpy()) if tensor.numel() else 0


def _named(kept: KeptPrompt) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i, layer in enumerate(kept.layers):
        named += [(f"layers.{i}.block.{j}", block) for j, block in enumerate(layer.blocks)]
        named += [(f"layers.{i}.{name}", tensor) for name, tensor in layer.tensors.items()]
    return [*named, ("tokens", kept.tokens)]


def save_prompt(kept: KeptPrompt, path: str | Path) -> int:
    """Write ``kept`` to ``path`` atomically; returns the file's bytes."""
    path = Path(path)
    named = [(name, tensor.contiguous()) for name, tensor in _named(kept)]
    checksums = list(_CHECKSUMS.map(_crc, [tensor for _, tensor in named]))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "key": kept.key,
        "tokens": kept.length,
        "block_tokens": kept.block_tokens,
        "cuttable": kept.cuttable,
        "layers": [{"kind": layer.kind, "blocks": len(layer.blocks)} for layer in kept.layers],
        "crc32": dict(zip((name for name, _ in named), checksums, strict=True)),
    }
    header: dict = {"__metadata__": {"format": FORMAT, "infinigen": json.dumps(manifest)}}
    offset = 0
    for name, tensor in named:
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, 0]}
        offset += tensor.nbytes
        header[name]["data_offsets"][1] = offset
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            for _, tensor in named:
                if tensor.numel():
                    file.write(as_bytes(tensor).numpy().data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise PromptFileError(f"cannot write the prompt file {path}: {exc.strerror or exc}") from None
    return 8 + len(text) + offset


def read_manifest(path: str | Path) -> tuple[dict, dict, int]:
    """A prompt file's manifest, its tensors' header entries and where their data starts (nothing read
    beyond the header): refused in one line where it is no prompt file of this version, or cut."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            (length,) = struct.unpack("<Q", file.read(8)) if size >= 8 else (None,)
            if length is None or length > min(size - 8, 1 << 30):
                raise PromptFileError(f"{path} is no prompt file (or it is cut): its header does not fit in it")
            header = json.loads(file.read(length))
    except OSError as exc:
        raise PromptFileError(f"cannot read the prompt file {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PromptFileError(f"{path} is no prompt file, or its header is damaged") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise PromptFileError(f"{path} is no infinigen prompt file")
    try:
        manifest = json.loads(metadata["infinigen"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise PromptFileError(f"{path}: its manifest is damaged") from None
    if manifest.get("version") != VERSION:
        version = manifest.get("version")
        raise PromptFileError(f"{path} is a prompt file of version {version}; this infinigen reads {VERSION}")
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end != size:
        raise PromptFileError(f"{path} is cut or padded: {size} bytes where its header says {8 + length + end}")
    return manifest, header, 8 + length


def load_prompt(path: str | Path, device: torch.device | str) -> KeptPrompt:
    """A prompt file as a kept prompt for caches on ``device``, read into pinned host memory (CUDA)."""
    path, device = Path(path), torch.device(device)
    manifest, header, start = read_manifest(path)
    try:
        entries = [(name, _BY_NAME[e["dtype"]], tuple(e["shape"]), *e["data_offsets"]) for name, e in header.items()]
        checksums = manifest["crc32"]
        kinds = [(layer["kind"], layer["blocks"]) for layer in manifest["layers"]]
    except (KeyError, TypeError, ValueError):
        raise PromptFileError(f"{path}: its manifest or header is damaged") from None
    host = HostBlocks(device)
    host.plan([end - begin for name, _, _, begin, end in entries if end > begin and name != "tokens"])
    tensors, pending = {}, []
    with open(path, "rb") as file:
        for name, dtype, shape, begin, end in entries:
            if end == begin or name == "tokens":  # the token ids in plain memory, the rest in pinned blocks
                block = torch.empty(end - begin, dtype=torch.uint8)
            else:
                block = host.take(end - begin)
            file.seek(start + begin)
            if file.readinto(block.numpy().data) != end - begin:
                raise PromptFileError(f"{path} is cut")
            tensors[name] = block.view(dtype).view(shape)
            pending.append((name, _CHECKSUMS.submit(_crc, block)))
    for name, crc in pending:
        if crc.result() != checksums.get(name):
            raise PromptFileError(f"{path} is damaged: the checksum of {name} does not match its manifest")
    try:
        layers = []
        for i, (kind, blocks) in enumerate(kinds):
            own = {n.split(".", 2)[2]: t for n, t in tensors.items() if n.startswith(f"layers.{i}.")}
            state = {name: t for name, t in own.items() if not name.startswith("block.")}
            layers.append(LayerState(kind, state, [own[f"block.{j}"] for j in range(blocks)]))
        tokens = tensors["tokens"]
        kept = KeptPrompt(manifest["key"], device, tokens, manifest["block_tokens"], manifest["cuttable"], layers)
    except KeyError as exc:
        raise PromptFileError(f"{path}: the tensor {exc} its manifest names is missing") from None
    if kept.length != manifest["tokens"]:
        raise PromptFileError(f"{path}: {kept.length} token ids where its manifest says {manifest['tokens']}")
    return kept


def check_prompt(kept: KeptPrompt, key: dict, tokens: torch.Tensor, path: str | Path) -> int:
    """The tokens of ``tokens`` (N,) the prompt file ``kept`` serves for a cache of ``key``, refused in one line
    where it was made for another model, artifact or settings, or this prompt does not start with it."""
    tokens = tokens.cpu()
    served = kept.usable(tokens)
    if not served:
        n = min(kept.length, tokens.numel())
        differs = (kept.tokens[:n] != tokens[:n]).nonzero()
        at = int(differs[0]) if differs.numel() else n
        if not kept.cuttable:
            why = "; its KV serves only prompts that extend it whole"
        elif kept.key.get("kv_bits") == 8:
            why = f"; 8-bit rows serve only past their first chunk of {kept.key.get('prefill_chunk')} tokens"
        else:
            why = ""
        raise PromptFileError(
            f"{path} holds a prompt of {kept.length} tokens this prompt does not start with (they differ "
            f"from token {at}{why})"
        )
    for name in sorted(set(kept.key) | set(key)):
        if kept.key.get(name) != key.get(name):
            made, here = kept.key.get(name), key.get(name)
            if name in ("model", "artifact"):
                raise PromptFileError(f"{path} was made for another {name} ({made}; this run's: {here})")
            raise PromptFileError(f"{path} was made with {name} {made}; this run has {here}")
    return served
