"""The secure-aggregation round end to end in one process: the real coordinator
(``server.federation.run_federation``: strategy, ledger, central step) and the real ClientApp of
each site, over a loopback grid that keeps each node's ``context.state`` between messages as a
SuperNode does. Flower's transport is left out (tests/e2e runs it on real SuperNodes)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Message
from flwr.supercore.task_identity import TaskIdentity
from resume_driver import CrashAt, CrashError, LoopbackGrid, assert_same_adapter

from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.protocol import SECURE_STAGES
from prism_runtime.secure_sum.wire import RECORD
from server.federation import run_federation
from server.ledger import Ledger

SITES, ROUNDS = 3, 2


class SecureGrid(LoopbackGrid):
    """``LoopbackGrid`` (each node's ``context.state`` kept between messages) with the node
    configs ``nodes``; ``drop`` maps a node to the message action it stops answering at (e.g.
    ``secure_unmask``); ``types`` lists the message types sent."""

    def __init__(
        self,
        run_config: dict[str, object],
        *,
        nodes: dict[int, dict[str, Any]],
        drop: dict[int, str] | None = None,
    ) -> None:
        super().__init__(run_config, len(nodes))
        self.nodes, self.drop = nodes, drop or {}
        self.types: list[str] = []

    def answer(self, msg: Message) -> Message | None:  # type: ignore[override]
        self.types.append(msg.metadata.message_type)
        if self.drop.get(msg.metadata.dst_node_id) == msg.metadata.message_type.removeprefix(
            "train."
        ):
            return None
        return super().answer(msg)


def _config(model: str, run_dir: Path, **extra: object) -> dict[str, object]:
    values: dict[str, object] = {
        "model": model,
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "local-steps": 1,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 96,
        "max-length": 24,
        "target-epsilon": 8.0,
        "sites-per-round": SITES,
        "secure-aggregation": True,
        "min-honest-sites": 2,
        "round-timeout": 3.0,  # a dropped site's stage ends after this
        "server-eval-data": "synthetic",
        "run-dir": str(run_dir),
    }
    values.update(extra)
    return values


def _nodes(**extra: object) -> dict[int, dict[str, Any]]:
    return {100 + i: {"partition-id": i, "num-partitions": SITES, **extra} for i in range(SITES)}


def _run(values: dict[str, object], grid: SecureGrid) -> Path:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run = parse_config(RunConfig, values, what="run config")
    return run_federation(grid, run)  # type: ignore[arg-type]


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_secure_run_applies_the_sum_and_records_both_epsilons(tiny_bert, tmp_path, caplog):
    values = _config(tiny_bert, tmp_path / "run")
    grid = SecureGrid(values, nodes=_nodes())
    timed: list[str] = []

    class Stages(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "secure stage" in record.getMessage():
                timed.append(record.getMessage().split()[4])

    strategy, handler = logging.getLogger("server.strategy"), Stages()
    level = strategy.level
    strategy.addHandler(handler)
    strategy.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.WARNING, logger="server.federation"):
            run_dir = _run(values, grid)
    finally:
        strategy.removeHandler(handler)
        strategy.setLevel(level)
    assert any("sites weigh EQUALLY" in r.getMessage() for r in caplog.records)  # sample-rate 0
    stages = [
        "advertise",
        "share_keys",
        "collect_masked",
        "check_consistency",
        "sample_signatures",
        "unmask_sum",
    ]
    assert timed == stages * ROUNDS  # each stage's wall time, logged (bench/secure_cost.py)
    summary = _summary(run_dir)
    assert summary["rounds-applied"] == ROUNDS, summary["rounds"]
    assert all(r["accepted"] and len(r["accepted"]) == SITES for r in summary["rounds"])
    actions = {t for t in grid.types}
    assert actions == {f"train.{a}" for a in SECURE_STAGES}, actions
    evals = summary["server-eval"]
    assert set(evals) == {"0", "1", "2"} or set(evals) == {0, 1, 2}
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        events = ledger.events()
    assert len(events) == SITES * ROUNDS
    for e in events:
        assert e.mechanism == SKELLAM_MECHANISM
        assert e.event.secure is not None and e.event.secure.honest_sites == 2
        assert 0 < e.event.secure.share_sigma < e.event.noise_multiplier
    report = json.loads((run_dir / "report.json").read_text())
    for row in report["sites"]:
        collusion = next(v for k, v in row.items() if "collu" in k and isinstance(v, float))
        assert collusion > row["epsilon"] > 0, row
        assert row["epsilon"] <= 8.0 + 1e-9
    for i in range(SITES):  # each site's own ledger: one Skellam charge per round, both fields
        lines = (run_dir / "sites" / f"site-{i}" / "privacy-ledger.jsonl").read_text()
        entries = [json.loads(x) for x in lines.splitlines()]
        assert [x["mechanism"] for x in entries] == [SKELLAM_MECHANISM] * ROUNDS
        assert all(x["honest_sites"] == 2 and x["share_sigma"] < x["sigma"] for x in entries)
    assert (run_dir / "adapter").is_dir()


TOLERANT = {"min-honest-sites": 3, "secure-max-dropouts": 1}
"""Sites that count on all three being honest and tolerate one of them missing: the threshold
condition then allows t = 2 of 3 (t >= n - D and t > n - H + D)."""


def test_a_site_dropping_after_masking_is_recovered(tiny_bert, tmp_path):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1, "min-honest-sites": 3})
    grid = SecureGrid(values, nodes=_nodes(**TOLERANT), drop={102: "secure_unmask"})
    summary = _summary(_run(values, grid))
    (only,) = summary["rounds"]
    assert only["applied"] and len(only["accepted"]) == SITES, only


def test_a_site_dropping_before_masking_is_left_out_of_the_sum(tiny_bert, tmp_path):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1, "min-honest-sites": 3})
    grid = SecureGrid(values, nodes=_nodes(**TOLERANT), drop={102: "secure_mask"})
    summary = _summary(_run(values, grid))
    (only,) = summary["rounds"]
    assert only["applied"] and len(only["accepted"]) == SITES - 1, only


def test_a_site_that_tolerates_no_dropout_makes_a_dropout_abort_the_round(tiny_bert, tmp_path):
    """D = 0 (the default) at one site: the threshold is every roster site, so a site dropping
    after the key exchange aborts the round before anything is unmasked (the others tolerate
    one: the least threshold every site accepts is the strictest)."""
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1, "min-honest-sites": 3})
    nodes = _nodes(**TOLERANT)
    nodes[100]["secure-max-dropouts"] = 0
    grid = SecureGrid(values, nodes=nodes, drop={102: "secure_mask"})
    summary = _summary(_run(values, grid))
    (only,) = summary["rounds"]
    assert not only["applied"] and "the threshold needs 3" in only["discarded"], only
    assert "train.secure_consistency" not in grid.types


def test_a_site_dropping_after_masking_without_signing_leaves_too_few_signatures(
    tiny_bert, tmp_path
):
    """Every survivor must sign for t = 3 of 3: one that masks and then never signs aborts the
    round before any share is revealed (its charge stands)."""
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1})
    grid = SecureGrid(values, nodes=_nodes(), drop={102: "secure_consistency"})
    run_dir = _run(values, grid)
    (only,) = _summary(run_dir)["rounds"]
    assert not only["applied"] and "2 survivors signed" in only["discarded"], only
    assert "train.secure_unmask" not in grid.types
    for i in range(SITES):  # every site masked: one charge each
        lines = (run_dir / "sites" / f"site-{i}" / "privacy-ledger.jsonl").read_text()
        assert len(lines.splitlines()) == 1


def test_fewer_masked_inputs_than_h_abort_with_nothing_released(tiny_bert, tmp_path):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1, "min-honest-sites": 3})
    grid = SecureGrid(values, nodes=_nodes(), drop={102: "secure_mask"})
    run_dir = _run(values, grid)
    summary = _summary(run_dir)
    (only,) = summary["rounds"]
    assert not only["applied"] and "aborted" in only["discarded"], only
    assert summary["adapter"] is None
    assert "train.secure_consistency" not in grid.types  # nothing was asked to be signed


@pytest.mark.parametrize("policy", ["require"])
def test_a_require_site_refuses_a_plain_round_with_a_code(tiny_bert, tmp_path, policy):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1})
    values["secure-aggregation"] = False
    values["local-steps"] = 1
    nodes = _nodes()
    nodes[100]["secure-aggregation"] = policy
    run_dir = _run(values, SecureGrid(values, nodes=nodes))
    (only,) = _summary(run_dir)["rounds"]
    assert only["refusal_codes"] == {"site-0": "secure-aggregation-required"}, only
    own = run_dir / "sites" / "site-0" / "privacy-ledger.jsonl"
    assert not own.exists() or own.read_text() == ""  # charged nothing


def test_an_off_site_refuses_a_secure_round_and_the_others_go_on(tiny_bert, tmp_path):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1})
    nodes = _nodes()
    nodes[100]["secure-aggregation"] = "off"
    (only,) = _summary(_run(values, SecureGrid(values, nodes=nodes)))["rounds"]
    assert only["refusal_codes"] == {"site-0": "secure-aggregation-off"}, only
    assert only["applied"] and sorted(only["accepted"]) == ["site-1", "site-2"], only


class SubstitutingGrid(SecureGrid):
    """A coordinator that swaps one site's advertised mask key for its own in the roster."""

    def answer(self, msg: Message) -> Message | None:  # type: ignore[override]
        if msg.metadata.message_type == "train.secure_share":
            record = msg.content[RECORD]
            keys = list(record["leaves-mask-public"])  # type: ignore[arg-type]
            keys[0] = X25519PrivateKey.generate().public_key().public_bytes_raw()
            record["leaves-mask-public"] = keys
        return super().answer(msg)


def test_a_coordinator_substituting_a_key_is_caught_before_anything_is_shared(tiny_bert, tmp_path):
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1})
    grid = SubstitutingGrid(values, nodes=_nodes())
    run_dir = _run(values, grid)
    summary = _summary(run_dir)
    (only,) = summary["rounds"]
    assert not only["applied"] and "aborted" in only["discarded"], only
    assert "train.secure_mask" not in grid.types  # no site shared, so none was asked to train
    for i in range(SITES):  # and none charged anything
        own = run_dir / "sites" / f"site-{i}" / "privacy-ledger.jsonl"
        assert not own.exists() or own.read_text() == ""


