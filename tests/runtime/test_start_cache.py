"""Cached start-up work of a site (prism_runtime: cache, init_cache, shard_cache).

A cache hit must give exactly what a fresh computation gives (every tensor equal, bit for bit),
a bad cache file must be detected and recomputed (never trusted, never a crash), every input
must be in the key, and private cache files are readable by the site's user only.
"""

from __future__ import annotations

import logging
import stat

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModel

from client.policy import site_policy
from prism_runtime.cache import cached_float, load_tensors, save_tensors
from prism_runtime.config import SiteConfig, parse_config
from prism_runtime.data import TokenizedDataset
from prism_runtime.init_cache import start_key
from prism_runtime.model import ModelConfig, load_model, load_tokenizer
from prism_runtime.shard_cache import shard_key
from prism_runtime.synthetic import synthetic_examples

PAIRS = [
    {"text_a": "a cat sat on the mat", "text_b": "the mat had a cat", "label": 1},
    {"text_a": "rain today", "text_b": "a long and entirely unrelated sentence", "label": 0},
]
LLM_ROWS = [
    {"instruction": "add two and three", "input": "", "output": "five", "answer": "5"},
    {"instruction": "name a colour", "input": "of the sky", "output": "blue", "answer": None},
]


def _config(model: str, **overrides: object) -> ModelConfig:
    values: dict[str, object] = {"model": model, "rank": 4, "device": "cpu"}
    values.update(overrides)
    return ModelConfig(**values)


def _tensors(loaded):
    return dict(loaded.model.state_dict())


def _assert_bit_identical(a, b) -> None:
    """Same names; every tensor of the same dtype and shape with equal bits (tolerance 0)."""
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name
    for pa, pb in zip(a.initial_points, b.initial_points, strict=True):
        assert torch.equal(pa.A, pb.A) and torch.equal(pa.B, pb.B)


def _start_files(folder):
    return sorted(folder.glob("spectral-residual-*.safetensors"))


@pytest.fixture(scope="module")
def fresh(tiny_bert):
    """The spectral-residual model built by peft with no cache at all."""
    return load_model(_config(tiny_bert))


# -- the spectral-residual (PiSSA) start ---------------------------------------------------------


def test_a_cached_start_is_bit_identical_to_peft_pissa(tiny_bert, fresh, tmp_path, caplog):
    cache = tmp_path / "cache"
    first = load_model(_config(tiny_bert), cache_dir=cache)  # computes and stores
    assert len(_start_files(cache)) == 1
    caplog.set_level(logging.INFO, logger="prism_runtime.init_cache")
    hit = load_model(_config(tiny_bert), cache_dir=cache)
    assert any("read from" in r.getMessage() for r in caplog.records)
    _assert_bit_identical(first, fresh)
    _assert_bit_identical(hit, fresh)
    assert hit.peft_model.peft_config["default"].init_lora_weights == "pissa"
    # the start is PiSSA's (not a zero or random adapter): Z = s B A is the top-r part of W0
    h = hit.handles[0]
    assert h.lora_B.abs().max() > 0 and h.lora_A.abs().max() > 0


def _corrupt_truncated(path, key):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_other_key(path, key):
    save_tensors(path, load_tensors(path, key), "0" * 64)


def _corrupt_wrong_shape(path, key):
    tensors = load_tensors(path, key)
    name = next(n for n in tensors if n.endswith("/lora_A"))
    tensors[name] = tensors[name][:-1].contiguous()  # one rank row fewer, digest rewritten
    save_tensors(path, tensors, key)


def _corrupt_flipped_byte(path, key):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes: only the digest can tell
    path.write_bytes(bytes(data))


