"""The coordinator's held-out set is of the kind the model reads: pairs for a pairs model, single
texts otherwise; a contradiction is refused before any round, naming the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_runtime.config import RunConfig, parse_config
from prism_runtime.errors import ConfigError
from prism_runtime.model import load_model, model_config_for
from server.federation import _server_eval


def _write(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_a_single_text_held_out_set_of_a_pairs_run_is_refused(tiny_bert, tmp_path):
    pairs = [{"text_a": f"a {i}", "text_b": f"b {i}", "label": i % 2} for i in range(8)]
    single = [{"text": f"t {i}", "label": i % 2} for i in range(4)]
    values = {
        "model": tiny_bert,
        "data": _write(tmp_path / "train.jsonl", pairs),
        "lora-rank": 2,
        "max-length": 16,
    }
    run = parse_config(RunConfig, values, what="run config")
    loaded = load_model(model_config_for(run), method="nondp")
    assert loaded.config.text_pairs  # text-pairs = auto: the run's data are pairs
    held_out = _write(tmp_path / "dev.jsonl", single)
    with pytest.raises(ConfigError) as info:
        _server_eval(run.model_copy(update={"server_eval_data": held_out}), loaded)
    assert str(info.value).startswith("server-eval-data: the run has text-pairs=true (auto")
    assert held_out in str(info.value)
    paired = _write(tmp_path / "dev-pairs.jsonl", pairs[:4])
    assert callable(_server_eval(run.model_copy(update={"server_eval_data": paired}), loaded))