def test_a_resumed_secure_run_ends_where_the_uninterrupted_one_does(tiny_bert, tmp_path):
    """The coordinator's own state (PRISM's adaptive moments and the head's optimizer, kept
    for the unmasked sums) is checkpointed: a run that dies after round 1's checkpoint and
    resumes ends with the same adapter as a run that never stopped (the sites seed their
    randomness from a site-held secret here, so both runs draw the same noise)."""
    nodes = _nodes(**{"rng-secret": "secure-resume-test"})
    straight = _config(tiny_bert, tmp_path / "straight")
    straight_dir = _run(straight, SecureGrid(straight, nodes=nodes))
    crashed = _config(tiny_bert, tmp_path / "crashed")
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    run = parse_config(RunConfig, crashed, what="run config")
    with pytest.raises(CrashError):
        run_federation(SecureGrid(crashed, nodes=nodes), run, faults=CrashAt("round-start", 2))
    resumed_dir = _run(crashed, SecureGrid(crashed, nodes=nodes))
    assert _summary(resumed_dir)["rounds-applied"] == ROUNDS
    assert_same_adapter(straight_dir, resumed_dir)


def test_every_honest_site_adds_the_largest_share_a_roster_site_signed(
    tiny_bert, tmp_path, monkeypatch
):
    """Sites that count on different numbers of honest sites need different shares (mu / H):
    every site adds the largest, so each site's own mu / H is covered by each honest site. A
    site adding only its own share would leave site-0 (H = 1) with half the noise it charged."""
    import client.masked_input as masked_input_module
    import client.site as site_module

    added: list[float] = []
    encode = masked_input_module.encode_share

    def recording(*args: Any, **kwargs: Any) -> Any:
        added.append(kwargs["mu_share"])
        return encode(*args, **kwargs)

    monkeypatch.setattr(masked_input_module, "encode_share", recording)
    monkeypatch.setattr(site_module, "_memory_low", lambda: False)  # all sites stay open
    values = _config(tiny_bert, tmp_path / "run", **{"num-rounds": 1})
    nodes = _nodes()
    nodes[100]["min-honest-sites"] = 1  # site-0 counts on itself alone: its share is mu / 1
    summary = _summary(_run(values, SecureGrid(values, nodes=nodes)))
    (only,) = summary["rounds"]
    assert only["applied"], only
    own = {s.site_id: s.secure.mu_share for s in site_module._SITES.values() if s.secure}
    assert own["site-0"] == pytest.approx(2 * own["site-1"], rel=1e-12)  # mu / 1 against mu / 2
    assert added == [own["site-0"]] * SITES


