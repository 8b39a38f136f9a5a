"""prism_runtime.data.settings: text-pairs, num-labels, label-texts and head-init follow the
run's data when left at ``auto``, and a configuration that contradicts its data is refused
naming the keys to set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import shared_data_file

from prism_runtime.config import SENTIMENT_LABEL_TEXTS, RunConfig, parse_config
from prism_runtime.data.settings import DataSettings, data_settings
from prism_runtime.errors import ConfigError, DataError
from prism_runtime.model import model_config_for


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(**values: Any) -> RunConfig:
    return parse_config(RunConfig, values, what="run config")


@pytest.fixture
def medical_pairs(tmp_path: Path) -> Path:
    """The first 200 rows of the medical question pairs (text_a, text_b, label 0/1)."""
    with shared_data_file("medical_questions_pairs/train.jsonl").open(encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(200)]
    return _write(tmp_path / "pairs.jsonl", rows)


def _single(tmp_path: Path, labels: list[int], name: str = "single.jsonl") -> Path:
    return _write(tmp_path / name, [{"text": f"row {i}", "label": y} for i, y in enumerate(labels)])


def test_the_medical_pairs_with_defaults_are_pairs_of_two_classes_without_sentiment_texts(
    medical_pairs: Path,
) -> None:
    run = _run(data=str(medical_pairs))
    assert (run.text_pairs, run.num_labels, run.label_texts, run.head_init) == ("auto",) * 4
    settings = data_settings(run)
    # MiniLM is a sentence-transformers model: siamese pairs, whose zero-shot head is the
    # cosine rule of two classes (no label texts needed)
    assert settings == DataSettings(
        text_pairs=True, num_labels=2, label_texts="", head_init="zero-shot"
    )
    model = model_config_for(run)
    assert model.text_pairs and model.num_labels == 2 and model.label_texts == ()


def test_the_built_in_task_keeps_the_demo_settings() -> None:
    """``make demo``: single texts, two classes, the sentiment texts and a zero-shot head."""
    settings = data_settings(RunConfig())
    assert settings == DataSettings(
        text_pairs=False, num_labels=2, label_texts=SENTIMENT_LABEL_TEXTS, head_init="zero-shot"
    )
    model = model_config_for(RunConfig())
    assert model.label_texts == ("this is bad", "this is great") and not model.text_pairs


def test_three_classes_of_single_texts_get_no_sentiment_texts_and_a_random_head(
    tmp_path: Path,
) -> None:
    data = _single(tmp_path, [0, 1, 2, 1, 0, 2])
    assert data_settings(_run(data=str(data))) == DataSettings(
        text_pairs=False, num_labels=3, label_texts="", head_init="random"
    )
    texts = "sad|calm|glad"
    assert data_settings(_run(data=str(data), **{"label-texts": texts})) == DataSettings(
        text_pairs=False, num_labels=3, label_texts=texts, head_init="zero-shot"
    )


def test_pairs_under_text_pairs_false_are_refused_naming_the_key(medical_pairs: Path) -> None:
    with pytest.raises(ConfigError, match="text-pairs=false") as info:
        data_settings(_run(data=str(medical_pairs), **{"text-pairs": False}))
    assert "are text pairs" in str(info.value) and "set text-pairs=true" in str(info.value)


def test_single_texts_under_text_pairs_true_are_refused_naming_the_key(tmp_path: Path) -> None:
    data = _single(tmp_path, [0, 1])
    with pytest.raises(ConfigError, match=r"text-pairs=true but the run's data .* single texts"):
        data_settings(_run(data=str(data), **{"text-pairs": True}))


def test_label_texts_whose_count_is_not_the_number_of_classes_are_refused(
    tmp_path: Path, medical_pairs: Path
) -> None:
    data = _single(tmp_path, [0, 1, 2])
    with pytest.raises(ConfigError) as info:  # three classes derived, two texts given
        data_settings(_run(data=str(data), **{"label-texts": "bad|good"}))
    message = str(info.value)
    assert "label-texts has 2 descriptions but num-labels=3" in message
    assert "num-labels = auto" in message and str(data) in message
    with pytest.raises(ConfigError, match="label-texts has 3 descriptions but num-labels=2"):
        parse_config(
            RunConfig, {"num-labels": 2, "label-texts": "a|b|c"}, what="run config"
        )  # both set: refused before any data is read


def test_a_label_outside_the_classes_set_is_refused_naming_the_row(tmp_path: Path) -> None:
    data = _single(tmp_path, [0, 1, 2, 1])
    with pytest.raises(DataError) as info:
        data_settings(_run(data=str(data), **{"num-labels": 2}))
    message = str(info.value)
    assert message.startswith(f"{data}: 1 row holds a label outside 0..1 (line 3)")
    assert "set num-labels" in message


def test_a_stray_label_never_grows_the_model(tmp_path: Path) -> None:
    """One label 7 among two classes: refused naming its line, never an eight-class head."""
    data = _single(tmp_path, [0, 1, 0, 7, 1, 0])
    with pytest.raises(DataError) as info:
        data_settings(_run(data=str(data)))
    message = str(info.value)
    assert "(line 4)" in message and "outside 0..1" in message and "num-labels" in message
    assert "7" not in message.removeprefix(str(data))  # the row, never its label


def test_auto_keys_need_the_runs_data_file(tmp_path: Path) -> None:
    """A participant that cannot read the run's file refuses naming the keys to set; with the
    keys set nothing is read."""
    missing = str(tmp_path / "coordinator-only.jsonl")
    with pytest.raises(ConfigError) as info:
        data_settings(_run(data=missing))
    assert "text-pairs and num-labels = auto" in str(info.value) and missing in str(info.value)
    explicit = _run(data=missing, **{"text-pairs": False, "num-labels": 3})
    assert data_settings(explicit) == DataSettings(
        text_pairs=False, num_labels=3, label_texts="", head_init="random"
    )


def test_the_answer_is_the_files_not_a_partitions(tmp_path: Path) -> None:
    """Every site of a simulation resolves from the whole file: a site whose partition lacks a
    class still builds the coordinator's three-class model and reads its rows."""
    from client.site_data import site_examples
    from prism_runtime.config import SiteConfig

    labels = [0] * 30 + [1] * 30 + [2] * 30
    data = _single(tmp_path, labels)
    run = _run(data=str(data), partitioner="dirichlet", **{"dirichlet-alpha": 0.01, "seed": 1})
    reference = model_config_for(run)
    assert reference.num_labels == 3
    seen = []
    for k in range(3):
        rows = site_examples(run, SiteConfig(partition_id=k, num_partitions=3))
        seen.append({r["label"] for r in rows})
        assert model_config_for(run) == reference
    assert any(len(s) < 3 for s in seen)  # label skew: some site lacks a class
