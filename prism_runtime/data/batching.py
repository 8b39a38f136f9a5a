"""Batching: right-padding collate, Poisson-sampled logical batches (Opacus ``DPDataLoader``,
so the accountant's Poisson assumption holds) and length-aware micro-batches."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from torch import Tensor
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from prism_runtime.data.reading import (
    IGNORE_INDEX,
    Collate,
    check_task,
    pad_id,
    uses_token_type_ids,
)
from prism_runtime.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PadCollate:
    """Right-pads a list of items to the longest one; an empty list gives 0-row tensors.

    Items of siamese pairs hold (2, L_i) tensors: they are padded along the last dimension and
    stacked to (B, 2, L).
    """

    pad_values: tuple[tuple[str, int], ...]  # sequence keys and their padding value
    scalar_labels: bool  # seq-cls: labels are one int per example

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not batch:
            return self._empty()
        out = {key: _pad([item[key] for item in batch], value) for key, value in self.pad_values}
        if self.scalar_labels:
            labelled = sum("labels" in item for item in batch)
            if labelled not in (0, len(batch)):
                raise DataError("A batch mixes examples with and without labels.")
            if labelled:
                out["labels"] = torch.tensor(
                    [int(item["labels"]) for item in batch], dtype=torch.long
                )
        return out

    def _empty(self) -> dict[str, Tensor]:
        out = {key: torch.zeros((0, 0), dtype=torch.long) for key, _ in self.pad_values}
        if self.scalar_labels:
            out["labels"] = torch.zeros((0,), dtype=torch.long)
        return out


def _pad(values: Sequence[Any], padding_value: int) -> Tensor:
    """(B, L) from 1-D sequences, or (B, k, L) from (k, L_i) tensors, right-padded."""
    tensors = [torch.as_tensor(v, dtype=torch.long) for v in values]
    if tensors[0].dim() == 1:
        return torch.nn.utils.rnn.pad_sequence(
            tensors, batch_first=True, padding_value=padding_value
        )
    width = max(int(t.shape[-1]) for t in tensors)
    out = torch.full((len(tensors), *tensors[0].shape[:-1], width), padding_value)
    for row, t in enumerate(tensors):
        out[row, ..., : t.shape[-1]] = t
    return out


def make_collate(tokenizer: PreTrainedTokenizerBase, task: str) -> Collate:
    """Collate function that pads a batch of :class:`TokenizedDataset` items.

    Sequences are right-padded to the longest item of the batch (siamese pairs: (B, 2, L),
    both texts of every pair to the longest text of the batch): ``input_ids`` with the
    tokenizer's pad id (its eos id if it has no pad token), ``attention_mask`` and
    ``token_type_ids`` with 0, causal-lm ``labels`` with ``IGNORE_INDEX``. seq-cls ``labels``
    become a 1-D tensor. An empty batch (possible under Poisson sampling) gives the same keys
    with a leading dimension 0: ``(0, 0)`` for sequences, ``(0,)`` for seq-cls labels.

    Args:
        tokenizer: The tokenizer used to build the dataset.
        task: ``"seq-cls"`` or ``"causal-lm"``.

    Returns:
        A picklable callable mapping a list of items to a dict of ``torch.long`` tensors.

    Raises:
        ConfigError: Unknown task, or the tokenizer has neither a pad nor an eos token.
    """
    check_task(task)
    pad_values = [("input_ids", pad_id(tokenizer)), ("attention_mask", 0)]
    if uses_token_type_ids(tokenizer, task):
        pad_values.append(("token_type_ids", 0))
    if task == "causal-lm":
        pad_values.append(("labels", IGNORE_INDEX))
    return _PadCollate(tuple(pad_values), scalar_labels=task == "seq-cls")


def poisson_loader(
    dataset: Dataset[Any],
    *,
    expected_batch_size: int,
    collate_fn: Collate,
    generator: torch.Generator,
    sample_rate: float | None = None,
) -> tuple[DPDataLoader, float]:
    """Opacus data loader with Poisson sampling of rate ``q = expected_batch_size / len(dataset)``.

    Every batch includes each example independently with probability ``q``, so batch sizes vary
    and a batch may be empty. One pass over the loader yields ``int(1 / q)`` batches (Opacus'
    convention). The sampling draws only from ``generator``, so a seeded generator makes the
    sequence of batches reproducible.

    Opacus wraps ``collate_fn`` in a stateful ``CollateFnWithEmpty`` that bypasses it for empty
    batches: it copies the structure of the first non-empty batch (keeping its sequence length)
    and, when the very first batch is empty and items are dicts, fails with a ``TypeError``.
    ``collate_fn`` must therefore handle an empty list itself (as :func:`make_collate` does) and
    is installed in place of that wrapper.

    Args:
        dataset: A map-style dataset, e.g. :class:`TokenizedDataset`.
        expected_batch_size: Mean batch size ``q * len(dataset)``, in ``[1, len(dataset)]``.
        collate_fn: Batch builder that returns 0-row tensors for an empty list.
        generator: Source of the sampling randomness.
        sample_rate: ``q`` itself, in ``(0, 1]`` (one public rate for every site of a
            secure-aggregation run); ``expected_batch_size`` is then not used.

    Returns:
        The loader and the sample rate ``q`` to record in the privacy ledger.

    Raises:
        ConfigError: The dataset is empty, ``expected_batch_size`` is out of range, or
            ``collate_fn`` fails on an empty batch.
    """
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise ConfigError("The dataset is empty: there is nothing to sample.")
    if sample_rate is not None and not 0 < sample_rate <= 1:
        raise ConfigError(f"The sample rate must be in (0, 1], got {sample_rate}.")
    if sample_rate is None and not 1 <= expected_batch_size <= size:
        raise ConfigError(
            f"expected_batch_size must be between 1 and the dataset size {size}, got "
            f"{expected_batch_size}. Lower it or give this site more data."
        )
    _check_empty_collate(collate_fn)
    if sample_rate is None:
        sample_rate = expected_batch_size / size
    loader = DPDataLoader(
        dataset, sample_rate=sample_rate, collate_fn=collate_fn, generator=generator
    )
    loader.collate_fn = collate_fn  # replace Opacus' stateful empty-batch wrapper (see above)
    logger.debug(
        "Poisson loader: N=%d, q=%.6g, %d batches per pass", size, sample_rate, len(loader)
    )
    return loader, sample_rate


def _check_empty_collate(collate_fn: Collate) -> None:
    try:
        empty = collate_fn([])
    except Exception as err:
        raise ConfigError(
            f"collate_fn fails on an empty batch ({err!r}), which Poisson sampling can draw. "
            "Use make_collate(...) or return 0-row tensors for an empty list."
        ) from err
    if not isinstance(empty, Mapping) or any(
        not isinstance(v, Tensor) or v.ndim == 0 or v.shape[0] != 0 for v in empty.values()
    ):
        raise ConfigError(
            "collate_fn([]) must return a dict of tensors with leading dimension 0. "
            "Use make_collate(...)."
        )


def micro_batches(
    batch: Mapping[str, Tensor],
    micro_batch_size: int,
    *,
    trim_padding: bool = True,
    by_length: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Split a logical batch into micro-batches along dimension 0.

    Args:
        batch: Dict of tensors sharing their first dimension (a collated batch).
        micro_batch_size: Maximum number of examples per micro-batch.
        trim_padding: Drop trailing columns that are padding (``attention_mask`` all 0) in every
            row of the micro-batch, from each tensor whose second dimension matches the mask's.
            Assumes right padding, as produced by :func:`make_collate`.
        by_length: Length-aware micro-batching: order the rows by their token count (the longer
            text of a siamese pair) and split them into consecutive groups of at most
            ``micro_batch_size`` rows chosen by ``length_groups`` (padding saved against the
            cost of one more pass), each trimmed to its own longest row: far fewer padding
            tokens are computed (SST-2 at batch 128: 2.6x fewer than in order). Privacy is
            unaffected: which examples are in the batch is the Poisson draw's alone, every
            example's gradient is computed and clipped on its own (an attention mask makes
            padding irrelevant to it), and the clipped SUM does not depend on the order or the
            grouping of its terms. For sums only: rows come out in length order.

    Yields:
        Dicts with the same keys; their rows, concatenated, are the rows of ``batch`` (in
        order unless ``by_length``). An empty batch yields nothing: the caller must still take
        its (noise-only) DP step.

    Raises:
        ConfigError: ``micro_batch_size < 1``.
        ValueError: The tensors of ``batch`` disagree on their first dimension.
    """
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be at least 1, got {micro_batch_size}.")
    sizes = {key: int(value.shape[0]) for key, value in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Batch tensors disagree on the batch dimension: {sizes}.")
    total = next(iter(sizes.values()), 0)
    mask = batch.get("attention_mask")
    sizes_list = [micro_batch_size] * (total // micro_batch_size)
    sizes_list += [total % micro_batch_size] if total % micro_batch_size else []
    if by_length and total > 1 and mask is not None and mask.ndim >= 2:
        lengths = mask.ne(0).reshape(total, -1, mask.shape[-1]).sum(dim=-1).amax(dim=1)
        order = torch.argsort(lengths, stable=True)
        batch = {key: value[order] for key, value in batch.items()}
        sizes_list = length_groups(lengths[order].tolist(), micro_batch_size)
    start = 0
    for size in sizes_list:
        micro = {key: value[start : start + size] for key, value in batch.items()}
        start += size
        yield _trim_padding(micro) if trim_padding else micro


MICRO_BATCH_OVERHEAD_TOKENS = 128
"""The fixed cost of one forward/backward pass (kernel launches, the per-example rows' layer
calls, a clip), in padded tokens of compute: what a further split must save to be worth it
(``length_groups``; swept with ``bench/step.py --data sst2``, docs/benchmarks.md: PRISM and
non-DP LoRA both fastest, or within their spread, at 128)."""


def length_groups(
    lengths: Sequence[int],
    cap: int,
    overhead: float = MICRO_BATCH_OVERHEAD_TOKENS,
    *,
    counts: Sequence[int] | None = None,
) -> list[int]:
    """Sizes of consecutive groups of the SORTED ``lengths`` (ascending), each of at most ``cap``
    rows, minimising the compute ``sum over groups of (rows x longest row + overhead)``.

    A group is padded to its longest row, its last one. Exact, by dynamic programming over the
    cut points (``O(len(lengths) x cap)``): short rows get small groups only when the padding
    they save outweighs the extra passes.

    ``counts``: item ``i`` is ``counts[i]`` rows of length at most ``lengths[i]`` that stay
    together (a person's records, ``prism_runtime.data.units``); the sizes are then numbers of
    items, a group holds at most ``cap`` rows, or one item alone when it has more. None: one
    row per item.
    """
    n = len(lengths)
    prefix = [0]
    for rows in [1] * n if counts is None else counts:
        prefix.append(prefix[-1] + rows)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    low = 0
    for end in range(1, n + 1):
        width = lengths[end - 1]
        while low < end - 1 and prefix[end] - prefix[low] > cap:
            low += 1
        for begin in range(low, end):
            cost = best[begin] + (prefix[end] - prefix[begin]) * width + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    sizes: list[int] = []
    end = n
    while end > 0:
        sizes.append(end - cut[end])
        end = cut[end]
    return sizes[::-1]


def _trim_padding(micro: dict[str, Tensor]) -> dict[str, Tensor]:
    """``micro`` without its trailing all-padding columns (right padding, see ``micro_batches``)."""
    mask = micro.get("attention_mask")
    if mask is None or mask.ndim < 2:
        return micro
    width = mask.shape[-1]
    used = mask.ne(0).reshape(-1, width).any(dim=0).nonzero()
    keep = int(used.max()) + 1 if used.numel() else 0
    if keep == width:
        return micro
    return {  # sequence tensors share the mask's shape: (B, L), or (B, 2, L) for siamese pairs
        key: value[..., :keep] if value.ndim == mask.ndim and value.shape[-1] == width else value
        for key, value in micro.items()
    }
