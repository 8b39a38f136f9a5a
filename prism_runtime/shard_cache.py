"""The site's tokenised shard, cached in its own cache folder (``prism_runtime.cache``).

A deployed site starts a fresh ClientApp process for every message; tokenising its whole shard each
time is repeated work. ``cached_items`` stores the items of ``prism_runtime.data.TokenizedDataset``
once (mode 0600: it is the site's private data, in token form) and reads them back in later
processes, equal item for item (keys, dtypes, shapes, values, Python ``int`` labels).

The key covers what the items depend on: the examples themselves (every field of every row, in
order: a changed data file, partition or synthetic seed is a new key), the tokenizer's identity
(class, its full serialised definition or vocabulary, special tokens, padding and truncation
sides), the task, ``max_length``, ``pair_encoding``, ``train_on_prompt`` and the transformers
and tokenizers versions. The cache folder comes from the site's own configuration only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from prism_runtime.cache import key_of, load_tensors, save_tensors

__all__ = ["cached_items", "decode_items", "encode_items", "shard_key"]

log = logging.getLogger(__name__)

Item = dict[str, Any]

_ABSENT, _INT = -1, 0  # the "ndim" of a key an item lacks / of a Python int value


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what decides the tokens: the definition, vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        # The truncation and padding a call last set are per-call state: every call here passes
        # its own (truncation=True, max_length, no padding), which the key covers.
        spec.pop("truncation", None)
        spec.pop("padding", None)
        definition = json.dumps(spec, sort_keys=True)
    else:
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = {
        "class": type(tokenizer).__name__,
        "definition": hashlib.sha256(definition.encode()).hexdigest(),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "ids": [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id],
        "sides": [tokenizer.padding_side, tokenizer.truncation_side],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def shard_key(
    examples: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: str,
    max_length: int,
    pair_encoding: str,
    train_on_prompt: bool,
) -> str:
    """The cache key of the tokenised ``examples`` (module doc)."""
    rows = hashlib.sha256()
    for ex in examples:
        rows.update(json.dumps(ex, sort_keys=True, ensure_ascii=False).encode())
        rows.update(b"\n")
    return key_of(
        {
            "what": "tokenised shard",
            "rows": rows.hexdigest(),
            "count": len(examples),
            "tokenizer": _tokenizer_identity(tokenizer),
            "task": task,
            "max-length": max_length,
            "pair-encoding": pair_encoding,
            "train-on-prompt": train_on_prompt,
            "versions": [transformers.__version__, _tokenizers_version()],
        }
    )


def _tokenizers_version() -> str:
    try:
        import tokenizers
    except ImportError:  # a slow tokenizer only
        return ""
    return str(tokenizers.__version__)


def encode_items(items: Sequence[Item]) -> dict[str, Tensor] | None:
    """Items as flat tensors: per key its values and one ``(ndim, d0, d1)`` row per item.

    None when an item holds something other than int64 tensors of at most 2 dimensions or
    Python ints (then nothing is cached).
    """
    keys = sorted({k for item in items for k in item})
    out: dict[str, Tensor] = {}
    for k in keys:
        shapes, values = [], []
        for item in items:
            v = item.get(k)
            if v is None:
                shapes.append((_ABSENT, 0, 0))
            elif type(v) is int:
                shapes.append((_INT, 0, 0))
                values.append(torch.tensor([v], dtype=torch.long))
            elif isinstance(v, Tensor) and v.dtype == torch.long and v.dim() in (1, 2):
                d0, d1 = (*v.shape, 0)[:2]
                shapes.append((v.dim(), int(d0), int(d1)))
                values.append(v.reshape(-1))
            else:
                return None
        out[f"{k}/shape"] = torch.tensor(shapes, dtype=torch.long).reshape(-1, 3)
        out[f"{k}/values"] = torch.cat(values) if values else torch.zeros(0, dtype=torch.long)
    return out


def decode_items(tensors: Mapping[str, Tensor]) -> list[Item] | None:
    """The items ``encode_items`` stored, or None when the tensors are inconsistent."""
    keys = sorted({name.rsplit("/", 1)[0] for name in tensors})
    if any(f"{k}/shape" not in tensors or f"{k}/values" not in tensors for k in keys):
        return None
    counts = {int(tensors[f"{k}/shape"].shape[0]) for k in keys}
    if len(counts) != 1:
        return None
    items: list[Item] = [{} for _ in range(counts.pop())]
    for k in keys:
        shapes, values = tensors[f"{k}/shape"].tolist(), tensors[f"{k}/values"]
        sizes = [1 if nd == _INT else d0 * (d1 if nd == 2 else 1) for nd, d0, d1 in shapes]
        if any(n < 0 for n in sizes) or sum(sizes) != values.numel() or values.dtype != torch.long:
            return None
        parts = torch.split(values, sizes)
        for item, (nd, d0, d1), v in zip(items, shapes, parts, strict=True):
            if nd == _INT:
                item[k] = int(v.item())
            elif nd == 1:
                item[k] = v.clone()
            elif nd == 2:
                item[k] = v.reshape(d0, d1).clone()
            elif nd != _ABSENT:
                return None
    return items


def cached_items(cache_dir: Path, key: str, tokenize: Callable[[], list[Item]]) -> list[Item]:
    """The tokenised items stored under ``key`` in ``cache_dir``, else ``tokenize()`` (stored)."""
    path = cache_dir / f"shard-{key[:32]}.safetensors"
    stored = load_tensors(path, key)
    if stored is not None:
        items = decode_items(stored)
        if items is not None:
            log.info("tokenised shard read from %s (%d examples)", path, len(items))
            return items
        log.warning("cache file %s holds an inconsistent shard; recomputing", path)
    items = tokenize()
    encoded = encode_items(items)
    if encoded is not None and save_tensors(path, encoded, key):
        log.info("tokenised shard stored in %s (%d examples)", path, len(items))
    return items
