"""End to end: the prism-fl app on Flower's simulation engine and on real SuperLink/SuperNodes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from flower_harness import (
    flower_env,
    flwr_run,
    free_port,
    insecure_superlink,
    insecure_supernode,
    port_open,
    processes,
    wait_for,
    write_connection,
)
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModel

from client.secure import identity_key
from prism_core.accounting import PrivacyEvent, epsilon
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM
from prism_runtime.export import load_exported
from prism_runtime.identity import IDENTITY_PUBLIC
from server.checkpoint import CHECKPOINT
from server.cli import main as prism_fl
from server.demo import demo_summary, stop_local_superlinks
from server.ledger import Ledger

ROUNDS, STEPS = 2, 2
PER_PATIENT = ("hospital-a", "hospital-b")  # deployed sites whose node config says user;
# clinic-c sets nothing: a deployed site is per record


def _run_config(model: str, run_dir: Path, **extra: object) -> str:
    values = {
        "model": f"'{model}'",
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "local-steps": STEPS,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "target-epsilon": 8.0,
        "run-dir": f"'{run_dir}'",
    }
    values.update(extra)
    return " ".join(f"{k}={v}" for k, v in values.items())


def _check_outputs(run_dir: Path, model: str, sites: int, estimates: int = 0) -> None:
    """The run's files, adapter and budget; ``estimates``: private clip estimates per site."""
    for name in (
        "run-config.json",
        "ledger.sqlite",
        "report.json",
        "report.csv",
        "report.html",
        "summary.json",
    ):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["applied"] for r in summary["rounds"]] == [True] * ROUNDS
    report = json.loads((run_dir / "report.json").read_text())
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        assert len(ledger.sites()) == sites
        for row in report["sites"]:
            rows = ledger.events(site_id=row["site_id"])
            events = [e.event for e in rows]
            clip = [
                e for e, r in zip(events, rows, strict=True) if r.mechanism == QUANTILE_MECHANISM
            ]
            train = [
                e for e, r in zip(events, rows, strict=True) if r.mechanism != QUANTILE_MECHANISM
            ]
            assert len(clip) == row["quantile_charges"] == estimates
            assert sum(e.steps for e in train) == ROUNDS * STEPS == row["steps"]
            assert row["epsilon"] == pytest.approx(epsilon(events, row["delta"]), rel=1e-9)
            assert row["epsilon"] <= row["epsilon_cap"]
            sigma, q = train[0].noise_multiplier, train[0].sample_rate
            assert row["epsilon"] == pytest.approx(
                epsilon(
                    [*clip, PrivacyEvent(sigma, q, ROUNDS * STEPS, unit=train[0].unit)],
                    row["delta"],
                )
            )
    base = AutoModel.from_pretrained(model)
    adapter = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    ids = torch.tensor([[101, 2023, 2003, 2204, 102]])
    assert torch.isfinite(adapter(input_ids=ids).last_hidden_state).all()
    classifier = load_exported(run_dir / "adapter", model=model, device="cpu").model
    assert torch.isfinite(classifier(input_ids=ids).logits).all()