def _corrupt_other_modules(path, key):
    tensors = load_tensors(path, key)
    renamed = {n.replace("query", "key"): t for n, t in tensors.items()}
    save_tensors(path, renamed, key)


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_truncated,
        _corrupt_other_key,
        _corrupt_wrong_shape,
        _corrupt_flipped_byte,
        _corrupt_other_modules,
    ],
)
def test_a_bad_start_cache_is_recomputed_with_a_warning_never_trusted(
    tiny_bert, fresh, tmp_path, caplog, corrupt
):
    cache = tmp_path / "cache"
    load_model(_config(tiny_bert), cache_dir=cache)
    (path,) = _start_files(cache)
    base = AutoModel.from_pretrained(tiny_bert)
    key = start_key(base, _lora_config(4))
    assert path.name == f"spectral-residual-{key[:32]}.safetensors"
    corrupt(path, key)
    caplog.set_level(logging.WARNING)
    again = load_model(_config(tiny_bert), cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("recomputing" in w and str(path) in w for w in warnings), warnings
    _assert_bit_identical(again, fresh)
    assert load_tensors(path, key) is not None  # rewritten, trusted again


def _lora_config(rank: int) -> LoraConfig:
    return LoraConfig(
        task_type="FEATURE_EXTRACTION",
        r=rank,
        lora_alpha=16.0,
        target_modules=["query", "value"],
        init_lora_weights="pissa",
    )


def test_the_start_key_changes_with_a_target_weight_the_rank_and_the_init(tiny_bert):
    base = AutoModel.from_pretrained(tiny_bert)
    key = start_key(base, _lora_config(4))
    assert start_key(base, _lora_config(4)) == key  # deterministic
    assert start_key(base, _lora_config(2)) != key
    other_init = _lora_config(4)
    other_init.init_lora_weights = "pissa_niter_2"
    assert start_key(base, other_init) != key
    weight = base.encoder.layer[1].attention.self.value.weight
    with torch.no_grad():
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))  # one ulp
    assert start_key(base, _lora_config(4)) != key


def test_a_changed_base_checkpoint_is_a_cache_miss(tiny_bert, tmp_path):
    cache = tmp_path / "cache"
    load_model(_config(tiny_bert), cache_dir=cache)
    changed = tmp_path / "changed-bert"
    model = AutoModel.from_pretrained(tiny_bert)
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.mul_(1.5)
    model.save_pretrained(changed)
    load_tokenizer(tiny_bert).save_pretrained(changed)
    fresh_changed = load_model(_config(str(changed)))
    cached_changed = load_model(_config(str(changed)), cache_dir=cache)
    assert len(_start_files(cache)) == 2  # its own entry, not the other checkpoint's
    _assert_bit_identical(cached_changed, fresh_changed)


def test_randomised_svd_and_other_inits_are_not_cached(tiny_bert, tmp_path):
    cache = tmp_path / "cache"
    load_model(_config(tiny_bert, svd_niter=2), cache_dir=cache)
    load_model(_config(tiny_bert, init="orthonormal"), cache_dir=cache)
    assert _start_files(cache) == []


# -- the tokenised shard -------------------------------------------------------------------------


