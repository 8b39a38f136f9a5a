"""Privacy-budget reports from the ledger: JSON, CSV and a self-contained HTML page with a plot.

Every epsilon in a report is recomputed from the ledger's events (``Ledger.epsilon``, PRV with
the RDP cross-check); nothing is read from a stored epsilon.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from prism_core.accounting import (
    PRV_EPS_ERROR,
    PrivacyEvent,
    epsilon,
    epsilon_report,
    max_steps,
)
from prism_core.errors import AccountingError
from server.errors import ConfigError
from server.ledger import Ledger, LedgerEvent, epsilon_series

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_HORIZON_ROUNDS",
    "build_report",
    "format_round_table",
    "projected_rounds_left",
    "round_rows",
    "write_reports",
]

DEFAULT_HORIZON_ROUNDS: Final = 512
"""Projections stop at this many rounds (a value equal to it means "at least")."""
_FIRST_HORIZON: Final = 8
"""First block of rounds tried by the projection, and the growth factor of the next blocks."""
CSV_COLUMNS: Final = (
    "site_id",
    "epsilon",
    "epsilon_rdp",
    "epsilon_cap",
    "delta",
    "rounds",
    "steps",
    "sigma",
    "q",
    "sigma_values",
    "q_values",
    "steps_per_round",
    "projected_rounds_left",
    "projection_capped",
    "status",
    "note",
)


# --------------------------------------------------------------------------------------------
# Building the report
# --------------------------------------------------------------------------------------------


def projected_rounds_left(
    history: Sequence[PrivacyEvent],
    *,
    sigma: float,
    q: float,
    steps_per_round: int,
    epsilon_cap: float,
    delta: float,
    horizon_rounds: int = DEFAULT_HORIZON_ROUNDS,
) -> tuple[int, bool]:
    """How many more rounds of ``steps_per_round`` steps at (sigma, q) fit under the cap.

    ``prism_core.accounting.max_steps`` (PRV, composed with ``history``) gives the largest number
    of further steps that fit, divided here by the steps per round. The PRV accountant gets slow
    for long histories, so the search is bracketed first: whole blocks of 8, 64, 512, ... rounds
    are tried (one epsilon each) up to ``horizon_rounds``, then ``max_steps`` searches only
    between the last block that fits and the first that does not.

    Returns:
        ``(rounds, capped)``: ``capped`` is True when ``rounds == horizon_rounds`` fit and more
        might.
    """
    if steps_per_round < 1:
        raise ConfigError(f"steps_per_round={steps_per_round!r} must be >= 1")
    if horizon_rounds < 1:
        raise ConfigError(f"horizon_rounds={horizon_rounds!r} must be >= 1")

    def block(rounds: int) -> list[PrivacyEvent]:
        return [PrivacyEvent(sigma, q, rounds * steps_per_round)] if rounds else []

    fitting, trial = 0, min(_FIRST_HORIZON, horizon_rounds)
    while epsilon([*history, *block(trial)], delta) <= epsilon_cap:
        fitting = trial
        if trial >= horizon_rounds:
            return horizon_rounds, True
        trial = min(trial * _FIRST_HORIZON, horizon_rounds)
    more_steps = max_steps(
        [*history, *block(fitting)],
        noise_multiplier=sigma,
        sample_rate=q,
        delta=delta,
        target_epsilon=epsilon_cap,
        limit=(trial - fitting) * steps_per_round,
    )
    return fitting + more_steps // steps_per_round, False


def _distinct(values: Sequence[float]) -> list[float]:
    return list(dict.fromkeys(values))


def _site_row(
    ledger: Ledger,
    site_id: str,
    *,
    planned_steps_per_round: int | None,
    horizon_rounds: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    events = ledger.events(site_id=site_id)  # one snapshot: the server may be appending
    history = [e.privacy_event() for e in events]
    ran = [e for e in events if e.steps > 0]
    last: LedgerEvent = ran[-1] if ran else events[-1]
    caps = [e.epsilon_cap for e in events if e.epsilon_cap is not None]
    cap = min(caps) if caps else None
    delta = min(e.delta for e in events)  # as Ledger.epsilon: the smallest delta
    row: dict[str, Any] = {
        "site_id": site_id,
        "epsilon": math.inf,
        "epsilon_rdp": math.inf,
        "epsilon_cap": cap,
        "delta": delta,
        "rounds": len({(e.run_id, e.round) for e in ran}),
        "steps": sum(e.steps for e in events),
        "sigma": last.sigma,
        "q": last.q,
        "sigma_values": _distinct([e.sigma for e in ran]),
        "q_values": _distinct([e.q for e in ran]),
        "steps_per_round": planned_steps_per_round or (last.steps if ran else None),
        "projected_rounds_left": None,
        "projection_capped": False,
        "status": "active",
        "note": "",
    }
    if len(set(caps)) > 1:
        row["note"] = f"caps changed {_distinct(caps)}; the smallest applies. "
    if len({e.delta for e in events}) > 1:
        row["note"] += "deltas differ; accounted at the smallest. "
    try:
        report = epsilon_report(history, delta)
        by_round = epsilon_series(events, delta)
    except AccountingError as exc:
        row["status"] = "exhausted"
        row["note"] += f"cannot be accounted, treated as exhausted: {exc}"
        return row, []
    row["epsilon"], row["epsilon_rdp"] = report.prv, report.rdp
    ran_keys = [(e.run_id, e.round) for e in ran]
    series = [
        {"run_id": run_id, "round": rnd, "epsilon": eps}
        for (run_id, _), (rnd, eps) in zip(ran_keys, by_round, strict=True)
    ]
    if cap is None:
        return row, series
    per_round = row["steps_per_round"]
    if per_round:
        left, capped = projected_rounds_left(
            history,
            sigma=last.sigma,
            q=last.q,
            steps_per_round=per_round,
            epsilon_cap=cap,
            delta=delta,
            horizon_rounds=horizon_rounds,
        )
        row["projected_rounds_left"], row["projection_capped"] = left, capped
        exhausted = left == 0 or report.prv > cap
    else:
        exhausted = report.prv >= cap
    row["status"] = "exhausted" if exhausted else "active"
    row["note"] = row["note"].strip()
    return row, series


def build_report(
    ledger: Ledger,
    *,
    planned_steps_per_round: int | None = None,
    horizon_rounds: int = DEFAULT_HORIZON_ROUNDS,
) -> dict[str, Any]:
    """A budget report of every site in the ledger.

    Per site (``report["sites"]``, one dict per site in order of first appearance): ``site_id``;
    ``epsilon`` (PRV) and ``epsilon_rdp`` (RDP cross-check) over all the site's events;
    ``epsilon_cap`` (the smallest cap the site ever reported: a budget can be tightened, never
    loosened; None if none); ``delta`` (the smallest of the site's deltas, the one epsilon is
    accounted at); ``rounds`` (distinct (run, round) with steps > 0); ``steps`` (total);
    ``sigma`` and ``q`` of the last event that ran steps, with ``sigma_values``/``q_values``
    listing the distinct values in order of use; ``steps_per_round`` (``planned_steps_per_round``
    or the last round's steps); ``projected_rounds_left`` (further rounds of the last (sigma, q,
    steps per round) that fit under the cap, by ``max_steps``; None without a cap), with
    ``projection_capped`` when it hit ``horizon_rounds``; ``status`` ("exhausted" when no further
    round fits or epsilon is past the cap, else "active"); ``note``.

    Also: ``series`` (site -> ``[{run_id, round, epsilon}]`` after each round the site ran),
    ``run_ids``, ``generated_at`` (UTC ISO-8601), ``ledger`` (path), ``accountant``.

    A site whose events cannot be accounted (non-Poisson sampling) gets epsilon inf and status
    "exhausted" with the reason in ``note``.

    Raises:
        ConfigError: ``planned_steps_per_round`` or ``horizon_rounds`` below 1.
    """
    if planned_steps_per_round is not None and planned_steps_per_round < 1:
        raise ConfigError(
            f"planned_steps_per_round={planned_steps_per_round!r} must be >= 1 (or None to use "
            "each site's last round)"
        )
    if horizon_rounds < 1:
        raise ConfigError(f"horizon_rounds={horizon_rounds!r} must be >= 1")
    sites: list[dict[str, Any]] = []
    series: dict[str, list[dict[str, Any]]] = {}
    for site_id in ledger.sites():
        row, points = _site_row(
            ledger,
            site_id,
            planned_steps_per_round=planned_steps_per_round,
            horizon_rounds=horizon_rounds,
        )
        sites.append(row)
        series[site_id] = points
    return {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "ledger": str(ledger.path),
        "accountant": {"epsilon": "prv", "cross_check": "rdp", "prv_eps_error": PRV_EPS_ERROR},
        "run_ids": ledger.run_ids(),
        "planned_steps_per_round": planned_steps_per_round,
        "horizon_rounds": horizon_rounds,
        "sites": sites,
        "series": series,
    }


# --------------------------------------------------------------------------------------------
# Text table for the server log
# --------------------------------------------------------------------------------------------


def _num(x: float | None, width: int) -> str:
    if x is None:
        return "-".rjust(width)
    return f"{x:{width}.3f}" if math.isfinite(x) else "inf".rjust(width)


def round_rows(ledger: Ledger, exhausted: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The rows ``format_round_table`` needs, at one PRV evaluation per site.

    ``build_report`` also composes every round's prefix and projects the rounds left (many
    accountant calls per site: 36 s for 10 sites x 20 rounds here), too slow to run after
    every round; this gives each site's epsilon so far, its smallest cap, and ``status``
    ``exhausted`` for the sites in ``exhausted`` (the strategy's own set), else ``active``.
    """
    done = set(exhausted)
    rows = []
    for site_id in ledger.sites():
        events = ledger.events(site_id=site_id)
        caps = [e.epsilon_cap for e in events if e.epsilon_cap is not None]
        delta = min(e.delta for e in events)
        try:
            eps = epsilon([e.privacy_event() for e in events], delta)
        except AccountingError:
            eps = math.inf
        rows.append(
            {
                "site_id": site_id,
                "epsilon": eps,
                "epsilon_cap": min(caps) if caps else None,
                "status": "exhausted" if site_id in done else "active",
            }
        )
    return rows


