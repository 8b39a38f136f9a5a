"""Budget reports (JSON, CSV, HTML) and the ``prism-fl report`` command."""

from __future__ import annotations

import base64
import csv
import json
import math
import re
from pathlib import Path

import pytest
from ledger.sample_events import epsilon_by_round
from ledger_events import ledger_event
from strategy import three_sites

from prism_core.accounting import PRV_EPS_ERROR, PrivacyEvent, epsilon, replace_one
from server.cli import main
from server.ledger import Ledger, LedgerEvent
from server.report import (
    MARK_NOT_PRIVATE,
    build_report,
    format_round_table,
    projected_rounds_left,
    round_rows,
)
from server.report_files import write_reports

DELTA = 1e-5
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ev(rnd: int, site: str, **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id="run-1", round=rnd, site_id=site, sigma=1.0, q=0.01, steps=20, delta=DELTA
    )
    args.update(kw)
    return ledger_event(**args)


def brute_force_rounds(history: list[PrivacyEvent], *, steps: int, cap: float) -> int:
    """Count further rounds one at a time until the next would pass the cap."""
    k = 0
    while epsilon([*history, PrivacyEvent(1.0, 0.01, (k + 1) * steps)], DELTA) <= cap:
        k += 1
    return k


# eps of (sigma=1, q=0.01) after 20 * k steps, used to place caps between whole rounds
def eps_after(rounds: int, steps: int = 20) -> float:
    return epsilon([PrivacyEvent(1.0, 0.01, rounds * steps)], DELTA)