def _assert_same_items(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            else:
                assert type(x[k]) is type(y[k]) and x[k] == y[k], k


def _shard_files(folder):
    return sorted(folder.glob("shard-*.safetensors"))


@pytest.mark.parametrize(
    ("rows", "task", "pair_encoding"),
    [
        ("synthetic", "seq-cls", "joint"),
        ("pairs", "seq-cls", "siamese"),
        ("pairs", "seq-cls", "joint"),
        ("llm", "causal-lm", "joint"),
    ],
)
def test_a_cached_shard_equals_fresh_tokenisation(
    tiny_bert, tmp_path, caplog, rows, task, pair_encoding
):
    examples = {
        "synthetic": synthetic_examples(40, seed=3),
        "pairs": PAIRS,
        "llm": LLM_ROWS,
    }[rows]
    tokenizer = load_tokenizer(tiny_bert)
    if task == "causal-lm":
        tokenizer.eos_token = "[SEP]"  # the causal-lm rows need an eos
    kwargs = {"max_length": 12, "pair_encoding": pair_encoding}
    fresh = TokenizedDataset(examples, tokenizer, task, **kwargs)
    cache = tmp_path / "cache"
    stored = TokenizedDataset(examples, tokenizer, task, cache_dir=cache, **kwargs)
    caplog.set_level(logging.INFO, logger="prism_runtime.shard_cache")
    hit = TokenizedDataset(examples, tokenizer, task, cache_dir=cache, **kwargs)
    assert any("read from" in r.getMessage() for r in caplog.records)
    for other in (stored, hit):
        _assert_same_items(list(fresh), list(other))


def test_private_cache_files_are_readable_by_the_site_user_only(tiny_bert, tmp_path):
    cache = tmp_path / "cache"
    TokenizedDataset(PAIRS, load_tokenizer(tiny_bert), "seq-cls", max_length=12, cache_dir=cache)
    load_model(_config(tiny_bert), cache_dir=cache)
    files = [*_shard_files(cache), *_start_files(cache)]
    assert len(files) == 2
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert not list(cache.glob(".*.tmp"))  # no temporary file left behind


def test_the_shard_key_changes_with_the_data_tokenizer_settings(tiny_bert):
    bert, more_vocab, left = (load_tokenizer(tiny_bert) for _ in range(3))
    more_vocab.add_tokens(["newword"])
    left.truncation_side = "left"
    rows = synthetic_examples(10, seed=0)
    settings = {"task": "seq-cls", "max_length": 16, "pair_encoding": "joint"}
    key = shard_key(rows, bert, train_on_prompt=False, **settings)
    TokenizedDataset(rows, bert, "seq-cls", max_length=5)  # leaves per-call state in the backend
    assert shard_key(rows, bert, train_on_prompt=False, **settings) == key
    assert shard_key([dict(r) for r in rows], bert, train_on_prompt=False, **settings) == key
    edited = [dict(r) for r in rows]
    edited[7]["text"] += "!"
    relabelled = [dict(r) for r in rows]
    relabelled[2]["label"] = 1 - relabelled[2]["label"]
    changed = [
        shard_key(edited, bert, train_on_prompt=False, **settings),
        shard_key(relabelled, bert, train_on_prompt=False, **settings),
        shard_key(rows[:-1], bert, train_on_prompt=False, **settings),
        shard_key(rows, bert, train_on_prompt=False, **{**settings, "max_length": 17}),
        shard_key(rows, bert, train_on_prompt=False, **{**settings, "pair_encoding": "siamese"}),
        shard_key(rows, bert, train_on_prompt=True, **settings),
        shard_key(rows, more_vocab, train_on_prompt=False, **settings),
        shard_key(rows, left, train_on_prompt=False, **settings),
    ]
    assert key not in changed and len(set(changed)) == len(changed)


def test_a_changed_data_file_is_a_shard_cache_miss(tiny_bert, tmp_path):
    tokenizer, cache = load_tokenizer(tiny_bert), tmp_path / "cache"
    rows = synthetic_examples(20, seed=1)
    TokenizedDataset(rows, tokenizer, "seq-cls", max_length=12, cache_dir=cache)
    edited = [dict(r) for r in rows]
    edited[0]["text"] = "an entirely different first sentence"
    got = TokenizedDataset(edited, tokenizer, "seq-cls", max_length=12, cache_dir=cache)
    _assert_same_items(
        list(got), list(TokenizedDataset(edited, tokenizer, "seq-cls", max_length=12))
    )
    assert len(_shard_files(cache)) == 2


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_flipped_byte, _corrupt_other_key])
def test_a_bad_shard_cache_is_recomputed_with_a_warning(tiny_bert, tmp_path, caplog, corrupt):
    tokenizer, cache = load_tokenizer(tiny_bert), tmp_path / "cache"
    rows = synthetic_examples(20, seed=2)
    TokenizedDataset(rows, tokenizer, "seq-cls", max_length=12, cache_dir=cache)
    (path,) = _shard_files(cache)
    key = shard_key(
        rows, tokenizer, task="seq-cls", max_length=12, pair_encoding="joint", train_on_prompt=False
    )
    corrupt(path, key)
    caplog.set_level(logging.WARNING)
    got = TokenizedDataset(rows, tokenizer, "seq-cls", max_length=12, cache_dir=cache)
    assert any("recomputing" in r.getMessage() for r in caplog.records)
    _assert_same_items(list(got), list(TokenizedDataset(rows, tokenizer, "seq-cls", max_length=12)))
    assert load_tensors(path, key) is not None


# -- small values and where caches live ----------------------------------------------------------


def test_a_cached_value_is_returned_bit_for_bit_and_computed_once(tmp_path):
    calls = []

    def compute() -> float:
        calls.append(1)
        return 0.1 + 0.2  # not representable exactly: a float32 round trip would change it

    parts = {"what": "test", "x": 1}
    assert cached_float(tmp_path, parts, compute) == 0.1 + 0.2
    assert cached_float(tmp_path, parts, compute) == 0.1 + 0.2
    assert cached_float(tmp_path, {**parts, "x": 2}, compute) == 0.1 + 0.2
    assert len(calls) == 2  # the second call was a hit, the third another key


def test_cache_paths_come_from_the_site_never_from_the_run(tmp_path):
    def node(**values):
        return parse_config(
            SiteConfig, {"partition-id": 0, "num-partitions": 2, **values}, what="n"
        )

    # A simulated site whose state folder comes from the RUN config's run-dir: no cache.
    assert site_policy(node(), run_dir=str(tmp_path / "run")).cache_dir is None
    own = node(**{"state-dir": str(tmp_path / "state")})
    assert site_policy(own, run_dir=str(tmp_path / "run")).cache_dir == tmp_path / "state" / "cache"
    env = site_policy(own, env_cache_dir=str(tmp_path / "env"))
    assert env.cache_dir == tmp_path / "env"
    named = node(**{"state-dir": str(tmp_path / "state"), "cache-dir": str(tmp_path / "mine")})
    assert site_policy(named, env_cache_dir=str(tmp_path / "env")).cache_dir == tmp_path / "mine"