def test_one_sample_rate_gives_unequal_sites_one_sigma_and_the_central_divisor(
    tiny_bert, tmp_path, monkeypatch, caplog
):
    """``sample-rate = q``: sites of different sizes (Dirichlet label skew) all sample at q, so
    they charge one sigma and add one share (no site pays for the smallest's), each expects
    q N_k units, and the coordinator divides the sum by q (N_1 + ... + N_K): central PRISM's
    sampling and divisor, shard-size weights by construction."""
    import client.masked_input as masked_input_module
    import client.site as site_module
    from server.strategy.central import CentralStep

    added: list[float] = []
    encode = masked_input_module.encode_share

    def recording(*args: Any, **kwargs: Any) -> Any:
        added.append(kwargs["mu_share"])
        return encode(*args, **kwargs)

    divisors: list[float] = []
    apply = CentralStep.apply

    def dividing(self: CentralStep, *args: Any, **kwargs: Any) -> Any:
        divisors.append(kwargs["expected_batch"])
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(masked_input_module, "encode_share", recording)
    monkeypatch.setattr(CentralStep, "apply", dividing)
    monkeypatch.setattr(site_module, "_memory_low", lambda: False)  # all sites stay open
    q = 0.25
    data = tmp_path / "train.jsonl"
    words = ("dull", "grim", "bad", "good", "fine", "great")
    data.write_text(
        "".join(
            json.dumps({"text": f"a {words[i % 6]} film {i}", "label": int(i % 6 >= 3)}) + "\n"
            for i in range(180)
        )
    )
    values = _config(
        tiny_bert,
        tmp_path / "run",
        **{
            "num-rounds": 1,
            "sample-rate": q,
            "data": str(data),
            "server-eval-data": str(data),
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.3,
        },
    )
    with caplog.at_level(logging.WARNING, logger="server.federation"):
        summary = _summary(_run(values, SecureGrid(values, nodes=_nodes())))
    assert not any("sites weigh EQUALLY" in r.getMessage() for r in caplog.records)
    (only,) = summary["rounds"]
    assert only["applied"], only
    sites = {s.site_id: s for s in site_module._SITES.values() if s.secure}
    sizes = sorted(s.num_units for s in sites.values())
    assert len(sites) == SITES and sizes[0] < sizes[-1], sizes  # unequal shards
    assert {s.sample_rate for s in sites.values()} == {q}
    assert len({s.sigma for s in sites.values()}) == 1
    (share,) = {s.secure.mu_share for s in sites.values()}
    assert added == [share] * SITES
    assert divisors == [pytest.approx(q * sum(sizes), rel=1e-12)]
    for site_id in sites:
        lines = (tmp_path / "run" / "sites" / site_id / "privacy-ledger.jsonl").read_text()
        assert [json.loads(x)["q"] for x in lines.splitlines()] == [q]


