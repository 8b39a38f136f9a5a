"""The coordinator side of "the site owns its privacy", through ``PrismStrategy.aggregate_train``
with real Flower messages and a real SQLite ledger, and the budget report built from it:

- a site that fails after charging itself (error reply) or times out is charged UNCONFIRMED at
  its last confirmed parameters, and the report counts it in a worst-case epsilon and says so;
  a node never seen before is charged with unknown parameters (epsilon unknown);
- a resent stored reply confirms an unconfirmed charge without counting it twice;
- a conflicting ledger record rejects one reply (``ledger-conflict``), never the round, and a
  resumed run goes on;
- an error reply's ``Error.reason`` (free text) is never logged or stored: its code is shown
  with that code's fixed text;
- facts that do not match the configuration (steps, mechanism, sampling, adjacency, rng, sigma,
  delta, refusal reason) are rejected and charged unconfirmed;
- a site that ran with reproducible randomness is marked "not private against the coordinator".
"""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
from conftest import random_point
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict
from reply_facts import honest_facts
from sitegrid import LoopbackSites
from strategy_helpers import strategy_for

from prism_core.accounting import PrivacyEvent, epsilon
from prism_runtime.protocol import (
    ACCOUNTING,
    CONFIG,
    REFUSAL_REASONS,
    SITE_ERROR_CODES,
    UPDATE,
    key,
)
from server.checkpoint import Checkpoint, save_checkpoint
from server.cli import main
from server.ledger import Ledger
from server.report import (
    MARK_EPSILON_UNKNOWN,
    MARK_NOT_PRIVATE,
    MARK_UNCONFIRMED,
    build_report,
    format_round_table,
    round_rows,
)
from server.report_files import write_reports

pytestmark = pytest.mark.usefixtures("flower_identity")

MODULE = "layer.0.q"
M, N, R = 10, 8, 2
NODES = [11, 12, 13]
TAU, SIGMA, Q, DELTA = 2, 1.0, 0.05, 1e-5
SECRET = "patient 4711: HbA1c 9.3%"


class _Grid(LoopbackSites):
    def __init__(self, nodes=NODES, answer=None):
        self.nodes, self.site = list(nodes), answer

    def get_node_ids(self):
        return list(self.nodes)

    def answer(self, msg):
        return self.site(msg)


def _global():
    A, B = random_point(M, N, R, 0, dtype=torch.float32)
    return {key(MODULE, "A"): A, key(MODULE, "B"): B}


def _strategy(ledger, **kw):
    params = dict(sites_per_round=len(NODES), local_steps=TAU, target_epsilon=100.0, delta=DELTA)
    params.update(kw)
    return strategy_for(modules=[MODULE], ledger=ledger, **params)


def _site(node):
    return f"site-{node}"


def _facts(node, request, **changes):
    """An honest reply's facts, with ``changes`` (None: leave the fact out)."""
    config = request.content[CONFIG]
    return honest_facts(
        _site(node), config, **{"sigma": SIGMA, "q": Q, "steps": TAU, "delta": DELTA, **changes}
    )


def _reply(request, **changes):
    node = request.metadata.dst_node_id
    update = {
        key(MODULE, "dA"): torch.full((M, R), 1e-3),
        key(MODULE, "dB"): torch.full((N, R), -1e-3),
    }
    content = RecordDict(
        {
            UPDATE: ArrayRecord(update),
            ACCOUNTING: ConfigRecord(_facts(node, request, **changes)),
        }
    )
    return Message(content=content, reply_to=request)


def _error(request, code, reason=f"Traceback: ValueError({SECRET!r})"):
    return Message(Error(code=code, reason=reason), reply_to=request)


def _ask(strategy, server_round, arrays=None):
    arrays = _global() if arrays is None else arrays
    requests = strategy.configure_train(server_round, ArrayRecord(arrays), ConfigRecord(), _Grid())
    return {r.metadata.dst_node_id: r for r in requests}


def _honest_round(strategy, server_round):
    requests = _ask(strategy, server_round)
    new, metrics = strategy.aggregate_train(server_round, [_reply(r) for r in requests.values()])
    assert metrics["sites-accepted"] == len(NODES) and new is not None
    return requests


def _eps(steps, sigma=SIGMA):
    return epsilon([PrivacyEvent(sigma, Q, steps)], DELTA)


def _rows(report):
    return {r["site_id"]: r for r in report["sites"]}