@pytest.fixture(scope="module")
def ledger_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three sites: 'a' with room for 3 more rounds, 'b' exhausted, 'c' uncapped and changing
    sigma, 'z' noiseless (epsilon inf)."""
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"
    cap_a = (eps_after(5) + eps_after(6)) / 2  # 2 rounds done, 3 more fit, the 4th does not
    with Ledger.open(path) as led:
        led.record_run("run-1", {"rounds": 2})
        for r in range(2):
            led.append_many(
                [
                    ev(r, "a", epsilon_cap=cap_a),
                    ev(r, "b", epsilon_cap=eps_after(2) - 0.01),
                    ev(r, "c", sigma=1.0 + r),
                ]
            )
        led.append(ev(0, "z", sigma=0.0, epsilon_cap=1.0))
    return path


@pytest.fixture(scope="module")
def report(ledger_path: Path) -> dict[str, object]:
    with Ledger.open(ledger_path, read_only=True) as led:
        return build_report(led)


def rows(report: dict[str, object]) -> dict[str, dict[str, object]]:
    return {r["site_id"]: r for r in report["sites"]}  # type: ignore[attr-defined, index]


def test_report_numbers_match_the_ledger(ledger_path: Path, report: dict[str, object]) -> None:
    by_site = rows(report)
    assert list(by_site) == ["a", "b", "c", "z"]
    with Ledger.open(ledger_path, read_only=True) as led:
        for site in ("a", "b", "c"):
            eps = led.epsilon(site)
            assert by_site[site]["epsilon"] == pytest.approx(eps.prv, rel=1e-12)
            assert by_site[site]["epsilon_rdp"] == pytest.approx(eps.rdp, rel=1e-12)
            series = report["series"][site]  # type: ignore[index]
            assert [(p["round"], p["epsilon"]) for p in series] == epsilon_by_round(led, site)
    a, b, c, z = (by_site[s] for s in "abcz")
    assert (a["rounds"], a["steps"], a["sigma"], a["q"], a["delta"]) == (2, 40, 1.0, 0.01, DELTA)
    assert (a["status"], b["status"], c["status"], z["status"]) == (
        "active",
        "exhausted",
        "active",
        "exhausted",
    )
    assert c["sigma"] == 2.0 and c["sigma_values"] == [1.0, 2.0] and c["q_values"] == [0.01]
    assert c["epsilon_cap"] is None and c["projected_rounds_left"] is None
    assert b["projected_rounds_left"] == 0
    assert z["epsilon"] == math.inf and z["projected_rounds_left"] == 0
    assert report["run_ids"] == ["run-1"]
    assert report["accountant"]["epsilon"] == "prv"  # type: ignore[index]
    assert report["accountant"]["cross_check"] == "rdp"  # type: ignore[index]


def test_projected_rounds_left_matches_brute_force(report: dict[str, object]) -> None:
    history = [PrivacyEvent(1.0, 0.01, 40)]
    cap = rows(report)["a"]["epsilon_cap"]
    assert isinstance(cap, float)
    expected = brute_force_rounds(history, steps=20, cap=cap)
    assert expected == 3  # by construction of the cap
    assert rows(report)["a"]["projected_rounds_left"] == expected
    # a different round size: 50 steps per round
    got, capped = projected_rounds_left(
        history, sigma=1.0, q=0.01, steps_per_round=50, epsilon_cap=cap, delta=DELTA
    )
    assert (got, capped) == (brute_force_rounds(history, steps=50, cap=cap), False)
    # past the horizon the count stops and says so
    got, capped = projected_rounds_left(
        history, sigma=1.0, q=0.01, steps_per_round=20, epsilon_cap=cap, delta=DELTA,
        horizon_rounds=2,
    )  # fmt: skip
    assert (got, capped) == (2, True)


def test_planned_steps_per_round(ledger_path: Path) -> None:
    with Ledger.open(ledger_path, read_only=True) as led:
        planned = rows(build_report(led, planned_steps_per_round=30))["a"]
    cap = planned["epsilon_cap"]
    assert isinstance(cap, float)
    assert planned["steps_per_round"] == 30
    assert planned["projected_rounds_left"] == brute_force_rounds(
        [PrivacyEvent(1.0, 0.01, 40)], steps=30, cap=cap
    )


def test_write_reports(tmp_path: Path, report: dict[str, object]) -> None:
    paths = write_reports(report, tmp_path / "out")
    assert {k: p.name for k, p in paths.items()} == {
        "json": "report.json",
        "csv": "report.csv",
        "html": "report.html",
    }
    by_site = rows(report)

    loaded = json.loads(paths["json"].read_text(), parse_constant=pytest.fail)
    for row in loaded["sites"]:
        want = by_site[row["site_id"]]["epsilon"]
        assert row["epsilon"] == ("inf" if want == math.inf else want)
    assert loaded["series"]["a"][-1]["epsilon"] == by_site["a"]["epsilon"]

    with paths["csv"].open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["site_id"] for r in table] == ["a", "b", "c", "z"]
    for r in table[:3]:
        assert float(r["epsilon"]) == by_site[r["site_id"]]["epsilon"]
        assert r["status"] == by_site[r["site_id"]]["status"]
    assert table[2]["sigma_values"] == "1.0;2.0" and table[2]["epsilon_cap"] == ""

    page = paths["html"].read_text()
    assert not re.search(r"https?://", page)
    assert "<script" not in page and "<link" not in page
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 1 and base64.b64decode(images[0]).startswith(PNG_MAGIC)
    assert f"{by_site['a']['epsilon']:.3f}" in page and "exhausted" in page


def test_format_round_table(report: dict[str, object]) -> None:
    text = format_round_table(report["sites"])  # type: ignore[arg-type]
    lines = text.splitlines()
    assert lines[0].split() == ["site", "epsilon", "per", "cap", "status", "unconfirmed", "marks"]
    assert len(lines) == 5 and len({len(line.rstrip()) for line in lines[1:4]}) <= 2
    a = rows(report)["a"]
    assert lines[1].split() == [
        "a",
        f"{a['epsilon']:.3f}",
        "record",
        f"{a['epsilon_cap']:.3f}",
        "active",
        "0",  # no unconfirmed charge, no mark
    ]
    assert lines[3].split()[3] == "-"  # no cap
    assert lines[4].split()[1] == "inf"


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    with Ledger.open(ledger_path) as led:
        led.append_many([ev(0, "a"), ev(1, "a", steps=30)])
        eps = led.epsilon("a").prv
    before = ledger_path.read_bytes()
    out = tmp_path / "reports"
    assert main(["report", "--ledger", str(ledger_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("report.json", "report.csv", "report.html"):
        assert (out / name).is_file() and str(out / name) in printed
    assert f"{eps:.3f}" in printed  # the round table
    assert json.loads((out / "report.json").read_text())["sites"][0]["epsilon"] == eps
    assert ledger_path.read_bytes() == before  # the report never writes the ledger


@pytest.mark.parametrize("content", [b"not a ledger\n", b""])
def test_cli_refuses_a_foreign_file(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.db"
    path.write_bytes(content)
    out = tmp_path / "reports"
    assert main(["report", "--ledger", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not a prism-fl ledger" in err
    assert not out.exists() and path.read_bytes() == content


def test_cli_missing_ledger_and_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.sqlite"
    assert main(["report", "--ledger", str(missing), "--out", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err and not missing.exists()
    with pytest.raises(SystemExit) as info:
        main(["report", "--ledger", "x", "--out", "y", "--planned-steps-per-round", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_round_rows_give_the_reports_epsilon_and_cap_and_the_strategys_status(
    ledger_path: Path, report: dict[str, object]
) -> None:
    by_site = rows(report)
    with Ledger.open(ledger_path, read_only=True) as led:
        light = round_rows(led, exhausted={"b", "z"})
    assert [r["site_id"] for r in light] == ["a", "b", "c", "z"]
    for r in light:
        full = by_site[r["site_id"]]
        assert r["epsilon"] == pytest.approx(full["epsilon"], rel=1e-12)  # inf == inf for z
        assert r["epsilon_cap"] == full["epsilon_cap"]
        assert r["status"] == ("exhausted" if r["site_id"] in "bz" else "active")
    assert format_round_table(light).splitlines()[1].split()[:2] == [
        "a",
        f"{by_site['a']['epsilon']:.3f}",
    ]


def test_the_report_states_the_guarantee_against_the_coordinator(report, ledger_path, tmp_path):
    """Every reply states q = b / N: the report says the guarantee against the coordinator is
    replace-one with N public and gives it per site, accounted directly by the replace-one PLD
    (``prism_core.accounting.replace_one``) at the site's delta for these Gaussian histories:
    below group privacy's 2 epsilon, and saying which was used."""
    assert report["guarantee"]["against_coordinator"] == "replace-one, shard size public"
    with Ledger.open(ledger_path, read_only=True) as led:
        histories = {s: [e.event for e in led.events(site_id=s)] for s in led.sites()}
    for row in report["sites"]:
        eps = row["epsilon"]
        if math.isfinite(eps):
            direct = replace_one(histories[row["site_id"]], row["delta"])
            assert row["replace_one_method"] == "pld"
            assert row["epsilon_replace_one"] == pytest.approx(direct.epsilon, rel=1e-12)
            assert row["delta_replace_one"] == row["delta"]
            assert eps - PRV_EPS_ERROR <= row["epsilon_replace_one"] < 2 * eps / 1.15
        else:
            assert row["epsilon_replace_one"] == math.inf
            assert row["delta_replace_one"] == 1.0
    paths = write_reports(report, tmp_path)
    html = paths["html"].read_text(encoding="utf-8")
    assert "replace-one with N public" in html and "(replace-one PLD)" in html
    with paths["csv"].open(encoding="utf-8") as f:
        header = next(csv.reader(f))
    assert {"epsilon_replace_one", "delta_replace_one", "replace_one_method"} <= set(header)


