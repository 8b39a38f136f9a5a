"""A federated site's round: its own cap, its durable ledger, and what leaves it."""

from __future__ import annotations

import pytest
import torch

from client.config import RunConfig, SiteConfig, parse_config
from client.errors import ConfigError
from client.exchange import to_arrays
from client.protocol import ACCOUNTING_KEYS, HEAD_PREFIX, STATUS_OK, STATUS_REFUSED
from client.site import Site
from prism_core.accounting import PrivacyEvent, epsilon


def _run(tiny_bert, **overrides):
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 2,
        "batch-size": 16,
        "micro-batch-size": 8,
        "synthetic-examples": 64,
        "max-length": 24,
        "noise-multiplier": 1.0,
        "target-epsilon": 50.0,
    }
    values.update(overrides)
    return parse_config(RunConfig, values, what="run config")


def _site(tiny_bert, tmp_path, run=None, **node):
    run = run or _run(tiny_bert)
    config = parse_config(
        SiteConfig, {"partition-id": 0, "num-partitions": 3, **node}, what="node config"
    )
    return Site(run, config, tmp_path / "state")


def test_default_reply_carries_only_dp_update_and_accounting_facts(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting["status"] == STATUS_OK
    assert set(reply.accounting) <= set(ACCOUNTING_KEYS)
    assert "num-examples" not in reply.accounting  # not shared unless the site allows it
    assert reply.nonprivate == {}
    modules = {h.name for h in site.loaded.handles}
    for name in reply.arrays:
        if name.startswith(HEAD_PREFIX):
            continue
        module, part = name.rsplit("/", 1)
        assert module in modules and part in ("dA", "dB")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in reply.arrays.values())


def test_nonprivate_metrics_only_on_opt_in_and_labelled(tiny_bert, tmp_path):
    run = _run(tiny_bert, **{"report-train-loss": True})
    site = _site(tiny_bert, tmp_path, run=run, **{"share-num-examples": True})
    reply = site.train_round(1, to_arrays(site.loaded))
    assert list(reply.nonprivate) == ["nonprivate-train-loss"]
    assert reply.accounting["num-examples"] == 64


def test_site_refuses_past_its_own_cap_even_if_asked(tiny_bert, tmp_path):
    run = _run(tiny_bert)
    one_round = epsilon([PrivacyEvent(1.0, 16 / 64, 2)], 1e-5)
    site = _site(tiny_bert, tmp_path, run=run, **{"epsilon-cap": one_round * 1.2})
    first = site.train_round(1, to_arrays(site.loaded))
    second = site.train_round(2, to_arrays(site.loaded))  # the server ignored the cap
    assert first.accounting["status"] == STATUS_OK
    assert second.accounting["status"] == STATUS_REFUSED and second.arrays == {}
    assert "exceed this site's cap" in second.accounting["reason"]
    assert [e.steps for e in site.ledger.entries()] == [2]
    assert site.ledger.epsilon(1e-5) == pytest.approx(one_round)


def test_site_cap_can_only_be_lowered_and_a_restart_remembers_spent_budget(tiny_bert, tmp_path):
    run = _run(tiny_bert)
    high = parse_config(
        SiteConfig, {"partition-id": 0, "num-partitions": 3, "epsilon-cap": 500.0}, what="n"
    )
    assert high.cap(run) == (50.0, 1e-5)  # the site cannot be given more than the run allows
    site = _site(tiny_bert, tmp_path, run=run)
    site.train_round(1, to_arrays(site.loaded))
    restarted = _site(tiny_bert, tmp_path, run=run)
    spent = site.ledger.epsilon(1e-5)
    assert spent > 0
    assert restarted.ledger.epsilon(1e-5) == pytest.approx(spent)


def test_bad_run_and_node_configs_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown run config key\(s\) \['lora-rnak'\]"):
        parse_config(RunConfig, {"lora-rnak": 4}, what="run config")
    with pytest.raises(ConfigError, match="run config local-steps=0"):
        parse_config(RunConfig, {"local-steps": 0}, what="run config")
    with pytest.raises(ConfigError, match="min-sites=5 exceeds sites-per-round=3"):
        parse_config(RunConfig, {"min-sites": 5}, what="run config")


def _same(a, b):
    return set(a) == set(b) and all(a[k].equal(b[k]) for k in a)


def test_a_re_asked_round_resends_the_stored_reply_and_spends_nothing(tiny_bert, tmp_path):
    site = _site(tiny_bert, tmp_path)
    arrays = to_arrays(site.loaded)
    first = site.train_round(1, arrays, run_id="run-a")
    restarted = _site(tiny_bert, tmp_path)  # a new process of the same site
    again = restarted.train_round(1, arrays, run_id="run-a")
    assert _same(again.arrays, first.arrays) and again.accounting == first.accounting
    assert [e.server_round for e in restarted.ledger.entries()] == [1]  # charged once
    moved = {k: v + 1e-3 for k, v in arrays.items()}  # another broadcast point: a new release
    other = restarted.train_round(1, moved, run_id="run-a")
    assert not _same(other.arrays, first.arrays)
    assert [e.server_round for e in restarted.ledger.entries()] == [1, 1]


def test_round_randomness_depends_on_seed_site_and_round_not_process_history(tiny_bert, tmp_path):
    fresh = _site(tiny_bert, tmp_path / "a")
    used = _site(tiny_bert, tmp_path / "b")
    arrays = to_arrays(fresh.loaded)
    torch.rand(1000)  # advance the global RNG and this site's sampler and noise streams
    next(used.trainer._batches)
    torch.randn(5, generator=used.trainer.noise)
    a = fresh.train_round(3, arrays, run_id="x")
    b = used.train_round(3, arrays, run_id="y")
    assert _same(a.arrays, b.arrays)  # bitwise
    c = _site(tiny_bert, tmp_path / "c").train_round(4, arrays, run_id="x")
    assert not _same(a.arrays, c.arrays)  # another round draws other batches and noise


def test_siamese_pairs_with_a_zero_shot_sgd_head_run_a_round(tiny_bert, tmp_path):
    """Text pairs encoded siamese, the head from the cosine rule, trained by SGD with its own
    clip share: a round runs and replies with a finite DP update (head included)."""
    import json

    from conftest import SHARED_DATA

    with open(SHARED_DATA / "medical_questions_pairs" / "train.jsonl", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(96)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = {
        "data": str(data),
        "text-pairs": True,
        "pair-encoding": "siamese",
        "head-init": "zero-shot",
        "lora-head": "train",
        "head-optimizer": "sgd",
        "head-lr": 1.0,
        "head-max-norm": 0.03,  # of max-norm 0.05: LoRA gets 0.04
    }
    site = _site(tiny_bert, tmp_path, run=_run(tiny_bert, **pairs))
    assert site.loaded.spec.siamese and site.loaded.pair_encoding == "siamese"
    broadcast = to_arrays(site.loaded)
    reply = site.train_round(1, broadcast)
    assert reply.accounting["status"] == STATUS_OK
    assert all(torch.isfinite(t).all() for t in reply.arrays.values())
    assert reply.arrays[HEAD_PREFIX + "head.weight"].abs().sum() > 0  # the head moved
    with pytest.raises(ConfigError, match="text-pairs=true but this site's data are single"):
        _site(tiny_bert, tmp_path / "single", run=_run(tiny_bert, **{"text-pairs": True}))
