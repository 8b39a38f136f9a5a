"""Reading and validating a site's examples (JSON Lines, CSV, a ``datasets`` folder) for
the two tasks, and the constants every part of ``prism_runtime.data`` shares."""

from __future__ import annotations

import csv
import json
import logging
import numbers
import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from prism_runtime.errors import ConfigError, DataError

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


@dataclass(frozen=True)
class ExampleFile:
    """The examples of one file or folder and where each was read, for error messages.

    ``where[i]`` is the 1-based place of ``examples[i]`` (``"line 3"`` in a JSONL or CSV file,
    ``"row 3"`` in a ``datasets`` folder): an error can name a row without quoting its content.
    """

    source: Path
    examples: list[Example]
    where: list[str]

    def head(self, limit: int | None) -> ExampleFile:
        """The first ``limit`` examples (all of them for ``None``)."""
        if limit is None or limit >= len(self.examples):
            return self
        return ExampleFile(self.source, self.examples[:limit], self.where[:limit])

    @property
    def labels(self) -> list[int]:
        """The ``seq-cls`` label of every example, in order."""
        return [int(ex["label"]) for ex in self.examples]


def load_examples(
    path: str | PathLike[str],
    task: str,
    *,
    text_fields: Sequence[str] | None = None,
    num_labels: int | None = None,
    with_labels: bool = True,
    user_field: str | None = None,
) -> list[Example]:
    """Read and validate the examples of one site (``read_examples`` without the places).

    Args:
        path: A ``.jsonl``/``.ndjson``/``.json`` file (one JSON object per line, blank lines
            skipped), a ``.csv`` file with a header row, or a folder written by
            ``datasets.Dataset.save_to_disk``.
        task: ``"seq-cls"`` or ``"causal-lm"``.
        text_fields: Only for ``"seq-cls"``: the name of the text field, or the two names of a
            text pair, e.g. ``("question1", "question2")``. By default ``("text_a", "text_b")``
            when the first record has ``text_a``, else ``("text",)``.
        num_labels: Only for ``"seq-cls"``: the number of classes K; a label outside 0..K-1 is
            a ``DataError`` naming its file and line (never the label).
        with_labels: ``False`` for rows to predict: ``seq-cls`` rows need no ``label`` (one
            that is present is ignored) and ``causal-lm`` rows no ``output``/``answer``.
        user_field: The field holding each row's person id (docs/design.md §3.2), a non-empty
            string or an integer, carried as the example's ``user`` string in its one
            spelling (``person_id``: ``3``, ``"3"`` and ``" 003"`` are one person, and a CSV
            cell reads as its text); every row must have one. None: no ``user``, the examples
            are those of a file without the field.

    Returns:
        One dict per example. ``"seq-cls"``: ``{"text", "label"}`` or
        ``{"text_a", "text_b", "label"}`` (label an ``int``). ``"causal-lm"``:
        ``{"instruction", "input", "output", "answer"}`` where ``output`` is the training target
        (the ``answer`` when ``output`` is empty) and ``answer`` is a string or ``None``. With
        ``user_field``, each dict also has ``"user"`` (a ``str``).

    Raises:
        DataError: The path does not exist, has an unsupported type, holds no examples, or a
            record is invalid (the message names the file and its 1-based line or row); with
            ``user_field``, rows without a person id (missing, empty or null) are named by
            their lines, never their content.
        ConfigError: Unknown ``task``, invalid ``text_fields`` or ``user_field``.
    """
    return read_examples(
        path,
        task,
        text_fields=text_fields,
        num_labels=num_labels,
        with_labels=with_labels,
        user_field=user_field,
    ).examples


def read_examples(
    path: str | PathLike[str],
    task: str,
    *,
    text_fields: Sequence[str] | None = None,
    num_labels: int | None = None,
    with_labels: bool = True,
    user_field: str | None = None,
) -> ExampleFile:
    """``load_examples``, keeping where each example was read (arguments and errors the same)."""
    check_task(task)
    fields = _check_text_fields(task, text_fields)
    if user_field is not None and not (isinstance(user_field, str) and user_field):
        raise ConfigError(f"user_field must name a field, got {user_field!r}.")
    source = Path(path)
    examples: list[Example] = []
    where: list[str] = []
    no_user: list[str] = []
    for row in _read_rows(source):
        if task == "seq-cls":
            if fields is None:
                fields = _detect_text_fields(row)
            example = _parse_seq_cls(row, fields, with_labels)
            if with_labels and num_labels is not None and int(example["label"]) >= num_labels:
                raise _row_error(
                    row,
                    f"the label is out of range for num-labels={num_labels} "
                    f"(allowed: 0..{num_labels - 1})",
                    "Fix the label, or raise num-labels to the number of classes.",
                )
        else:
            example = _parse_causal_lm(row, with_labels)
        if user_field is not None:
            user = _user(row, user_field)
            if user is None:
                no_user.append(row.where)
            example["user"] = user
        examples.append(example)
        where.append(row.where)
    if no_user:
        raise _no_user_error(source, user_field, no_user, len(examples))
    if not examples:
        raise DataError(
            f"{source}: the file has no examples (it is empty, blank, or only has a header). "
            "Add at least one example."
        )
    logger.info("Loaded %d %s examples from %s", len(examples), task, source)
    return ExampleFile(source, examples, where)


