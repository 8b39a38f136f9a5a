"""client.site_data: a site's rows are checked against the run's resolved data settings, and a
contradiction is a coded error reply (4001 configuration, 4002 data), never a different model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from client.app import CONFIG_ERROR, DATA_ERROR, error_code
from client.site_data import check_text_pairs, site_examples
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError, DataError


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _deployed(path: Path) -> SiteConfig:
    return parse_config(SiteConfig, {"data-path": str(path)}, what="node config")


def test_pairs_at_a_site_of_a_single_text_run_are_refused_with_4001(tmp_path: Path) -> None:
    """A deployed run whose data stay 'synthetic' resolves to single texts: a site holding
    pairs refuses, naming text-pairs, instead of encoding each pair as one text."""
    pairs = _write(tmp_path / "pairs.jsonl", [{"text_a": "a", "text_b": "b", "label": 1}])
    run = RunConfig()
    rows = site_examples(run, _deployed(pairs))
    with pytest.raises(ConfigError) as info:
        check_text_pairs(run, rows)
    assert "this site's data are text pairs" in str(info.value)
    assert "text-pairs=false (auto, from the run's data 'synthetic')" in str(info.value)
    assert "set text-pairs=true" in str(info.value)
    assert error_code(info.value) == CONFIG_ERROR
    check_text_pairs(run.model_copy(update={"text_pairs": True}), rows)  # as the run says


def test_single_texts_at_a_site_of_a_pairs_run_are_refused_with_4001(tmp_path: Path) -> None:
    single = _write(tmp_path / "single.jsonl", [{"text": "a", "label": 1}])
    run = parse_config(RunConfig, {"text-pairs": True}, what="run config")
    with pytest.raises(ConfigError, match="text-pairs=true but this site's data are single"):
        check_text_pairs(run, site_examples(run, _deployed(single)))


def test_a_label_outside_the_runs_classes_is_refused_with_4002_naming_the_line(
    tmp_path: Path,
) -> None:
    rows = [{"text": "a", "label": 0}, {"text": "b", "label": 1}, {"text": "c", "label": 2}]
    data = _write(tmp_path / "site.jsonl", rows)
    with pytest.raises(DataError) as info:  # the run resolves to the built-in task's 2 classes
        site_examples(RunConfig(), _deployed(data))
    assert str(info.value).startswith(f"{data}, line 3: the label is out of range for num-labels=2")
    assert error_code(info.value) == DATA_ERROR
    three = parse_config(RunConfig, {"num-labels": 3}, what="run config")
    assert len(site_examples(three, _deployed(data))) == 3