def _sparse_run(tmp_path: Path, tiny_bert: str, sites: int, **nodes_extra: object):
    values = _config(
        tiny_bert,
        tmp_path / "run",
        **{
            "num-rounds": 1,
            "sites-per-round": sites,
            "min-honest-sites": sites,
            "secure-graph": "sparse",
            "synthetic-examples": 32 * sites,
        },
    )
    nodes = {
        100 + i: {
            "partition-id": i,
            "num-partitions": sites,
            "min-honest-sites": sites,
            "secure-max-dropouts": 1,
            **nodes_extra,
        }
        for i in range(sites)
    }
    return values, nodes


def test_a_sparse_masking_graph_round_applies_the_sum_with_a_dropout(tiny_bert, tmp_path):
    """Six sites that count on all six and tolerate one missing: the coordinator takes the
    common sparse graph (degree 4, neighbourhood threshold 3), one site drops after masking,
    and the round's sum is unmasked from its neighbours' shares and applied."""
    values, nodes = _sparse_run(tmp_path, tiny_bert, 6)
    grid = SecureGrid(values, nodes=nodes, drop={103: "secure_unmask"})
    applied: list[str] = []

    class Applied(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "secure sum of" in record.getMessage():
                applied.append(record.getMessage())

    strategy, handler = logging.getLogger("server.strategy"), Applied()
    level = strategy.level
    strategy.addHandler(handler)
    strategy.setLevel(logging.INFO)
    try:
        summary = _summary(_run(values, grid))
    finally:
        strategy.removeHandler(handler)
        strategy.setLevel(level)
    (only,) = summary["rounds"]
    assert only["applied"] and len(only["accepted"]) == 6, only
    assert applied and applied[0].endswith("masking graph degree 4"), applied


def test_a_site_that_masks_with_everyone_only_refuses_a_sparse_graph(tiny_bert, tmp_path):
    """Node config secure-graph = complete at one site: it refuses the sparse graph (4010)
    before it shares, and the other five go on within D."""
    values, nodes = _sparse_run(tmp_path, tiny_bert, 6)
    nodes[100]["secure-graph"] = "complete"
    grid = SecureGrid(values, nodes=nodes)
    (only,) = _summary(_run(values, grid))["rounds"]
    assert only["applied"] and sorted(only["accepted"]) == [f"site-{i}" for i in range(1, 6)]
    own = tmp_path / "run" / "sites" / "site-0" / "privacy-ledger.jsonl"
    assert not own.exists() or own.read_text() == ""  # charged nothing


def _unequal_shards_run(tmp_path: Path, tiny_bert: str, **nodes_extra: object):
    """Per-site sampling over Dirichlet shards of very different sizes at epsilon 1 (sigma grows
    about as q: the smallest shard's site needs the largest share) and H = 3."""
    data = tmp_path / "train.jsonl"
    rows = [{"text": f"a good film {i}", "label": 1} for i in range(20)]
    rows += [{"text": f"a dull film {i}", "label": 0} for i in range(20, 200)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = _config(
        tiny_bert,
        tmp_path / "run",
        **{
            "num-rounds": 1,
            "min-honest-sites": SITES,
            "target-epsilon": 1.0,
            "data": str(data),
            "server-eval-data": str(data),
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.05,
        },
    )
    grid = SecureGrid(values, nodes=_nodes(**nodes_extra))
    return _summary(_run(values, grid)), grid


def _refusing(site_module: Any, run_dir: Path) -> list[str]:
    """The sites of the run in ``run_dir`` whose whole noise is below the largest share a site
    of it advertised."""
    sites = {
        s.site_id: s.secure
        for s in site_module._SITES.values()
        if s.secure and Path(s.state_dir).is_relative_to(run_dir)
    }
    assert len(sites) == SITES, sorted(sites)
    largest = max(secure.mu_share for secure in sites.values())
    return sorted(site for site, secure in sites.items() if largest > secure.mu * (1 + 1e-9))


def test_shares_that_some_site_would_refuse_stop_the_round_before_keys_are_shared(
    tiny_bert, tmp_path, monkeypatch
):
    """Per-site sampling over shards of very different sizes: the smallest shard's site needs a
    noise share larger than a large shard's whole noise, which that site refuses to add. The
    coordinator sees it in the signed advertisements; with no dropout to spare (H = 3 of 3,
    t = 3) the round stops there: no key shares sent, nothing charged, and the reason names the
    fix (sample-rate)."""
    import client.site as site_module

    monkeypatch.setattr(site_module, "_memory_low", lambda: False)  # all sites stay open
    summary, grid = _unequal_shards_run(tmp_path, tiny_bert)
    assert _refusing(site_module, tmp_path), "the precondition: some site would refuse"
    (only,) = summary["rounds"]
    assert not only["applied"]
    assert "set sample-rate" in only["discarded"], only["discarded"]
    assert set(grid.types) == {"train.secure_advertise"}, grid.types  # no shares, no masking
    ledgers = list((tmp_path / "run" / "sites").glob("*/privacy-ledger.jsonl"))
    assert all(not path.read_text().strip() for path in ledgers)  # nothing charged


def test_a_round_with_one_site_to_refuse_the_largest_share_goes_on_when_d_allows_it(
    tiny_bert, tmp_path, monkeypatch
):
    """The same shards with D = 1 (t = 2): the one site that refuses the largest share drops out
    at the mask stage (nothing charged), and the other two are unmasked and applied."""
    import client.site as site_module

    monkeypatch.setattr(site_module, "_memory_low", lambda: False)  # all sites stay open
    summary, _ = _unequal_shards_run(tmp_path, tiny_bert, **{"secure-max-dropouts": 1})
    refusing = _refusing(site_module, tmp_path)
    assert len(refusing) == 1, refusing  # the precondition: exactly one to leave out
    (only,) = summary["rounds"]
    assert only["applied"], only
    ledgers = {
        path.parent.name: path.read_text().strip()
        for path in (tmp_path / "run" / "sites").glob("*/privacy-ledger.jsonl")
    }
    assert not ledgers.get(refusing[0])  # it refused before any charge (no ledger entry)
    assert sum(bool(text) for text in ledgers.values()) == SITES - 1
