"""Tokenizing examples: ``TokenizedDataset`` (joint or siamese text pairs, instruction prompts
with the prompt tokens masked out of the loss) and the Alpaca prompt."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from prism_runtime.data.reading import (
    IGNORE_INDEX,
    PAIR_ENCODINGS,
    PROMPT_NO_INPUT,
    PROMPT_WITH_INPUT,
    check_task,
    pad_id,
    uses_token_type_ids,
)
from prism_runtime.errors import ConfigError, DataError
from prism_runtime.shard_cache import cached_items, shard_key

logger = logging.getLogger(__name__)


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

    ``users`` is the person of each row when the examples carry a ``user`` field (one id per
    row, for person-level privacy: ``prism_runtime.trainer.PrivateTrainer``), None when they do
    not; it is not part of the items.

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
        DataError: ``examples`` is empty, mixes single texts and pairs, or gives a ``user``
            for some rows only.
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
        check_task(task)
        if pair_encoding not in PAIR_ENCODINGS:
            raise ConfigError(f"pair_encoding={pair_encoding!r}: use one of {PAIR_ENCODINGS}.")
        if max_length < 2:
            raise ConfigError(f"max_length must be at least 2 tokens, got {max_length}.")
        if not examples:
            raise DataError("No examples to tokenize. Load a non-empty file first.")
        self.task = task
        self.max_length = max_length
        self.users = _users(examples)

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


def _users(examples: Sequence[Mapping[str, Any]]) -> list[Hashable] | None:
    """Each row's ``user``, or None when no row has one."""
    users = [ex.get("user") for ex in examples]
    missing = sum(u is None for u in users)
    if missing == len(users):
        return None
    if missing:
        raise DataError(
            f"{missing} of {len(users)} rows have no 'user': give every row its person, or none"
        )
    return users


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
    with_types = uses_token_type_ids(tokenizer, "seq-cls")
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
    pads = {"input_ids": pad_id(tokenizer), "attention_mask": 0, "token_type_ids": 0}
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
