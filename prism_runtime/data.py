"""Data loading for one training site: read, validate, tokenize, batch and partition examples.

Pipeline::

    examples = load_examples("train.jsonl", "seq-cls")
    dataset = TokenizedDataset(examples, tokenizer, "seq-cls", max_length=128)
    collate = make_collate(tokenizer, "seq-cls")
    loader, q = poisson_loader(dataset, expected_batch_size=64, collate_fn=collate,
                               generator=torch.Generator().manual_seed(0))
    for batch in loader:                      # Poisson-sampled logical batch, may be empty
        for micro in micro_batches(batch, 16):  # virtual steps bounded by memory
            ...

Supported inputs are JSON Lines, CSV with a header row, and a folder written by
``datasets.Dataset.save_to_disk``. Two tasks are supported:

* ``"seq-cls"``: ``text`` + ``label``, or the pair ``text_a`` + ``text_b`` + ``label``; labels are
  integers ``>= 0`` (CSV cells such as ``"1"`` are accepted).
* ``"causal-lm"``: instruction tuning with ``instruction``, optional ``input``, ``output`` and an
  optional ``answer``. When ``output`` is empty or absent the ``answer`` becomes the training
  target (MAWPS-style data ships an empty ``output`` and the result in ``answer``).

Unknown fields are ignored.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus.data_loader import DPDataLoader
from torch import Tensor
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from prism_runtime.errors import ConfigError, DataError
from prism_runtime.shard_cache import cached_items, shard_key

__all__ = [
    "IGNORE_INDEX",
    "MICRO_BATCH_OVERHEAD_TOKENS",
    "PAIR_ENCODINGS",
    "PROMPT_NO_INPUT",
    "PROMPT_WITH_INPUT",
    "TASKS",
    "Collate",
    "TokenizedDataset",
    "dirichlet_partition",
    "format_prompt",
    "iid_partition",
    "length_groups",
    "load_examples",
    "make_collate",
    "micro_batches",
    "poisson_loader",
]

logger = logging.getLogger(__name__)

TASKS = ("seq-cls", "causal-lm")
"""Task names accepted by every function of this module."""

PAIR_ENCODINGS = ("joint", "siamese")
"""How ``TokenizedDataset`` tokenizes text pairs (see ``prism_runtime.classifier``)."""

IGNORE_INDEX = -100
"""Label value ignored by the loss (PyTorch's ``cross_entropy`` default ``ignore_index``)."""

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""Alpaca prompt used when an example has a non-empty ``input``."""

PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
"""Alpaca prompt used when an example has no ``input``."""

Example = dict[str, Any]
Collate = Callable[[Sequence[Mapping[str, Any]]], dict[str, Tensor]]

_JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
_CSV_SUFFIXES = frozenset({".csv"})
_CSV_INT = re.compile(r"\s*\+?\d+\s*")


# --------------------------------------------------------------------------------------------
# Reading and validating rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    """One raw record and where it came from, for error messages."""

    source: Path
    where: str  # "line 3" (JSONL, CSV) or "row 3" (datasets folder), 1-based
    values: Mapping[str, Any]
    from_csv: bool


def _row_error(row: _Row, what: str, fix: str) -> DataError:
    return DataError(f"{row.source}, {row.where}: {what}. {fix}")


def _kind(value: Any) -> str:
    """What a bad cell holds, WITHOUT its content (an error text must not quote the data)."""
    if isinstance(value, str):
        return f"text ({len(value)} characters)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Integral):
        return "a negative integer" if int(value) < 0 else "an integer"
    if isinstance(value, numbers.Real):
        return "a non-integer number"
    return f"a JSON {type(value).__name__}"


def load_examples(
    path: str | PathLike[str],
    task: str,
    *,
    text_fields: Sequence[str] | None = None,
    num_labels: int | None = None,
    with_labels: bool = True,
) -> list[Example]:
    """Read and validate the examples of one site.

    Args:
        path: A ``.jsonl``/``.ndjson``/``.json`` file (one JSON object per line, blank lines
            skipped), a ``.csv`` file with a header row, or a folder written by
            ``datasets.Dataset.save_to_disk``.
        task: ``"seq-cls"`` or ``"causal-lm"``.
        text_fields: Only for ``"seq-cls"``: the name of the text field, or the two names of a
            text pair, e.g. ``("question1", "question2")``. By default ``("text_a", "text_b")``
            when the first record has ``text_a``, else ``("text",)``.
        num_labels: Only for ``"seq-cls"``: the number of classes K; a label outside 0..K-1 is
            a ``DataError`` naming its file and line.
        with_labels: ``False`` for rows to predict: ``seq-cls`` rows need no ``label`` (one
            that is present is ignored) and ``causal-lm`` rows no ``output``/``answer``.

    Returns:
        One dict per example. ``"seq-cls"``: ``{"text", "label"}`` or
        ``{"text_a", "text_b", "label"}`` (label an ``int``). ``"causal-lm"``:
        ``{"instruction", "input", "output", "answer"}`` where ``output`` is the training target
        (the ``answer`` when ``output`` is empty) and ``answer`` is a string or ``None``.

    Raises:
        DataError: The path does not exist, has an unsupported type, holds no examples, or a
            record is invalid (the message names the file and its 1-based line or row).
        ConfigError: Unknown ``task`` or invalid ``text_fields``.
    """
    _check_task(task)
    fields = _check_text_fields(task, text_fields)
    source = Path(path)
    examples: list[Example] = []
    for row in _read_rows(source):
        if task == "seq-cls":
            if fields is None:
                fields = _detect_text_fields(row)
            example = _parse_seq_cls(row, fields, with_labels)
            if with_labels and num_labels is not None and int(example["label"]) >= num_labels:
                raise _row_error(
                    row,
                    f"label {example['label']} is out of range for num-labels={num_labels} "
                    f"(allowed: 0..{num_labels - 1})",
                    "Fix the label, or raise num-labels to the number of classes.",
                )
            examples.append(example)
        else:
            examples.append(_parse_causal_lm(row, with_labels))
    if not examples:
        raise DataError(
            f"{source}: the file has no examples (it is empty, blank, or only has a header). "
            "Add at least one example."
        )
    logger.info("Loaded %d %s examples from %s", len(examples), task, source)
    return examples


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ConfigError(f"Unknown task {task!r}. Use one of {list(TASKS)}.")


def _check_text_fields(task: str, text_fields: Sequence[str] | None) -> tuple[str, ...] | None:
    if text_fields is None:
        return None
    if task != "seq-cls":
        raise ConfigError(
            f"text_fields is only used by the 'seq-cls' task, got it for {task!r}. Remove it."
        )
    fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)
    if len(fields) not in (1, 2) or not all(isinstance(f, str) and f for f in fields):
        raise ConfigError(
            f"text_fields must name one text field or two (a pair), got {text_fields!r}."
        )
    return fields


def _read_rows(source: Path) -> Iterator[_Row]:
    if source.is_dir():
        return _read_dataset_folder(source)
    if not source.exists():
        raise DataError(
            f"{source}: no such file or folder. Check the path "
            f"(relative paths are resolved from {Path.cwd()})."
        )
    suffix = source.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return _read_jsonl(source)
    if suffix in _CSV_SUFFIXES:
        return _read_csv(source)
    raise DataError(
        f"{source}: unsupported file type {suffix or '(no suffix)'!r}. Use JSON Lines (.jsonl), "
        "CSV with a header row (.csv), or a folder written by Dataset.save_to_disk."
    )


def _open_text(source: Path) -> Any:
    # utf-8-sig drops a byte-order mark written by some spreadsheet exports.
    return source.open(encoding="utf-8-sig", newline="")


def _read_jsonl(source: Path) -> Iterator[_Row]:
    with _open_text(source) as handle:
        for line_no, line in enumerate(_decoded_lines(source, handle), start=1):
            if not line.strip():
                continue
            where = f"line {line_no}"
            try:
                values = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{source}, {where}: invalid JSON ({err.msg} at column {err.colno}). "
                    "Write exactly one JSON object per line (JSON Lines)."
                ) from err
            if not isinstance(values, dict):
                raise DataError(
                    f"{source}, {where}: expected a JSON object, found "
                    f"{type(values).__name__}. Write exactly one JSON object per line."
                )
            yield _Row(source, where, values, from_csv=False)


def _decoded_lines(source: Path, handle: Any) -> Iterator[str]:
    line_no = 0
    try:
        for line_no, line in enumerate(handle, start=1):  # noqa: B007 (used in the handler)
            yield line
    except UnicodeDecodeError as err:
        raise DataError(
            f"{source}, line {line_no + 1}: the file is not valid UTF-8 ({err.reason}). "
            "Save it as UTF-8."
        ) from err


def _read_csv(source: Path) -> Iterator[_Row]:
    with _open_text(source) as handle:
        reader = csv.DictReader(_decoded_lines(source, handle))
        try:
            for record in reader:
                # Extra cells land under the key None; they are unknown fields and are dropped.
                values = {k: v for k, v in record.items() if k is not None}
                yield _Row(source, f"line {reader.line_num}", values, from_csv=True)
        except csv.Error as err:
            raise DataError(
                f"{source}, line {reader.line_num}: malformed CSV ({err}). "
                "Check the quoting of that row."
            ) from err


def _read_dataset_folder(source: Path) -> Iterator[_Row]:
    import datasets  # heavy import, only needed for this input type

    try:
        loaded = datasets.load_from_disk(str(source))
    except FileNotFoundError as err:
        raise DataError(
            f"{source}: this folder is not a dataset written by Dataset.save_to_disk ({err}). "
            "Pass a .jsonl or .csv file, or a save_to_disk folder."
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        raise DataError(
            f"{source}: this folder holds a DatasetDict with splits {splits}, not one split. "
            f"Pass the folder of one split instead, e.g. {source / splits[0]}."
            if splits
            else f"{source}: this folder holds an empty DatasetDict. Save one split instead."
        )
    for row_no, values in enumerate(loaded, start=1):
        yield _Row(source, f"row {row_no}", values, from_csv=False)


def _detect_text_fields(row: _Row) -> tuple[str, ...]:
    if "text_a" in row.values or "text_b" in row.values:
        return ("text_a", "text_b")
    if "text" in row.values:
        return ("text",)
    raise _row_error(
        row,
        f"no text field: expected 'text' or the pair 'text_a' and 'text_b', found fields "
        f"{sorted(map(str, row.values))}",
        "Rename the text column(s), or pass text_fields=(...) naming them.",
    )


def _parse_seq_cls(row: _Row, fields: tuple[str, ...], with_labels: bool = True) -> Example:
    names = ("text",) if len(fields) == 1 else ("text_a", "text_b")
    example: Example = {
        name: _required_text(row, field) for name, field in zip(names, fields, strict=True)
    }
    if with_labels:
        example["label"] = _label(row)
    return example


def _parse_causal_lm(row: _Row, with_labels: bool = True) -> Example:
    instruction = _required_text(row, "instruction")
    input_text = _optional_text(row, "input") or ""
    output = _optional_text(row, "output")
    answer = _optional_answer(row)
    if not with_labels:  # a prompt to answer: the response, if any, is not needed
        return {
            "instruction": instruction,
            "input": input_text,
            "output": output or "",
            "answer": answer,
        }
    if output is None and answer is None:
        raise _row_error(
            row, "missing field 'output'", "Add the expected response as a string 'output'."
        )
    target = output if output and output.strip() else answer
    if target is None or not target.strip():
        raise _row_error(
            row,
            "empty response: 'output' is empty and there is no non-empty 'answer'",
            "Give every example a non-empty 'output' (or 'answer').",
        )
    return {"instruction": instruction, "input": input_text, "output": target, "answer": answer}


def _required_text(row: _Row, field: str) -> str:
    value = row.values.get(field)
    if value is None:
        raise _row_error(
            row, f"missing field '{field}'", f"Add a non-empty string '{field}' to every example."
        )
    text = _optional_text(row, field)
    if text is None or not text.strip():
        raise _row_error(
            row, f"field '{field}' is empty", f"Give every example a non-empty '{field}'."
        )
    return text


def _optional_text(row: _Row, field: str) -> str | None:
    value = row.values.get(field)
    if value is None or isinstance(value, str):
        return value
    raise _row_error(
        row,
        f"field '{field}' must be a string, found {_kind(value)}",
        f"Write '{field}' as a JSON string.",
    )


def _optional_answer(row: _Row) -> str | None:
    value = row.values.get("answer")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return str(value)
    raise _row_error(
        row,
        f"field 'answer' must be a string or a number, found {_kind(value)}",
        "Write 'answer' as a string.",
    )


def _label(row: _Row) -> int:
    value = row.values.get("label")
    if value is None:
        raise _row_error(
            row, "missing field 'label'", "Add an integer class label 'label' (0..K-1)."
        )
    if row.from_csv and isinstance(value, str) and _CSV_INT.fullmatch(value):
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0:
        return int(value)
    raise _row_error(
        row,
        f"label must be an integer >= 0, found {_kind(value)}",
        "Write class labels as integers 0..K-1 (map names such as 'pos' to ids first).",
    )


# --------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------


def format_prompt(instruction: str, input_text: str = "") -> str:
    """Alpaca-style prompt for an instruction and an optional input.

    Args:
        instruction: The task description.
        input_text: Extra context; when empty the shorter template without an input is used.

    Returns:
        The prompt, ending with ``"### Response:\\n"``; the response follows it directly.
    """
    if input_text.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def _uses_token_type_ids(tokenizer: PreTrainedTokenizerBase, task: str) -> bool:
    """Whether items and batches carry ``token_type_ids``: one rule for dataset and collate."""
    return task == "seq-cls" and "token_type_ids" in tokenizer.model_input_names


class TokenizedDataset(Dataset[dict[str, Any]]):
    """Tokenized, unpadded examples of one task.

    Items are dicts of 1-D ``torch.long`` tensors: ``input_ids``, ``attention_mask``,
    ``token_type_ids`` (``"seq-cls"`` only, when the tokenizer uses them) and ``labels``
    (``"seq-cls"``: a Python ``int``, absent for examples without a label; ``"causal-lm"``: a
    tensor like ``input_ids`` with the prompt positions set to ``IGNORE_INDEX`` unless
    ``train_on_prompt``).

    Text pairs are tokenized as one sequence ``[CLS] a [SEP] b [SEP]`` (``pair_encoding=
    "joint"``, default) or, for a siamese classifier (``prism_runtime.classifier``), each text on
    its own (``"siamese"``): then ``input_ids``/``attention_mask``/``token_type_ids`` are (2, L)
    tensors, the two texts right-padded to the longer one, each truncated to ``max_length``.

    For ``"causal-lm"`` the sequence is ``[bos] + prompt + output + [eos]`` (``bos`` only if the
    tokenizer has one), truncated to ``max_length``. Prompt and output are tokenized separately,
    without special tokens, so the prompt boundary is exact; generate from the same
    ``[bos] + format_prompt(...)`` tokens at inference time.

    Args:
        examples: Output of :func:`load_examples` for the same task.
        tokenizer: A Hugging Face tokenizer. ``"causal-lm"`` needs an eos token.
        task: ``"seq-cls"`` or ``"causal-lm"``.
        max_length: Maximum number of tokens per example (per text of a siamese pair), special
            tokens included.
        train_on_prompt: ``"causal-lm"`` only: also compute the loss on the prompt tokens.
        pair_encoding: ``"joint"`` or ``"siamese"``, for text pairs (single texts ignore it).
        cache_dir: the site's own cache folder: the items are read from a verified cache
            file there when one matches (``prism_runtime.shard_cache``), else tokenized and stored
            (mode 0600); None: always tokenized.

    Raises:
        ConfigError: Unknown task or pair encoding, ``max_length < 2``, or a causal-lm
            tokenizer without eos.
        DataError: ``examples`` is empty or mixes single texts and pairs.
    """

    def __init__(
        self,
        examples: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        task: str,
        *,
        max_length: int,
        train_on_prompt: bool = False,
        pair_encoding: str = "joint",
        cache_dir: Path | None = None,
    ) -> None:
        _check_task(task)
        if pair_encoding not in PAIR_ENCODINGS:
            raise ConfigError(f"pair_encoding={pair_encoding!r}: use one of {PAIR_ENCODINGS}.")
        if max_length < 2:
            raise ConfigError(f"max_length must be at least 2 tokens, got {max_length}.")
        if not examples:
            raise DataError("No examples to tokenize. Load a non-empty file first.")
        self.task = task
        self.max_length = max_length

        def tokenize() -> list[dict[str, Any]]:
            if task == "seq-cls":
                return _tokenize_seq_cls(examples, tokenizer, max_length, pair_encoding)
            return _tokenize_causal_lm(examples, tokenizer, max_length, train_on_prompt)

        if cache_dir is None:
            self._items = tokenize()
            return
        key = shard_key(
            examples,
            tokenizer,
            task=task,
            max_length=max_length,
            pair_encoding=pair_encoding,
            train_on_prompt=train_on_prompt,
        )
        self._items = cached_items(cache_dir, key, tokenize)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._items[index]


def _tokenize_seq_cls(
    examples: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    pair_encoding: str = "joint",
) -> list[dict[str, Any]]:
    is_pair = "text_a" in examples[0]
    if any(("text_a" in ex) != is_pair for ex in examples):
        raise DataError("The examples mix single texts and text pairs. Use one kind per dataset.")
    first = [ex["text_a"] if is_pair else ex["text"] for ex in examples]
    second = [ex["text_b"] for ex in examples] if is_pair else None
    keys = ["input_ids", "attention_mask"]
    with_types = _uses_token_type_ids(tokenizer, "seq-cls")
    if with_types:
        keys.append("token_type_ids")
    if second is not None and pair_encoding == "siamese":
        items = _siamese_items(first, second, tokenizer, max_length, keys)
    else:
        encoded = tokenizer(
            first,
            second,
            truncation=True,
            max_length=max_length,
            return_token_type_ids=with_types,
            return_attention_mask=True,
        )
        items = [
            {k: torch.tensor(encoded[k][i], dtype=torch.long) for k in keys}
            for i in range(len(examples))
        ]
    for item, ex in zip(items, examples, strict=True):
        if "label" in ex:
            item["labels"] = int(ex["label"])
    return items


def _siamese_items(
    first: Sequence[str],
    second: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    keys: Sequence[str],
) -> list[dict[str, Any]]:
    """One (2, L) tensor per key and pair: each text tokenized alone, right-padded to the pair."""
    with_types = "token_type_ids" in keys
    a, b = (
        tokenizer(
            list(texts),
            truncation=True,
            max_length=max_length,
            return_token_type_ids=with_types,
            return_attention_mask=True,
        )
        for texts in (first, second)
    )
    pads = {"input_ids": _pad_id(tokenizer), "attention_mask": 0, "token_type_ids": 0}
    items = []
    for i in range(len(first)):
        item = {}
        for k in keys:
            rows = [a[k][i], b[k][i]]
            width = max(len(r) for r in rows)
            item[k] = torch.tensor(
                [list(r) + [pads[k]] * (width - len(r)) for r in rows], dtype=torch.long
            )
        items.append(item)
    return items


def _tokenize_causal_lm(
    examples: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    train_on_prompt: bool,
) -> list[dict[str, Any]]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "The tokenizer has no eos token, which causal-lm training appends to every response. "
            "Set tokenizer.eos_token (e.g. '</s>') before building the dataset."
        )
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompts = [format_prompt(ex["instruction"], ex.get("input") or "") for ex in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer([ex["output"] for ex in examples], add_special_tokens=False)["input_ids"]
    items = []
    no_target = 0
    for prompt, output in zip(prompt_ids, output_ids, strict=True):
        ids = (bos + prompt + output + [eos])[:max_length]
        n_prompt = min(len(bos) + len(prompt), len(ids))
        no_target += n_prompt == len(ids)
        labels = list(ids)
        if not train_on_prompt:
            labels[:n_prompt] = [IGNORE_INDEX] * n_prompt
        ids_t = torch.tensor(ids, dtype=torch.long)
        items.append(
            {
                "input_ids": ids_t,
                "attention_mask": torch.ones_like(ids_t),
                "labels": torch.tensor(labels, dtype=torch.long),
            }
        )
    if no_target:
        logger.warning(
            "%d of %d examples lose their whole response to truncation at max_length=%d; "
            "they add no training signal. Raise max_length.",
            no_target,
            len(items),
            max_length,
        )
    return items


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


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
    _check_task(task)
    pad_values = [("input_ids", _pad_id(tokenizer)), ("attention_mask", 0)]
    if _uses_token_type_ids(tokenizer, task):
        pad_values.append(("token_type_ids", 0))
    if task == "causal-lm":
        pad_values.append(("labels", IGNORE_INDEX))
    return _PadCollate(tuple(pad_values), scalar_labels=task == "seq-cls")


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        logger.info("Tokenizer has no pad token; padding input_ids with the eos id.")
        return int(tokenizer.eos_token_id)
    raise ConfigError(
        "The tokenizer has neither a pad nor an eos token. Set tokenizer.pad_token first."
    )


def poisson_loader(
    dataset: Dataset[Any],
    *,
    expected_batch_size: int,
    collate_fn: Collate,
    generator: torch.Generator,
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

    Returns:
        The loader and the sample rate ``q`` to record in the privacy ledger.

    Raises:
        ConfigError: The dataset is empty, ``expected_batch_size`` is out of range, or
            ``collate_fn`` fails on an empty batch.
    """
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise ConfigError("The dataset is empty: there is nothing to sample.")
    if not 1 <= expected_batch_size <= size:
        raise ConfigError(
            f"expected_batch_size must be between 1 and the dataset size {size}, got "
            f"{expected_batch_size}. Lower it or give this site more data."
        )
    _check_empty_collate(collate_fn)
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


MICRO_BATCH_OVERHEAD_TOKENS = 32
"""The fixed cost of one forward/backward pass (hooks, kernel launches, per-example gradient
bookkeeping), in padded tokens of compute: what a further split must save to be worth it
(``length_groups``; measured with ``bench/step.py --data sst2``, docs/benchmarks.md)."""


def length_groups(
    lengths: Sequence[int], cap: int, overhead: float = MICRO_BATCH_OVERHEAD_TOKENS
) -> list[int]:
    """Sizes of consecutive groups of the SORTED ``lengths`` (ascending), each of at most ``cap``
    rows, minimising the compute ``sum over groups of (rows x longest row + overhead)``.

    A group is padded to its longest row, its last one. Exact, by dynamic programming over the
    cut points (``O(len(lengths) x cap)``): short rows get small groups only when the padding
    they save outweighs the extra passes.
    """
    n = len(lengths)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = lengths[end - 1]
        for begin in range(max(0, end - cap), end):
            cost = best[begin] + (end - begin) * width + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    sizes: list[int] = []
    end = n
    while end > 0:
        sizes.append(end - cut[end])
        end = cut[end]
    return sizes[::-1]


def _trim_padding(micro: dict[str, Tensor]) -> dict[str, Tensor]:
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


# --------------------------------------------------------------------------------------------
# Partitions for federated simulation
# --------------------------------------------------------------------------------------------


def _check_partition(n: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ConfigError(f"num_parts must be at least 1, got {num_parts}.")
    if n < num_parts:
        raise ConfigError(
            f"Cannot split {n} examples into {num_parts} non-empty parts. Use fewer parts."
        )


def iid_partition(n: int, num_parts: int, seed: int) -> list[np.ndarray]:
    """Split ``range(n)`` uniformly at random into parts whose sizes differ by at most one.

    Args:
        n: Number of examples.
        num_parts: Number of parts (sites), ``1 <= num_parts <= n``.
        seed: Seed of the permutation; the result is a deterministic function of it.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one.

    Raises:
        ConfigError: ``num_parts < 1`` or ``n < num_parts``.
    """
    _check_partition(n, num_parts)
    permutation = np.random.default_rng(seed).permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(permutation, num_parts)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    num_parts: int,
    alpha: float,
    seed: int,
    *,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among parts with Dirichlet(alpha) proportions.

    For every class, the shuffled indices of that class are cut according to proportions
    ``p ~ Dirichlet(alpha * 1)`` over the parts (Hsu et al., 2019). Small ``alpha`` gives parts
    dominated by few classes; large ``alpha`` approaches an IID split.

    Every part is non-empty: a draw with an empty part is rejected and redrawn, up to
    ``max_tries`` draws; if all are rejected, the last draw is rebalanced by moving one index
    from the currently largest part into each empty part (a warning is logged).

    Args:
        labels: Integer class label of each example.
        num_parts: Number of parts (sites), ``1 <= num_parts <= len(labels)``.
        alpha: Dirichlet concentration, ``> 0``.
        seed: Seed; the result is a deterministic function of all arguments.
        max_tries: Number of draws before rebalancing.

    Returns:
        ``num_parts`` sorted ``int64`` index arrays; every index appears in exactly one.

    Raises:
        ConfigError: Invalid ``num_parts``, ``alpha`` or ``max_tries``, or labels not 1-D.
    """
    label_array = np.asarray(labels)
    if label_array.ndim != 1:
        raise ConfigError(f"labels must be 1-D, got shape {label_array.shape}.")
    _check_partition(len(label_array), num_parts)
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}.")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be at least 1, got {max_tries}.")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts = _dirichlet_draw(label_array, num_parts, alpha, rng)
        if all(parts):
            break
    else:
        logger.warning(
            "No Dirichlet(alpha=%g) draw out of %d left every one of %d parts non-empty; "
            "moving single examples into the empty parts.",
            alpha,
            max_tries,
            num_parts,
        )
        _fill_empty_parts(parts)
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def _dirichlet_draw(
    labels: np.ndarray, num_parts: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for cls in np.unique(labels):
        indices = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_parts, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(indices)).astype(np.int64)
        for part, chunk in zip(parts, np.split(indices, cuts), strict=True):
            part.extend(chunk.tolist())
    return parts


def _fill_empty_parts(parts: list[list[int]]) -> None:
    # With n >= num_parts, while a part is empty some other part holds at least two indices.
    for part in parts:
        if not part:
            donor = max(parts, key=len)
            part.append(donor.pop())