def format_round_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table (site, epsilon, cap, status) for the log after each round.

    ``rows`` are report rows (``build_report(...)["sites"]``) or any mappings with ``site_id``,
    ``epsilon``, ``epsilon_cap`` and ``status``.
    """
    width = max([len("site"), *(len(str(r["site_id"])) for r in rows)])
    lines = [f"{'site':<{width}}  {'epsilon':>9}  {'cap':>9}  status"]
    for r in rows:
        lines.append(
            f"{r['site_id']!s:<{width}}  {_num(r['epsilon'], 9)}  "
            f"{_num(r.get('epsilon_cap'), 9)}  {r['status']}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Writing the files
# --------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    """Non-finite floats as strings ("inf"), so report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _csv_cell(x: Any) -> Any:
    if x is None:
        return ""
    if isinstance(x, list):
        return ";".join(str(v) for v in x)
    return x


def _plot_png(report: Mapping[str, Any]) -> bytes:
    """Epsilon vs round per site, each site's cap dashed in the same colour (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.5, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    multi_run = len(report["run_ids"]) > 1
    caps = {r["site_id"]: r["epsilon_cap"] for r in report["sites"]}
    for i, (site_id, points) in enumerate(report["series"].items()):
        color = f"C{i % 10}"
        xs = list(range(1, len(points) + 1)) if multi_run else [p["round"] for p in points]
        ys = [p["epsilon"] for p in points]
        ax.plot(xs, ys, marker="o", markersize=3, color=color, label=str(site_id))
        if caps.get(site_id) is not None:
            ax.axhline(caps[site_id], color=color, linestyle="--", linewidth=1)
    ax.set_xlabel("round the site took part in (all runs)" if multi_run else "round")
    ax.set_ylabel("epsilon (PRV)")
    ax.set_title("Privacy loss per site (dashed: cap)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if report["series"]:
        ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


_CSS: Final = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; }
.exhausted { color: #a00; font-weight: bold; } .active { color: #070; }
.meta { color: #666; font-size: 0.9em; }
"""
_HTML_COLUMNS: Final = (
    ("site_id", "site"),
    ("epsilon", "epsilon (PRV)"),
    ("epsilon_rdp", "epsilon (RDP)"),
    ("epsilon_cap", "cap"),
    ("delta", "delta"),
    ("rounds", "rounds"),
    ("steps", "steps"),
    ("sigma_values", "sigma"),
    ("q_values", "q"),
    ("projected_rounds_left", "rounds left"),
    ("status", "status"),
    ("note", "note"),
)


