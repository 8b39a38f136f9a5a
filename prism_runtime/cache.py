"""Verified, site-local cache files of start-up work (a deployed site starts a fresh ClientApp
process for every message, so work done at start is otherwise repeated every round).

A cache file is one safetensors file whose metadata holds the format, the full KEY (a SHA-256
over everything the content depends on) and a DIGEST of the tensors (names, dtypes, shapes and
bytes). It is written atomically (``prism_runtime.durable.atomic_write``: temporary file, fsync,
rename), readable by the site's user only (mode ``0600``, folder ``0700``: a tokenised shard is
private data). On load, a file that cannot be parsed (truncated, not safetensors), holds another
key or format, or whose tensors do not match their digest is logged and ignored: the caller
recomputes and overwrites it. A cache that cannot be written (read-only folder, full disk) is
logged; the site goes on without it. Nothing here ever raises on a bad cache.

Where: ``SitePolicy.cache_dir`` (``client.policy``), from the site's own node config
(``cache-dir``), else the site process's ``PRISM_CACHE_DIR``, else ``<state-dir>/cache`` when the
node config sets ``state-dir``; never from the run config or a message.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from prism_runtime.durable import atomic_write, make_dirs

__all__ = [
    "CACHE_DIR_ENV",
    "FORMAT",
    "cached_float",
    "key_of",
    "load_tensors",
    "save_tensors",
    "tensor_digest",
]

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "PRISM_CACHE_DIR"
"""Environment variable of the SITE process naming its cache folder (see the module doc)."""

FORMAT = "prism-fl-cache-1"
"""Format tag in every cache file's metadata (part of every key, too)."""


def key_of(parts: Mapping[str, object]) -> str:
    """SHA-256 (hex) of ``parts`` as canonical JSON (sorted keys), with the format tag."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_digest(tensors: Mapping[str, Tensor]) -> str:
    """SHA-256 (hex) over the sorted names, dtypes, shapes and bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_tensors(path: Path, tensors: Mapping[str, Tensor], key: str) -> bool:
    """Write ``tensors`` under ``key`` to ``path`` (atomic, mode 0600); False if it failed."""
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    metadata = {"format": FORMAT, "key": key, "digest": tensor_digest(cpu)}
    try:
        if not path.parent.exists():
            make_dirs(path.parent)
            os.chmod(path.parent, 0o700)
        data = safetensors_bytes(cpu, metadata=metadata)
        atomic_write(path, lambda f: f.write(data), mode=0o600)
    except OSError as exc:
        log.warning("cannot write the cache file %s (%s); going on without it", path, exc)
        return False
    return True


def load_tensors(path: Path, key: str) -> dict[str, Tensor] | None:
    """The tensors stored under ``key`` at ``path``, or None (missing, or not trusted: logged).

    Trusted only when the file parses, its format and key are ``FORMAT`` and ``key``, and its
    tensors match the digest stored with them.
    """
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types on a bad file
        log.warning("cache file %s is unreadable (%s); recomputing", path, exc)
        return None
    if metadata.get("format") != FORMAT or metadata.get("key") != key:
        log.warning("cache file %s was made for other inputs (key mismatch); recomputing", path)
        return None
    if tensor_digest(tensors) != metadata.get("digest"):
        log.warning("cache file %s does not match its digest (corrupt); recomputing", path)
        return None
    return tensors


def cached_float(
    cache_dir: Path | None, parts: Mapping[str, object], compute: Callable[[], float]
) -> float:
    """``compute()``, stored in ``cache_dir`` under the key of ``parts`` and read back later.

    For deterministic start-up results such as a calibrated noise multiplier: ``parts`` must
    name every input of ``compute`` (and the versions of the code it runs). The value is
    stored as a float64 and returned bit for bit.
    """
    if cache_dir is None:
        return compute()
    key = key_of(parts)
    path = cache_dir / f"value-{key[:32]}.safetensors"
    stored = load_tensors(path, key)
    value = stored.get("value") if stored is not None else None
    if value is not None and value.dtype == torch.float64 and value.numel() == 1:
        return float(value.item())
    result = compute()
    save_tensors(path, {"value": torch.tensor([result], dtype=torch.float64)}, key)
    return result