def test_simulation_three_sites_two_rounds(tiny_bert, tmp_path):
    """The demo's path: the built-in notes have patients and the run asks for one epsilon per
    patient; the simulated sites follow it, and the demo's summary says so."""
    home, run_dir = tmp_path / "flwr", tmp_path / "run"
    env = flower_env(home)
    try:
        result = flwr_run(
            env,
            "local",
            _run_config(tiny_bert, run_dir, **{"privacy-unit": "'user'"}),
            extra=["--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
        )
    finally:
        stop_local_superlinks(home)
    output = result.stdout[-4000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert (run_dir / "summary.json").exists(), output
    _check_outputs(run_dir, tiny_bert, sites=3)
    _check_units(run_dir, dict.fromkeys(("site-0", "site-1", "site-2"), "user"))
    printed = demo_summary(run_dir)
    assert printed.count(" per patient of cap 8.0") == 3, printed
    for site in ("site-0", "site-1", "site-2"):  # each simulated site's own ledger
        own = (run_dir / "sites" / site / "privacy-ledger.jsonl").read_text().splitlines()
        assert [json.loads(line)["unit"] for line in own] == ["user"] * ROUNDS
    assert not stop_local_superlinks(home)  # nothing left running


def _check_units(run_dir: Path, units: dict[str, str]) -> None:
    """Each site's unit in the coordinator's ledger, its report rows and the HTML page."""
    report = json.loads((run_dir / "report.json").read_text())
    assert {r["site_id"]: r["unit"] for r in report["sites"]} == units
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        for site, unit in units.items():
            assert {e.unit for e in ledger.events(site_id=site)} == {unit}
    page = (run_dir / "report.html").read_text()
    for site, unit in units.items():
        words = "epsilon per patient" if unit == "user" else "epsilon per record"
        assert f"<b>{site}</b>: {words}" in page


def test_deployment_superlink_and_three_supernodes(tiny_bert, sst2_rows, tmp_path):
    """Three deployed SuperNodes (a fresh ClientApp process per message) with a private clip
    (max-norm = auto) and a coordinator-side evaluation set: every site estimates its clip in
    round 1, charges it to its own ledger and reports it; round 2 reuses the stored estimate
    (nothing spent again); both ledgers and the report hold one estimate; `prism-fl evaluate`
    on the run folder reproduces the coordinator's last evaluation.

    One run checks both: a deployment with a fixed clip runs in the compose, resume and
    site-crash tests (a Flower deployment costs about three minutes here)."""
    held_out = tmp_path / "held-out.jsonl"  # the coordinator's own rows, no site's
    held_out.write_text("".join(json.dumps(r) + "\n" for r in sst2_rows[180:200]))
    clip = {"max-norm": "'auto'", "clip-quantile-steps": 3, "clip-quantile-noise": 0.5}
    run_dir = _deploy(
        tiny_bert, sst2_rows, tmp_path, **{"server-eval-data": f"'{held_out}'", **clip}
    )
    _check_outputs(run_dir, tiny_bert, sites=3, estimates=1)
    _check_units(run_dir, {s: "user" if s in PER_PATIENT else "record" for s in SITES})
    # prism-fl evaluate on the run folder reproduces the coordinator's last evaluation
    out = tmp_path / "evaluate.json"
    assert prism_fl(["evaluate", str(run_dir), "--data", str(held_out), "--json", str(out)]) == 0
    last = json.loads((run_dir / "summary.json").read_text())["server-eval"][str(ROUNDS)]
    mine = json.loads(out.read_text())
    assert mine["accuracy"] == pytest.approx(last["accuracy"], abs=1e-9)
    assert mine["loss"] == pytest.approx(last["loss"], rel=1e-5)
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        for site in SITES:  # each site's own durable ledger: the estimate, then each round
            own = [
                json.loads(line)
                for line in (tmp_path / "state" / site / "privacy-ledger.jsonl")
                .read_text()
                .splitlines()
            ]
            assert [(e["server_round"], e["mechanism"]) for e in own] == [
                (1, QUANTILE_MECHANISM),
                *((r, "prism-tangent-gaussian") for r in range(1, ROUNDS + 1)),
            ]
            unit = "user" if site in PER_PATIENT else "record"  # the quantile counts them too
            assert [e["unit"] for e in own] == [unit] * (ROUNDS + 1)
            coordinator = ledger.events(site_id=site)
            assert [(e.round, e.mechanism, e.sigma, e.steps) for e in coordinator] == [
                (e["server_round"], e["mechanism"], e["sigma"], e["steps"]) for e in own
            ]
            stored = json.loads((tmp_path / "state" / site / "clip-norm.json").read_text())
            assert stored["run-id"] == run_dir.name and stored["round"] == 1


SITES = ("hospital-a", "hospital-b", "clinic-c")


def test_deployment_with_secure_aggregation(tiny_bert, sst2_rows, tmp_path):
    """Three deployed SuperNodes whose identity keys are pinned in one peers folder (as the
    federation's registry would hand out): every round runs the six secure exchanges; each
    site charges the Skellam sum at H = 2 (its own min-honest-sites, below the run's 3) and
    records its share's sigma; both ledgers and the report hold both epsilons; the coordinator
    keeps no per-site update (its checkpoint holds the global arrays and its own state only)."""
    peers = tmp_path / "peers"
    peers.mkdir()
    for site in SITES:  # each site makes its identity key; the federation pins the public halves
        identity_key(tmp_path / "state" / site)
        shutil.copy(tmp_path / "state" / site / IDENTITY_PUBLIC, peers / f"{site}.pem")
    run_dir = _deploy(
        tiny_bert,
        sst2_rows,
        tmp_path,
        node_extra=f" secure-aggregation='require' min-honest-sites=2 secure-peers='{peers}'",
        **{"secure-aggregation": "true", "min-honest-sites": 3, "local-steps": 1},
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds-applied"] == ROUNDS, summary["rounds"]
    report = json.loads((run_dir / "report.json").read_text())
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        for site in SITES:
            own = [
                json.loads(line)
                for line in (tmp_path / "state" / site / "privacy-ledger.jsonl")
                .read_text()
                .splitlines()
            ]
            assert [(e["mechanism"], e["honest_sites"]) for e in own] == [
                (SKELLAM_MECHANISM, 2)
            ] * ROUNDS
            coordinator = ledger.events(site_id=site)
            assert [(e.sigma, e.honest_sites, e.share_sigma) for e in coordinator] == [
                (e["sigma"], e["honest_sites"], e["share_sigma"]) for e in own
            ]
    for row in report["sites"]:
        assert row["honest_sites"] == 2
        assert row["epsilon_collusion"] > row["epsilon"] > 0
    with safe_open(str(run_dir / CHECKPOINT), "pt") as stored:
        names = list(stored.keys())
    assert not any(site in name for name in names for site in SITES), names


def _deploy(
    tiny_bert: str, sst2_rows: list, tmp_path: Path, node_extra: str = "", **extra: object
) -> Path:
    """A SuperLink and three deployed SuperNodes on loopback; one run; its folder.
    ``node_extra``: more node config for every site."""
    home, run_dir = tmp_path / "flwr", tmp_path / "run"
    env = flower_env(home)
    port = free_port()
    write_connection(home, "loopback", f"127.0.0.1:{port}")
    with processes(env, tmp_path / "logs") as group:
        group.start(
            "superlink",
            insecure_superlink(port, tmp_path / "superlink.db"),
        )
        wait_for(lambda: port_open(port), 60, "the SuperLink port")
        for i, site in enumerate(SITES):
            data = tmp_path / f"{site}.jsonl"
            rows = [  # three notes per patient
                {**r, "patient_id": f"{site}-{j // 3}"}
                for j, r in enumerate(sst2_rows[i * 60 : (i + 1) * 60])
            ]
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            node_config = (
                f"site-id='{site}' data-path='{data}' state-dir='{tmp_path / 'state' / site}' "
                "epsilon-cap=8.0 delta=1e-5"  # a deployed site states its own policy
            )
            if site in PER_PATIENT:  # its own policy: one epsilon per patient
                node_config += " privacy-unit='user' user-field='patient_id'"
            node_config += node_extra
            group.start(
                site,
                insecure_supernode(port, node_config),
            )
        config = _run_config(tiny_bert, run_dir, **{"min-sites": 3, **extra})
        result = flwr_run(env, "loopback", config)
        logs = "\n".join(group.log(n)[-2000:] for n in ("superlink", "hospital-a"))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:] + logs
        wait_for(lambda: (run_dir / "summary.json").exists(), 120, "the run's summary")
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        assert sorted(ledger.sites()) == sorted(SITES)
    return run_dir
