"""report.html for a person: it fits a 1280-pixel-wide screen (measured in a real headless
browser where one is installed), keeps every value of report.json and report.csv, and plots the
coordinator's held-out metric per round beside epsilon when the run has one."""

from __future__ import annotations

import base64
import csv
import json
import logging
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ledger_events import ledger_event

from prism_core.quantile import QUANTILE_MECHANISM
from server.cli import main
from server.ledger import Ledger, LedgerEvent
from server.report import CSV_COLUMNS, MARK_NOT_PRIVATE, MARK_UNCONFIRMED, build_report
from server.report_files import SUMMARY_FILE, read_server_eval, write_reports

RUN = "run-20250101T000000Z"
LONG_SITE = "hospital-north-east-regional-0007-cardiology-department-research-unit"
UNBROKEN_SITE = "x" * 90  # no hyphen to break at: the page must still wrap it
SCREEN = 1280
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((path for name in BROWSERS if (path := shutil.which(name))), None)
SERVER_EVAL = {
    r: {"accuracy": 0.5 + 0.05 * r, "loss": 0.69 - 0.04 * r, "examples": 200.0} for r in range(5)
}


def ev(rnd: int, site: str, **kw: object) -> LedgerEvent:
    args: dict[str, object] = dict(
        run_id=RUN, round=rnd, site_id=site, sigma=1.1, q=0.0123, steps=20, delta=1e-5,
        rng="os-csprng",
    )  # fmt: skip
    args.update(kw)
    return ledger_event(**args)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose ledger has every kind of long note and mark: changing sigma, a
    tightened cap, two deltas, reproducible rng, an unconfirmed charge, a private clip estimate,
    a site of unknown epsilon, and site ids too long for a column."""
    path = tmp_path_factory.mktemp("run")
    with Ledger.open(path / "ledger.sqlite") as led:
        led.record_run(RUN, {"rounds": 4})
        for r in range(1, 5):
            led.append_many(
                [
                    ev(r, LONG_SITE, epsilon_cap=8.0, sigma=1.0 + 0.1 * r),
                    ev(
                        r,
                        "clinic-b",
                        epsilon_cap=2.0 if r < 3 else 1.5,
                        rng="reproducible",
                        delta=1e-5 if r < 3 else 1e-6,
                    ),
                    ev(
                        r,
                        "site-3",
                        epsilon_cap=4.0,
                        confirmed=r != 2,
                        code="error-reply-4003" if r == 2 else "",
                    ),
                    ev(r, UNBROKEN_SITE, epsilon_cap=3.0, q=0.02 if r < 3 else 0.01),
                ]
            )
        led.append(
            ev(1, "site-4", steps=12, sigma=2.0, mechanism=QUANTILE_MECHANISM, epsilon_cap=3.0)
        )
        led.append(ev(1, "site-4", epsilon_cap=3.0))
        led.append(
            ev(
                2,
                "node-99",
                confirmed=False,
                params_known=False,
                code="no-reply",
                sigma=0.0,
                q=1.0,
                rng=None,
                epsilon_cap=1.0,
            )
        )
    return path


@pytest.fixture(scope="module")
def report(run_dir: Path) -> dict[str, Any]:
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as led:
        return build_report(led, horizon_rounds=8, server_eval=SERVER_EVAL)


@pytest.fixture(scope="module")
def page(report: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_reports(report, tmp_path_factory.mktemp("report"))["html"]


def png_size(page_text: str) -> tuple[int, int]:
    (image,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page_text)
    width, height = struct.unpack(">II", base64.b64decode(image)[16:24])  # IHDR
    return width, height


_MEASURE = """<script>
window.addEventListener("load", () => {
  const rows = [...document.querySelectorAll("tbody tr")]
    .map(r => r.getBoundingClientRect().height);
  const out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({
    scroll: document.documentElement.scrollWidth,
    viewport: window.innerWidth,
    rows: rows,
    cut: [...document.querySelectorAll("th, td")]
      .filter(c => c.scrollWidth > c.clientWidth).map(c => c.textContent),
  });
  document.body.appendChild(out);
});
</script>"""


def measure(html_text: str, tmp_path: Path) -> dict[str, Any]:
    """Lay out ``html_text`` in headless Chromium at 1280 x 900 and return the document's scroll
    width, the viewport's width, the table rows' heights and the text of every table cell
    whose content is wider than the cell (a script added to a copy of the
    page writes them into the DOM, which ``--dump-dom`` prints)."""
    copy = tmp_path / "measured.html"
    copy.write_text(html_text.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    assert BROWSER is not None
    done = subprocess.run(
        [
            BROWSER, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={SCREEN},900",
            "--virtual-time-budget=5000", "--dump-dom", copy.as_uri(),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    found = re.search(r'<pre id="measured">([^<]*)</pre>', done.stdout)
    assert found, f"no measurement from {BROWSER} (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))


@pytest.mark.skipif(
    BROWSER is None, reason=f"no headless browser installed ({', '.join(BROWSERS)})"
)
def test_the_page_fits_a_1280_pixel_screen_in_a_real_browser(page: Path, tmp_path: Path) -> None:
    control = measure('<html><body><div style="width: 2000px">wide</div></body></html>', tmp_path)
    assert control["viewport"] == SCREEN and control["scroll"] > SCREEN  # the measure sees overflow
    got = measure(page.read_text(encoding="utf-8"), tmp_path)
    assert got["viewport"] == SCREEN
    assert got["scroll"] <= SCREEN, got
    rows = got["rows"]
    assert len(rows) == 6
    assert max(rows) <= 2.5 * min(rows), rows  # one line a row, two for a long site id
    assert got["cut"] == []  # no number or header is cut short


def test_the_table_is_narrow_and_the_rest_is_under_it(report: dict[str, Any], page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    header = re.search(r"<thead><tr>(.*?)</tr></thead>", text)
    assert header
    assert re.findall(r"<th[^>]*>([^<]*)</th>", header.group(1)) == [
        "site", "epsilon (PRV) / cap", "delta", "rounds", "steps", "sigma", "q", "rounds left",
        "status",
    ]  # fmt: skip
    assert "table-layout: fixed" in text and "max-width" in text and "overflow-wrap" in text
    assert report["guarantee"]["text"] in text.replace("&#x27;", "'")
    assert "2 unconfirmed charge(s)" in text and "Epsilon unknown (worst case) for node-99" in text
    assert "NOT PRIVATE AGAINST THE COORDINATOR: clinic-b" in text
    for row in report["sites"]:
        assert f'<td class="l site"><div title="{row["site_id"]}">{row["site_id"]}</div>' in text
        line = re.search(rf"<li id=\"site-\d+\"><b>{row['site_id']}</b>: (.*?)</li>", text)
        assert line, row["site_id"]
        for part in ("epsilon (RDP cross-check)", "against the coordinator", "rng"):
            assert part in line.group(1)
        for mark in row["marks"]:
            assert mark in line.group(1)
    clinic = next(r for r in report["sites"] if r["site_id"] == "clinic-b")
    assert MARK_NOT_PRIVATE in clinic["marks"]
    # a tightened cap and two deltas add to the note; the marks' words stay in it
    assert "NOT private against the coordinator" in clinic["note"]
    assert "caps changed [2.0, 1.5]" in clinic["note"] and "deltas differ" in clinic["note"]
    site3 = next(r for r in report["sites"] if r["site_id"] == "site-3")
    assert f"1 {MARK_UNCONFIRMED}" in site3["marks"] and "error-reply-4003" in text
    assert "clip-estimate steps 12" in text
    long = next(r for r in report["sites"] if r["site_id"] == LONG_SITE)
    assert f"{long['epsilon']:.3f} / 8.000" in text and "1.4 (+3)" in text  # last sigma, 3 before
    node = re.search(r"<tr[^>]*><td[^>]*><div[^>]*>node-99</div>.*?</tr>", text)
    assert node and "unknown / 1.000" in node.group(0)
    assert '<span class="exhausted">exhausted</span>' in node.group(0)
    assert "&#9888; 2 marks</a>" in node.group(0)


def test_every_value_stays_in_json_and_csv(report: dict[str, Any], page: Path) -> None:
    with (page.parent / "report.csv").open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        table = list(reader)
    assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
    assert [r["site_id"] for r in table] == [r["site_id"] for r in report["sites"]]
    for got, want in zip(table, report["sites"], strict=True):
        assert got["note"] == want["note"] and got["rng"] == ";".join(want["rng"])
        assert got["epsilon_rdp"] == str(want["epsilon_rdp"])
    loaded = json.loads((page.parent / "report.json").read_text(encoding="utf-8"))
    assert loaded["server_eval"]["metric"] == "accuracy"
    assert [p["round"] for p in loaded["server_eval"]["rounds"]] == [0, 1, 2, 3, 4]


def test_the_held_out_metric_is_plotted_beside_epsilon(
    report: dict[str, Any], page: Path, tmp_path: Path
) -> None:
    text = page.read_text(encoding="utf-8")
    assert png_size(text)[0] == 1100  # two panels
    assert "Held-out accuracy of the global model" in text
    assert "0.500 at the start, 0.700 after round 4" in text and "on 200 examples" in text
    without = write_reports({**report, "server_eval": None}, tmp_path)["html"].read_text()
    assert png_size(without)[0] == 750 and "Held-out" not in without


def test_server_eval_series_picks_the_metric() -> None:
    from server.report import server_eval_series

    assert server_eval_series(None) is None and server_eval_series({}) is None
    assert server_eval_series({"1": {"loss": 0.3, "examples": 10}}) is None
    got = server_eval_series({"2": {"exact_match": 0.25, "examples": 8}, "0": {"exact_match": 0}})
    assert got == {
        "metric": "exact_match",
        "rounds": [
            {"round": 0, "exact_match": 0.0},
            {"round": 2, "exact_match": 0.25, "examples": 8.0},
        ],
    }


def test_the_cli_finds_the_metric_in_the_run_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = tmp_path / "ledger.sqlite"
    with Ledger.open(ledger) as led:
        led.append_many([ev(1, "a"), ev(2, "a")])
    assert read_server_eval(tmp_path) is None  # no summary: a run still going
    out = tmp_path / "without"
    assert main(["report", "--ledger", str(ledger), "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["server_eval"] is None
    summary = tmp_path / SUMMARY_FILE  # as the coordinator writes it at the end of a run
    summary.write_text(json.dumps({"server-eval": SERVER_EVAL}))
    assert read_server_eval(tmp_path) == SERVER_EVAL
    out = tmp_path / "with"
    assert main(["report", "--ledger", str(ledger), "--out", str(out)]) == 0
    loaded = json.loads((out / "report.json").read_text())
    assert loaded["server_eval"]["rounds"][-1]["accuracy"] == pytest.approx(0.7)
    assert "Held-out accuracy" in (out / "report.html").read_text()
    summary.write_text('{"server-eval": {"1": "broken"}}')
    with caplog.at_level(logging.WARNING):
        assert read_server_eval(tmp_path) is None
    assert "held-out metrics not readable" in caplog.text