# -- through the strategy: reproducible randomness ---------------------------------------------


@pytest.mark.usefixtures("flower_identity")
def test_a_reproducible_rng_site_is_marked_not_private_against_the_coordinator(tmp_path, capsys):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        requests = three_sites.ask(strategy, 1)
        replies = [
            three_sites.reply(r, rng="reproducible" if n == 12 else "os-csprng")
            for n, r in requests.items()
        ]
        _, metrics = strategy.aggregate_train(1, replies)
        assert metrics["sites-accepted"] == 3  # allowed, and reported
        assert [e.rng for e in ledger.events("site-12")] == ["reproducible"]
        report = build_report(ledger)
        rows = three_sites.rows(report)
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


def test_a_site_switched_to_per_patient_is_reported_per_patient_with_its_conversion(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append_many([ev(r, "h", unit="record", epsilon_cap=8.0) for r in range(2)])
        led.append_many([ev(r, "h", unit="user", epsilon_cap=8.0) for r in range(2, 5)])
    with Ledger.open(path, read_only=True) as led:
        full = build_report(led)
        (row,) = full["sites"]
        (light,) = round_rows(led)
    assert full["guarantee"]["unit"] == "user"
    assert full["guarantee"]["text"].startswith("epsilon per patient (")
    per_patient = epsilon([PrivacyEvent(1.0, 0.01, 60, unit="user")], DELTA)
    assert row["unit"] == light["unit"] == "user"
    assert row["epsilon"] == pytest.approx(per_patient, rel=1e-12)
    assert light["epsilon"] == pytest.approx(per_patient, rel=1e-12)
    assert row["status"] == "active"
    assert "group privacy" in row["note"] and "40 earlier per-record steps" in row["note"]
    assert format_round_table([light]).splitlines()[1].split()[2] == "patient"


# -- secure aggregation: the charged epsilon and the epsilon if the other sites collude --------


def test_a_secure_site_is_reported_with_both_epsilons_and_the_honest_sites_it_counts_on(tmp_path):
    """A site with secure-aggregation (Skellam) events: its ``epsilon`` is the charged one, its
    ``epsilon_collusion`` is ``collusion_epsilon`` of its history (at least the charged one),
    ``honest_sites`` the smallest H of its rounds; the guarantee text, the note, report.json,
    report.csv, the HTML, the round table and ``round_rows`` say so. A site without secure
    aggregation has neither (None, an empty cell, "-")."""
    from prism_core.accounting import collusion_epsilon
    from prism_core.records import SKELLAM_MECHANISM

    def secure(rnd: int, honest: int, share: float) -> LedgerEvent:
        return ev(
            rnd, "s", mechanism=SKELLAM_MECHANISM, honest_sites=honest, share_sigma=share,
            epsilon_cap=50.0,
        )  # fmt: skip

    path = tmp_path / "ledger.sqlite"
    with Ledger.open(path) as led:
        led.append_many([secure(0, 4, 0.5), secure(1, 3, 0.5), ev(0, "p"), ev(1, "p")])
    with Ledger.open(path, read_only=True) as led:
        report = build_report(led)
        light = {r["site_id"]: r for r in round_rows(led)}
        history = [e.event for e in led.events("s")]
    s, p = rows(report)["s"], rows(report)["p"]
    expected = collusion_epsilon(history, DELTA)
    assert s["epsilon"] == pytest.approx(epsilon(history, DELTA), rel=1e-12)
    assert s["epsilon_collusion"] == pytest.approx(expected, rel=1e-12)
    assert math.isfinite(s["epsilon_collusion"]) and s["epsilon_collusion"] > s["epsilon"] > 0
    assert s["honest_sites"] == 3  # the smaller of its rounds' 4 and 3
    assert (p["epsilon_collusion"], p["honest_sites"]) == (None, None)
    assert light["s"]["epsilon_collusion"] == pytest.approx(expected, rel=1e-12)
    assert (light["s"]["honest_sites"], light["p"]["epsilon_collusion"]) == (3, None)
    assert "holds if at least 3 sites are honest" in s["note"]
    assert f"epsilon {s['epsilon_collusion']:.3f} (epsilon_collusion" in s["note"]
    assert "secure aggregation" not in p["note"]
    guarantee = report["guarantee"]
    assert guarantee["honest_sites"] == {"s": 3}
    assert "Under secure aggregation (s: at least 3 honest sites)" in guarantee["text"]
    assert "epsilon_collusion" in guarantee["text"]

    paths = write_reports(report, tmp_path / "report")
    loaded = rows(json.loads(paths["json"].read_text(), parse_constant=pytest.fail))
    assert loaded["s"]["epsilon_collusion"] == s["epsilon_collusion"]
    assert (loaded["p"]["epsilon_collusion"], loaded["s"]["honest_sites"]) == (None, 3)
    with paths["csv"].open(newline="") as f:
        table = {r["site_id"]: r for r in csv.DictReader(f)}
    assert float(table["s"]["epsilon_collusion"]) == s["epsilon_collusion"]
    assert (table["s"]["honest_sites"], table["p"]["epsilon_collusion"]) == ("3", "")
    html = paths["html"].read_text()
    assert (
        "epsilon holds if at least 3 sites are honest; if the other sites collude with the "
        f"coordinator {s['epsilon_collusion']:.3f}"
    ) in html
    assert "Under secure aggregation (s: at least 3 honest sites)" in html

    for text in (format_round_table(report["sites"]), format_round_table(list(light.values()))):
        lines = text.splitlines()
        assert lines[0].split()[:4] == ["site", "epsilon", "collude", "honest"]
        by_site = {line.split()[0]: line.split() for line in lines[1:3]}
        assert by_site["s"][1:4] == [
            f"{s['epsilon']:.3f}",
            f"{s['epsilon_collusion']:.3f}",
            "3",
        ]
        assert by_site["p"][2:4] == ["-", "-"]
        assert lines[-1].startswith("collude: epsilon if every other site colludes")