def _html_cell(key: str, row: Mapping[str, Any]) -> str:
    value = row[key]
    if key == "projected_rounds_left" and value is not None and row["projection_capped"]:
        text = f"&ge; {value}"
    elif isinstance(value, float):
        text = html.escape(f"{value:.4g}" if key in ("delta", "q") else _num(value, 0).strip())
    elif isinstance(value, list):
        text = html.escape(", ".join(f"{v:g}" for v in value))
    else:
        text = html.escape("-" if value is None else str(value))
    cls = ' class="l"' if key in ("site_id", "note") else ""
    if key == "status":
        cls = f' class="{html.escape(str(value))}"'
    return f"<td{cls}>{text}</td>"


def _render_html(report: Mapping[str, Any], png: bytes) -> str:
    head = "".join(
        f"<th{' class=l' if k in ('site_id', 'note') else ''}>{html.escape(t)}</th>"
        for k, t in _HTML_COLUMNS
    )
    body = "\n".join(
        "<tr>" + "".join(_html_cell(k, row) for k, _ in _HTML_COLUMNS) + "</tr>"
        for row in report["sites"]
    )
    acc = report["accountant"]
    img = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>prism-fl privacy budget report</title>
<style>{_CSS}</style>
</head>
<body>
<h1>Privacy budget report</h1>
<p class="meta">Ledger {html.escape(str(report["ledger"]))} &middot; generated
{html.escape(report["generated_at"])} &middot; runs {html.escape(", ".join(report["run_ids"]))}
&middot; epsilon by the {html.escape(acc["epsilon"].upper())} accountant, cross-checked by
{html.escape(acc["cross_check"].upper())}; recomputed from every recorded event.</p>
<table>
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<img alt="epsilon per round for each site, caps dashed" src="data:image/png;base64,{img}">
</body>
</html>
"""


def write_reports(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.csv`` (one row per site) and ``report.html`` to ``out_dir``.

    The HTML is self-contained: inline CSS, the per-site table and an embedded PNG plot.

    Returns:
        ``{"json": path, "csv": path, "html": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "csv": out / "report.csv", "html": out / "report.html"}
    paths["json"].write_text(
        json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n", encoding="utf-8"
    )
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in report["sites"]:
            writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    paths["html"].write_text(_render_html(report, _plot_png(report)), encoding="utf-8")
    return paths