# --------------------------------------------------------------------------------------------
# Item 8: error replies and time-outs reach the ledger and the report
# --------------------------------------------------------------------------------------------


def test_a_failed_and_a_silent_site_are_charged_unconfirmed_and_reported_worst_case(
    tmp_path, capsys
):
    ledger = Ledger.open(tmp_path / "ledger.sqlite")
    strategy = _strategy(ledger)
    _honest_round(strategy, 1)
    requests = _ask(strategy, 2)
    # site-12 charged itself, then failed (error reply); site-13 never answers (time-out)
    replies = [_reply(requests[11]), _error(requests[12], 4003)]
    new, metrics = strategy.aggregate_train(2, replies)
    assert new is not None and metrics["sites-accepted"] == 1
    assert metrics["sites-unconfirmed"] == 2 and metrics["rejected-no-reply"] == 1
    summary = strategy.summaries[-1]
    assert summary.unconfirmed == ["site-12", "site-13"]
    assert ("site-13", "no reply before the round timeout") in summary.rejected

    for site, code in (("site-12", "error-reply-4003"), ("site-13", "no-reply")):
        last = ledger.records(site)[-1]
        assert (last.round, last.confirmed, last.code, last.steps) == (2, False, code, TAU)
        # at the site's last confirmed parameters (round 1's facts)
        assert (last.sigma, last.q, last.delta, last.rng) == (SIGMA, Q, DELTA, "os-csprng")
        assert last.params_known and last.epsilon_cap == 100.0
        assert ledger.epsilon(site).prv == pytest.approx(_eps(2 * TAU), rel=1e-12)
    assert ledger.epsilon("site-11").prv == pytest.approx(_eps(2 * TAU), rel=1e-12)

    report = build_report(ledger)
    rows = _rows(report)
    for site in ("site-12", "site-13"):
        row = rows[site]
        assert row["epsilon"] == pytest.approx(_eps(2 * TAU), rel=1e-12)  # counted: worst case
        assert row["epsilon"] > _eps(TAU) + 1e-3  # what the confirmed rounds alone give
        assert (row["unconfirmed_rounds"], row["unconfirmed_steps"]) == (1, TAU)
        assert row["epsilon_known"] and f"1 {MARK_UNCONFIRMED}" in row["marks"]
        assert "unconfirmed charge" in row["note"] and "worst case" in row["note"]
    assert rows["site-12"]["unconfirmed_codes"] == ["error-reply-4003"]
    assert rows["site-11"]["unconfirmed_rounds"] == 0 and rows["site-11"]["marks"] == []
    assert report["unconfirmed_charges"] == 2

    paths = write_reports(report, tmp_path / "report")
    with paths["csv"].open(newline="") as f:
        table = {r["site_id"]: r for r in csv.DictReader(f)}
    assert (
        table["site-12"]["unconfirmed_rounds"] == "1"
        and MARK_UNCONFIRMED in (table["site-12"]["marks"])
    )
    assert table["site-11"]["unconfirmed_rounds"] == "0"
    loaded = json.loads(paths["json"].read_text())
    assert _rows(loaded)["site-13"]["unconfirmed_rounds"] == 1
    page = paths["html"].read_text()
    assert "2 unconfirmed charge(s)" in page and MARK_UNCONFIRMED in page

    for table_text in (
        format_round_table(report["sites"]),
        format_round_table(round_rows(ledger, strategy.exhausted)),  # the per-round log table
    ):
        line = next(x for x in table_text.splitlines() if x.startswith("site-12"))
        assert line.split()[4] == "1" and MARK_UNCONFIRMED in line
        assert "worst case" in table_text.splitlines()[-1]
    assert main(["report", "--ledger", str(ledger.path), "--out", str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out
    assert f"1 {MARK_UNCONFIRMED}" in printed
    ledger.close()


def test_a_node_never_seen_that_fails_is_charged_with_an_unknown_epsilon(tmp_path, capsys):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        requests = _ask(strategy, 1)
        replies = [_reply(requests[11]), _error(requests[12], 4001)]  # 13: silent
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 1 and metrics["sites-unconfirmed"] == 2
        for node, code in ((12, "error-reply-4001"), (13, "no-reply")):
            (event,) = ledger.events(f"node-{node}")  # its site id is not known
            assert (event.confirmed, event.params_known, event.code) == (False, False, code)
            assert ledger.epsilon(f"node-{node}").prv == float("inf")
        report = build_report(ledger)
        rows = _rows(report)
        assert report["epsilon_unknown"] == ["node-12", "node-13"]
        assert (
            not rows["node-12"]["epsilon_known"]
            and MARK_EPSILON_UNKNOWN in rows["node-12"]["marks"]
        )
        assert rows["site-11"]["epsilon_known"]
        text = format_round_table(report["sites"])
        line = next(x for x in text.splitlines() if x.startswith("node-12"))
        assert line.split()[1] == "unknown" and MARK_EPSILON_UNKNOWN in line
        html = write_reports(report, tmp_path / "r")["html"].read_text()
        assert "Epsilon unknown (worst case) for node-12, node-13" in html
        # the next round, node 12 answers as site-12: its site is bound, its charges its own
        requests = _ask(strategy, 2)
        _, metrics = strategy.aggregate_train(2, [_reply(r) for r in requests.values()])
        assert metrics["sites-accepted"] == 3 and ledger.events("site-12")[0].confirmed


def test_a_resent_stored_reply_confirms_an_unconfirmed_charge_without_double_counting(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        _honest_round(strategy, 1)
        state = json.loads(json.dumps(strategy.state_dict()))  # the checkpoint after round 1
        requests = _ask(strategy, 2)
        strategy.aggregate_train(2, [_reply(requests[11]), _error(requests[12], 4002)])
        assert [e.confirmed for e in ledger.events("site-12")] == [True, False]
        # the coordinator restarts from round 1's checkpoint and asks round 2 again; every site
        # resends its stored reply (the same facts, this round's nonce)
        resumed = _strategy(ledger)
        resumed.load_state_dict(state)
        requests = _ask(resumed, 2)
        _, metrics = resumed.aggregate_train(2, [_reply(r) for r in requests.values()])
        assert metrics["sites-accepted"] == 3 and metrics["sites-unconfirmed"] == 0
        for site in ("site-11", "site-12", "site-13"):
            events = ledger.events(site)
            assert [(e.round, e.confirmed) for e in events] == [(1, True), (2, True)]
            assert ledger.epsilon(site).prv == pytest.approx(_eps(2 * TAU), rel=1e-12)
        assert len(ledger.records("site-12")) == 3  # the superseded charge stays on record
        assert len(ledger.records("site-11")) == 2  # its identical re-sent reply: a no-op
        assert len(ledger.records("site-13")) == 3  # it had timed out in the first attempt
        # a third attempt where site-13 times out adds nothing: its round 2 is confirmed
        again = _strategy(ledger)
        again.load_state_dict(state)
        requests = _ask(again, 2)
        _, metrics = again.aggregate_train(2, [_reply(requests[11]), _reply(requests[12])])
        assert len(ledger.records("site-13")) == 3 and metrics["sites-unconfirmed"] == 0
        assert [e.confirmed for e in ledger.events("site-13")] == [True, True]
        report = build_report(ledger)
        assert report["unconfirmed_charges"] == 0
        assert all(r["marks"] == [] for r in report["sites"])


# --------------------------------------------------------------------------------------------
# Item 9: a conflicting ledger record is a rejected reply, never a crash loop
# --------------------------------------------------------------------------------------------


def test_a_conflicting_record_rejects_the_reply_the_round_completes_and_resume_goes_on(
    tmp_path,
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        _honest_round(strategy, 1)
        state = json.loads(json.dumps(strategy.state_dict()))
        glob = _global()
        # round 2 is charged, then the coordinator dies before its checkpoint
        requests = _ask(strategy, 2, glob)
        strategy.aggregate_train(2, [_reply(r) for r in requests.values()])
        # on resume, site-12 lost its stored reply and answers round 2 with other facts
        resumed = _strategy(ledger)
        resumed.load_state_dict(state)

        def answer(msg):
            node = msg.metadata.dst_node_id
            return _reply(msg, sigma=1.5) if node == 12 else _reply(msg)

        checkpoints = []
        result = resumed.start(
            _Grid(answer=answer),
            ArrayRecord(glob),
            num_rounds=3,
            first_round=2,
            on_round_end=lambda rnd, arrays, summary, res: checkpoints.append(
                (rnd, resumed.state_dict())
            ),
        )
        assert [rnd for rnd, _ in checkpoints] == [2, 3]  # the run went on past round 2
        round2 = dict(result.train_metrics_clientapp[2])
        assert round2["rejected-ledger-conflict"] == 1 and round2["sites-accepted"] == 2
        assert round2["applied"] == 1 and round2["sites-unconfirmed"] == 0
        ((who, why),) = next(s for s in resumed.summaries if s.server_round == 2).rejected
        assert who == "site-12" and "different record" in why
        stored = [e for e in ledger.events("site-12") if e.round == 2]
        assert [(e.sigma, e.confirmed) for e in stored] == [(SIGMA, True)]  # the first kept
        round3 = dict(result.train_metrics_clientapp[3])
        assert round3["sites-accepted"] == 3 and round3["replies-rejected"] == 0
        # resuming from round 2's checkpoint replays round 3 cleanly too
        again = _strategy(ledger)
        again.load_state_dict(json.loads(json.dumps(checkpoints[0][1])))
        result = again.start(_Grid(answer=answer), ArrayRecord(glob), num_rounds=3, first_round=3)
        assert dict(result.train_metrics_clientapp[3])["sites-accepted"] == 3


# --------------------------------------------------------------------------------------------
# Error replies: code and fixed text only
# --------------------------------------------------------------------------------------------


def test_an_error_reason_is_never_logged_or_stored(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = Ledger.open(run_dir / "ledger.sqlite")
    strategy = _strategy(ledger)
    _honest_round(strategy, 1)
    requests = _ask(strategy, 2)
    replies = [
        _error(requests[11], 4003),  # a site error code
        _error(requests[12], 2, reason=f"Exception: {SECRET}\n  File ..."),  # Flower's own
        _error(requests[13], 9999, reason=SECRET),  # an unknown code
    ]
    with caplog.at_level(logging.DEBUG):
        strategy.aggregate_train(2, replies)
        requests = _ask(strategy, 3)
        refusal = _reply(requests[11], status="refused", steps=0, reason=SECRET)
        strategy.aggregate_train(3, [refusal])
    texts = dict(strategy.summaries[1].rejected)
    assert texts["site-11"] == f"error reply 4003: {SITE_ERROR_CODES[4003]}"
    assert texts["site-12"].startswith("error reply 2: Flower error CLIENT_APP_RAISED_EXCEPTION")
    assert texts["site-13"] == "error reply 9999: unknown site error code 9999"
    assert {e.code for e in ledger.records() if not e.confirmed} >= {
        "error-reply-4003",
        "error-reply-2",
        "error-reply-9999",
        "refusal-reason",
    }

    summary = json.dumps({"rounds": [vars(s) for s in strategy.summaries]}, default=str)
    (run_dir / "summary.json").write_text(summary)
    save_checkpoint(
        run_dir,
        Checkpoint(
            server_round=3,
            arrays=_global(),
            run_config={},
            strategy=strategy.state_dict(),
            server_optimizer={},
        ),
    )
    write_reports(build_report(ledger), run_dir)
    ledger.close()
    assert "error reply 4003" in caplog.text  # the rejections were logged, by code
    assert SECRET not in caplog.text
    assert SECRET.encode() not in b"".join(p.read_bytes() for p in run_dir.iterdir())
    assert {p.name for p in run_dir.iterdir()} >= {
        "summary.json",
        "checkpoint.safetensors",
        "ledger.sqlite",
        "report.json",
    }


# --------------------------------------------------------------------------------------------
# Facts cross-check
# --------------------------------------------------------------------------------------------

MISMATCHES = [
    ({"steps": 3}, "facts-mismatch"),
    ({"steps": 1}, "facts-mismatch"),
    ({"mechanism": "factor-gaussian"}, "facts-mismatch"),
    ({"mechanism": None}, "facts-mismatch"),
    ({"sampling": "shuffle"}, "facts-mismatch"),
    ({"adjacency": "replace-one"}, "facts-mismatch"),
    ({"rng": "seeded"}, "facts-mismatch"),
    ({"rng": None}, "facts-mismatch"),
    ({"sigma": 0.0}, "facts-mismatch"),
    ({"delta": 1e-4}, "facts-mismatch"),
    ({"delta": None}, "facts-mismatch"),
    ({"status": "refused", "steps": 0, "reason": "cap reached"}, "refusal-reason"),
    ({"status": "refused", "steps": 0, "reason": ""}, "refusal-reason"),
    ({"status": "refused", "steps": TAU, "reason": "cap-exhausted"}, "facts-mismatch"),
]


@pytest.mark.parametrize(("changes", "code"), MISMATCHES, ids=[str(c) for c, _ in MISMATCHES])
def test_facts_that_do_not_match_the_configuration_are_rejected_and_charged_unconfirmed(
    tmp_path, changes, code
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        _honest_round(strategy, 1)
        requests = _ask(strategy, 2)
        replies = [_reply(requests[11]), _reply(requests[12], **changes), _reply(requests[13])]
        new, metrics = strategy.aggregate_train(2, replies)
        assert new is not None and metrics["sites-accepted"] == 2
        assert metrics[f"rejected-{code}"] == 1 and metrics["replies-rejected"] == 1
        assert strategy.summaries[-1].rejected[0][0] == "site-12"
        last = ledger.records("site-12")[-1]
        steps = max(TAU, changes.get("steps", TAU))
        assert (last.round, last.confirmed, last.code, last.steps) == (2, False, code, steps)
        assert (last.sigma, last.q, last.rng) == (SIGMA, Q, "os-csprng")  # last confirmed
        assert "site-12" not in strategy.summaries[-1].refused


def test_valid_refusals_and_a_non_dp_run_pass_the_cross_check(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        _honest_round(strategy, 1)
        requests = _ask(strategy, 2)
        reason = sorted(REFUSAL_REASONS)[0]
        refusal = _reply(requests[12], status="refused", steps=0, reason=reason)
        _, metrics = strategy.aggregate_train(
            2, [_reply(requests[11]), refusal, _reply(requests[13])]
        )
        summary = strategy.summaries[-1]
        assert (metrics["sites-refused"], metrics["replies-rejected"]) == (1, 0)
        assert summary.refusal_codes == {"site-12": reason} and summary.unconfirmed == []
        assert [e.round for e in ledger.records("site-12")] == [1]  # a refusal charges nothing
    with Ledger.open(tmp_path / "nondp.sqlite") as ledger:
        strategy = _strategy(ledger, mode="factor-average", mechanism="none", dp=False)
        requests = _ask(strategy, 1)
        replies = [_reply(r, mechanism="none", sigma=0.0).content for r in requests.values()]
        for content in replies:  # a factor-average reply carries end factors, not tangents
            content[UPDATE] = ArrayRecord(_global())
        _, metrics = strategy.aggregate_train(
            1,
            [Message(c, reply_to=r) for c, r in zip(replies, requests.values(), strict=True)],
        )
        assert metrics["sites-accepted"] == 3


# --------------------------------------------------------------------------------------------
# Reproducible randomness: not private against the coordinator
# --------------------------------------------------------------------------------------------


def test_a_reproducible_rng_site_is_marked_not_private_against_the_coordinator(tmp_path, capsys):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = _strategy(ledger)
        requests = _ask(strategy, 1)
        replies = [
            _reply(r, rng="reproducible" if n == 12 else "os-csprng") for n, r in requests.items()
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 3  # allowed, and reported
        assert [e.rng for e in ledger.events("site-12")] == ["reproducible"]
        report = build_report(ledger)
        rows = _rows(report)
        assert rows["site-12"]["private_against_coordinator"] is False
        assert rows["site-12"]["rng"] == ["reproducible"]
        assert MARK_NOT_PRIVATE in rows["site-12"]["marks"]
        assert "NOT private against the coordinator" in rows["site-12"]["note"]
        assert rows["site-11"]["private_against_coordinator"] is True
        assert rows["site-11"]["marks"] == []
        assert report["not_private_against_coordinator"] == {
            "sites": ["site-12"],
            "runs": ["run-1"],
        }
        paths = write_reports(report, tmp_path / "report")
        with paths["csv"].open(newline="") as f:
            table = {r["site_id"]: r for r in csv.DictReader(f)}
        assert table["site-12"]["private_against_coordinator"] == "False"
        assert MARK_NOT_PRIVATE in table["site-12"]["marks"]
        assert table["site-11"]["private_against_coordinator"] == "True"
        html = paths["html"].read_text()
        assert "NOT PRIVATE AGAINST THE COORDINATOR: site-12 (runs run-1)" in html
        for text in (
            format_round_table(report["sites"]),
            format_round_table(round_rows(ledger)),
        ):
            line = next(x for x in text.splitlines() if x.startswith("site-12"))
            assert MARK_NOT_PRIVATE in line
            assert "not private against the coordinator" in text.splitlines()[-1]
            assert MARK_NOT_PRIVATE not in next(
                x for x in text.splitlines() if x.startswith("site-11")
            )
        assert main(["report", "--ledger", str(ledger.path), "--out", str(tmp_path / "c")]) == 0
        assert MARK_NOT_PRIVATE in capsys.readouterr().out
