"""``prism-fl evaluate`` / ``predict`` on exported models: the user's view of a finished run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers.shared_data import shared_data_file
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModel

from client.cli import EXIT_OK
from client.cli import main as prism_train
from prism_runtime.export import ADAPTER_WEIGHTS
from server.cli import EXIT_USAGE
from server.cli import main as prism_fl

FAST = ["--steps", "3", "--batch-size", "16", "--rank", "2", "--max-length", "32"]
FAST += ["--no-progress", "--method", "prism", "--epsilon", "8"]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows(name: str, split: str, n: int) -> list[dict]:
    with open(shared_data_file(f"{name}/{split}.jsonl"), encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def _train(model: str, train: Path, dev: Path, out: Path, *extra: str) -> dict:
    args = ["--model", model, "--data", str(train), "--eval-data", str(dev), "--out", str(out)]
    assert prism_train([*args, *FAST, *extra]) == EXIT_OK
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("kind", ["single", "siamese-pairs"])
def test_evaluate_reproduces_the_runs_metrics_and_predict_agrees(kind, tiny_bert, tmp_path, capsys):
    """An exported model (LoRA on the original base + pooling + head) scored by ``prism-fl
    evaluate`` gives the accuracy and loss prism-train reported on the same rows; ``predict``
    on the same rows without labels gives the same predictions."""
    if kind == "single":
        train = _write(tmp_path / "train.jsonl", _rows("sst2", "train", 64))
        dev_rows = _rows("sst2", "dev", 30)
        extra: tuple[str, ...] = ()
    else:  # siamese pairs with a zero-shot (cosine) head, on a plain BERT by request
        train = _write(tmp_path / "train.jsonl", _rows("medical_questions_pairs", "train", 64))
        dev_rows = _rows("medical_questions_pairs", "dev", 30)
        extra = ("--pair-encoding", "siamese", "--head-init", "zero-shot", "--head-max-norm", "0.1")
    dev = _write(tmp_path / "dev.jsonl", dev_rows)
    out = tmp_path / "run"
    metrics = _train(tiny_bert, train, dev, out, *extra)
    spec = json.loads((out / "adapter" / "classifier.json").read_text())
    assert spec["siamese"] is (kind == "siamese-pairs")

    report = tmp_path / "eval.json"
    code = prism_fl(["evaluate", str(out), "--data", str(dev), "--json", str(report)])
    assert code == EXIT_OK
    printed = capsys.readouterr().out
    assert f"accuracy {metrics['eval']['accuracy']:.4f} on 30 rows" in printed
    got = json.loads(report.read_text())
    assert got["accuracy"] == pytest.approx(metrics["eval"]["accuracy"], abs=1e-9)
    assert got["loss"] == pytest.approx(metrics["eval"]["loss"], abs=1e-5)
    rows = [
        json.loads(line) for line in (out / "predictions" / "dev.jsonl").read_text().splitlines()
    ]
    assert [r["row"] for r in rows] == list(range(1, 31))
    assert [r["label"] for r in rows] == [r["label"] for r in dev_rows]
    assert sum(r["correct"] for r in rows) / 30 == pytest.approx(got["accuracy"], abs=1e-9)
    assert all(abs(sum(r["probabilities"]) - 1) < 1e-4 for r in rows)

    unlabelled = _write(
        tmp_path / "new.jsonl", [{k: v for k, v in r.items() if k != "label"} for r in dev_rows]
    )
    predictions = tmp_path / "predictions.jsonl"
    code = prism_fl(
        ["predict", str(out / "adapter"), "--data", str(unlabelled), "--out", str(predictions)]
    )
    assert code == EXIT_OK
    predicted = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [p["prediction"] for p in predicted] == [r["prediction"] for r in rows]
    assert all("label" not in p and "correct" not in p for p in predicted)


def test_exported_adapter_loads_with_plain_peft_on_the_original_base(tiny_bert, tmp_path):
    """``PeftModel.from_pretrained(AutoModel.from_pretrained(base), adapter)`` loads every
    LoRA weight of the file (no missing keys) into the encoder."""
    train = _write(tmp_path / "train.jsonl", _rows("sst2", "train", 48))
    out = tmp_path / "run"
    _train(tiny_bert, train, train, out)
    saved = load_file(str(out / "adapter" / ADAPTER_WEIGHTS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert), out / "adapter")
    assert not [w for w in caught if "adapter keys" in str(w.message)]  # none missing/unexpected
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved) > 0
    for name, value in saved.items():
        loaded = state[name.replace(".weight", ".default.weight")]
        torch.testing.assert_close(loaded, value, rtol=0, atol=0)


def test_evaluate_and_predict_refuse_bad_input_with_a_clear_message(tiny_bert, tmp_path, capsys):
    empty = tmp_path / "nothing"
    empty.mkdir()
    data = _write(tmp_path / "d.jsonl", _rows("sst2", "dev", 4))
    assert prism_fl(["evaluate", str(empty), "--data", str(data)]) == EXIT_USAGE
    assert "no exported adapter here" in capsys.readouterr().err
    train = _write(tmp_path / "train.jsonl", _rows("sst2", "train", 48))
    out = tmp_path / "run"
    _train(tiny_bert, train, train, out)
    unlabelled = _write(tmp_path / "u.jsonl", [{"text": "fine"}])
    assert prism_fl(["evaluate", str(out), "--data", str(unlabelled)]) == EXIT_USAGE
    assert "missing field 'label'" in capsys.readouterr().err
    pairs = _write(tmp_path / "p.jsonl", _rows("medical_questions_pairs", "dev", 2))
    assert prism_fl(["predict", str(out), "--data", str(pairs), "--out", str(tmp_path / "o")]) == 0
    assert prism_fl(["predict", str(out), "--data", str(tmp_path / "x.jsonl"), "--out", "o"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_evaluate_scores_a_causal_lm_by_exact_match_like_client_evaluate(tiny_llama, tmp_path):
    """A causal-lm export (no classifier files) is evaluated by greedy generation: the same
    exact match and responses as ``prism_runtime.evaluate`` on the model that was exported."""
    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import evaluate_rows
    from prism_runtime.export import export_adapter
    from prism_runtime.model import ModelConfig, load_model

    config = ModelConfig(
        model=tiny_llama, task="causal-lm", rank=2, target_modules=("q_proj", "v_proj")
    )
    lm = load_model(config)
    export_adapter(lm, tmp_path / "run" / "adapter")
    rows = _rows("mawps", "dev", 3)
    data = _write(tmp_path / "mawps.jsonl", rows)
    want, want_rows = evaluate_rows(
        lm, load_examples(data, "causal-lm"), max_length=64, batch_size=2
    )
    report = tmp_path / "eval.json"
    args = ["evaluate", str(tmp_path / "run"), "--data", str(data), "--max-length", "64"]
    assert prism_fl([*args, "--model", tiny_llama, "--json", str(report)]) == EXIT_OK
    got = json.loads(report.read_text())
    assert got["exact_match"] == want["exact_match"] and got["examples"] == 3
    lines = (tmp_path / "run" / "predictions" / "mawps.jsonl").read_text().splitlines()
    assert [json.loads(line)["response"] for line in lines] == [r["response"] for r in want_rows]