def check_task(task: str) -> None:
    """Raise ConfigError unless ``task`` is one of ``TASKS``."""
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


def _read_jsonl(source: Path) -> Iterator[_Row]:
    with source.open("rb") as handle:
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


def _decoded_lines(source: Path, handle: BinaryIO) -> Iterator[str]:
    """The text lines of a binary file, each decoded on its own, with its line ending.

    Lines end at ``\n``, ``\r\n`` or a lone ``\r`` (universal newlines, as ``csv`` wants them
    with ``newline=""``). Neither byte occurs inside a UTF-8 sequence, so decoding line by line
    is exact, and invalid UTF-8 is reported on the line that holds it. A byte-order mark at the
    start of the file (some spreadsheet exports write one) is dropped.
    """
    line_no = 0
    for chunk in handle:
        for raw in chunk.splitlines(keepends=True):  # a lone \r inside the chunk ends a line
            line_no += 1
            try:
                yield raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{source}, line {line_no}: the file is not valid UTF-8 ({err.reason}). "
                    "Save it as UTF-8."
                ) from err


def _read_csv(source: Path) -> Iterator[_Row]:
    with source.open("rb") as handle:
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


_INTEGER_ID = re.compile(r"[+-]?[0-9]+")
"""A person id that spells an integer in ASCII digits: it names the person of that integer."""


def person_id(value: str | int) -> str | None:
    """The one spelling of a person id (docs/usage.md, "Per-patient privacy"); None for an id
    that is empty once trimmed.

    Text is put in Unicode NFC and trimmed of surrounding whitespace (``str.strip``: spaces,
    tabs, line breaks, no-break spaces); text that is then an integer in ASCII digits, with an
    optional sign, and an integer are written as that integer in decimal (``"007"``, ``"+7"``,
    ``" 7 "`` and ``7`` are ``"7"``). Nothing else is merged: case, inner whitespace,
    compatibility forms (full-width digits) and non-ASCII digits stay apart. Merging two
    spellings can only join two people into one unit, which a per-person clip still bounds;
    keeping one person's two spellings apart would split them into two units and double what
    their records may reveal.
    """
    if isinstance(value, bool):  # a JSON true/false is no person id (``_user`` refuses it)
        raise TypeError(f"a person id is text or an integer, not {value!r}")
    if not isinstance(value, str):
        return str(int(value))
    text = unicodedata.normalize("NFC", value).strip()
    if not text:
        return None
    return str(int(text)) if _INTEGER_ID.fullmatch(text) else text


def _user(row: _Row, field: str) -> str | None:
    """The row's person id in its one spelling (``person_id``); None when it is missing, empty
    or null."""
    value = row.values.get(field)
    if value is None:
        return None
    if isinstance(value, str):
        return person_id(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return person_id(int(value))
    raise _row_error(
        row,
        f"the person id '{field}' must be a string or an integer, found {_kind(value)}",
        f"Write '{field}' as a string or an integer.",
    )


_LISTED_PLACES = 20


def _no_user_error(source: Path, field: str | None, places: list[str], rows: int) -> DataError:
    listed = ", ".join(places[:_LISTED_PLACES])
    more = f" and {len(places) - _LISTED_PLACES} more" if len(places) > _LISTED_PLACES else ""
    return DataError(
        f"{source}, {listed}{more}: {len(places)} of {rows} rows have no person id "
        f"'{field}' (missing, empty or null). Give every row its person in '{field}'."
    )


def uses_token_type_ids(tokenizer: PreTrainedTokenizerBase, task: str) -> bool:
    """Whether items and batches carry ``token_type_ids``: one rule for dataset and collate."""
    return task == "seq-cls" and "token_type_ids" in tokenizer.model_input_names


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads ``input_ids``: the pad token, else the eos token."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        logger.info("Tokenizer has no pad token; padding input_ids with the eos id.")
        return int(tokenizer.eos_token_id)
    raise ConfigError(
        "The tokenizer has neither a pad nor an eos token. Set tokenizer.pad_token first."
    )
