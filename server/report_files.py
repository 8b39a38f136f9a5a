"""The report's files: ``report.json``, ``report.csv`` and a self-contained ``report.html``, each
written atomically from a report of ``server.report.build_report``.

The page fits a 1280-pixel-wide screen: one table row per site with the budget numbers, a line
per site under it with the rest (RDP cross-check, the guarantee against the coordinator, under
secure aggregation the honest sites epsilon counts on and the epsilon if the other sites
collude, every sigma and q used, private clip estimates, unconfirmed charges, rng, marks and
notes), and one PNG: epsilon per round, beside the coordinator's held-out metric per round when
the report has one (``report["server_eval"]``). Every value stays in report.json and report.csv.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final

from prism_runtime.durable import atomic_write
from server.report import CSV_COLUMNS, UNIT_NAMES, format_number

__all__ = ["SUMMARY_FILE", "read_server_eval", "write_reports"]

log = logging.getLogger(__name__)

SUMMARY_FILE: Final = "summary.json"
"""The run folder's summary (``server.federation``); its ``server-eval`` holds the held-out
metrics per round."""


def read_server_eval(run_dir: str | Path) -> dict[int, dict[str, float]] | None:
    """The coordinator's held-out metrics per round from ``run_dir/summary.json``.

    Returns:
        round -> metrics (``summary.json``'s ``server-eval``), or None when the folder has no
        summary (a run still going, or a ledger outside a run folder), the run had no
        ``server-eval-data``, or the summary cannot be read (logged as a warning: a report
        never fails for want of the metric).
    """
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        evals = json.loads(path.read_text(encoding="utf-8")).get("server-eval") or {}
        return {int(r): {str(k): float(v) for k, v in m.items()} for r, m in evals.items()} or None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("%s: held-out metrics not readable (%s); the report shows none", path, exc)
        return None


# --------------------------------------------------------------------------------------------
# JSON and CSV
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


def _csv_text(report: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in report["sites"]:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# The plot
# --------------------------------------------------------------------------------------------

_METRIC_NAMES: Final = {"accuracy": "accuracy", "exact_match": "exact match"}


def _metric_name(key: str) -> str:
    return _METRIC_NAMES.get(key, key.replace("_", " "))


def _short(label: str, limit: int = 24) -> str:
    """``label`` cut to ``limit`` characters with an ellipsis, so a legend stays inside."""
    return label if len(label) <= limit else label[: limit - 1] + "\u2026"


def _plot_epsilon(ax: Any, report: Mapping[str, Any]) -> None:
    """Epsilon vs round per site, each site's cap dashed in the same colour."""
    from matplotlib.ticker import MaxNLocator

    multi_run = len(report["run_ids"]) > 1
    caps = {r["site_id"]: r["epsilon_cap"] for r in report["sites"]}
    for i, (site_id, points) in enumerate(report["series"].items()):
        color = f"C{i % 10}"
        xs = list(range(1, len(points) + 1)) if multi_run else [p["round"] for p in points]
        ys = [p["epsilon"] for p in points]
        ax.plot(xs, ys, marker="o", markersize=3, color=color, label=_short(str(site_id)))
        if caps.get(site_id) is not None:
            ax.axhline(caps[site_id], color=color, linestyle="--", linewidth=1)
    ax.set_xlabel("round the site took part in (all runs)" if multi_run else "round")
    ax.set_ylabel("epsilon (PRV)")
    ax.set_title("Privacy loss per site (dashed: cap)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if report["series"]:
        ax.legend(fontsize="small", loc="best", ncols=1 + (len(report["series"]) - 1) // 8)


def _plot_server_eval(ax: Any, server_eval: Mapping[str, Any]) -> None:
    """The coordinator's held-out metric vs round (round 0: before training), loss dotted on a
    second axis when the evaluation has one."""
    from matplotlib.ticker import MaxNLocator

    key = server_eval["metric"]
    points = [p for p in server_eval["rounds"] if key in p]
    ax.plot(
        [p["round"] for p in points],
        [p[key] for p in points],
        marker="o",
        markersize=3,
        color="C0",
        label=_metric_name(key),
    )
    ax.set_xlabel("round (0: before training)")
    ax.set_ylabel(f"held-out {_metric_name(key)}")
    ax.set_title(f"What the budget bought: held-out {_metric_name(key)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    losses = [p for p in server_eval["rounds"] if "loss" in p and math.isfinite(p["loss"])]
    if losses and key != "loss":
        twin = ax.twinx()
        twin.plot(
            [p["round"] for p in losses],
            [p["loss"] for p in losses],
            linestyle=":",
            marker=".",
            color="C3",
            label="loss",
        )
        twin.set_ylabel("held-out loss (dotted)")


def _plot_png(report: Mapping[str, Any]) -> bytes:
    """One PNG (Agg, no pyplot): epsilon per round, and beside it the held-out metric per
    round when ``report["server_eval"]`` has one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    server_eval = report.get("server_eval")
    fig = Figure(figsize=(11.0 if server_eval else 7.5, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if server_eval else 1, squeeze=False)[0]
    _plot_epsilon(axes[0], report)
    if server_eval:
        _plot_server_eval(axes[1], server_eval)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------

_CSS: Final = """
body { font-family: system-ui, sans-serif; color: #222; max-width: 72rem; margin: 1.5rem auto;
  padding: 0 1rem; line-height: 1.35; overflow-wrap: anywhere; }
table { border-collapse: collapse; margin: 1em 0; width: 100%; table-layout: fixed;
  font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
th { background: #f0f0f0; white-space: normal; overflow-wrap: normal; vertical-align: bottom; }
td.l, th.l { text-align: left; } td.site { white-space: normal; }
td.site div { display: -webkit-box; -webkit-box-orient: vertical; -webkit-line-clamp: 2;
  overflow: hidden; }
tr.marked td.site { border-left: 3px solid #a00; }
.exhausted { color: #a00; font-weight: bold; } .active { color: #070; }
.warn { color: #a00; } .marks { color: #a00; font-weight: bold; }
a.flag { color: #a00; font-weight: bold; text-decoration: none; }
.meta { color: #666; font-size: 0.9em; }
ul.sites { padding-left: 1.2em; font-size: 0.9em; } ul.sites li { margin: 0.3em 0; }
img { max-width: 100%; height: auto; }
"""
_TABLE: Final = (  # (header, width in % of the table, class)
    ("site", 18, "l"),
    ("epsilon (PRV) / cap", 14, ""),
    ("delta", 7, ""),
    ("rounds", 7, ""),
    ("steps", 8, ""),
    ("sigma", 9, ""),
    ("q", 10, ""),
    ("rounds left", 9, ""),
    ("status", 18, "l"),
)


def _g(x: float | None) -> str:
    """A number in at most 3 significant digits ("-" for None, "inf" for infinity)."""
    if x is None:
        return "-"
    return f"{x:.3g}" if math.isfinite(x) else "inf"


def _epsilon(row: Mapping[str, Any], key: str = "epsilon") -> str:
    """Epsilon to 3 decimals, "unknown" when an unconfirmed charge has unknown parameters."""
    if not row.get("epsilon_known", True):
        return "unknown"
    return format_number(row[key], 0).strip()


def _values(values: Sequence[float]) -> str:
    return ", ".join(_g(v) for v in values) if values else "-"


def _last_and_more(last: float | None, values: Sequence[float]) -> str:
    """The last value used and "(+n)" for n other values before it; "-" when none is known."""
    if not values:
        return "-"
    more = f" (+{len(values) - 1})" if len(values) > 1 else ""
    return f"{_g(last)}{more}"


def _rounds_left(row: Mapping[str, Any]) -> str:
    left = row["projected_rounds_left"]
    if left is None:
        return "-"
    return f"&ge; {left}" if row["projection_capped"] else str(left)


def _table_row(index: int, row: Mapping[str, Any]) -> str:
    site = html.escape(str(row["site_id"]))
    cap = row["epsilon_cap"]
    budget = f"{_epsilon(row)} / {'none' if cap is None else format_number(cap, 0).strip()}"
    marks = row.get("marks", [])
    status = html.escape(str(row["status"]))
    flag = ""
    if marks:
        words = "mark" if len(marks) == 1 else "marks"
        flag = (
            f' <a class="flag" href="#site-{index}" title="{html.escape("; ".join(marks))}">'
            f"&#9888; {len(marks)} {words}</a>"
        )
    title = f"PRV {row['epsilon']!r} {_per_unit(row)}"
    if row.get("epsilon_collusion") is not None:
        title += f"; {_collusion_text(row)}"
    cells = (
        f'<td class="l site"><div title="{site}">{site}</div></td>',
        f'<td title="{html.escape(title)}">{html.escape(budget)}</td>',
        f"<td>{_g(row['delta'])}</td>",
        f"<td>{row['rounds']:,}</td>",
        f"<td>{row['steps']:,}</td>",
        f'<td title="{html.escape(_values(row["sigma_values"]))}">'
        f"{html.escape(_last_and_more(row['sigma'], row['sigma_values']))}</td>",
        f'<td title="{html.escape(_values(row["q_values"]))}">'
        f"{html.escape(_last_and_more(row['q'], row['q_values']))}</td>",
        f"<td>{_rounds_left(row)}</td>",
        f'<td class="l"><span class="{status}">{status}</span>{flag}</td>',
    )
    marked = ' class="marked"' if marks else ""
    return f"<tr{marked}>{''.join(cells)}</tr>"


def _per_unit(row: Mapping[str, Any]) -> str:
    """ "epsilon per record" or "epsilon per patient": the unit of the site's events."""
    unit = str(row.get("unit", "record"))
    return f"epsilon per {UNIT_NAMES.get(unit, unit)}"


def _collusion_text(row: Mapping[str, Any]) -> str:
    """A secure-aggregation site's two guarantees: the honest sites its epsilon counts on and
    its epsilon if the other sites collude with the coordinator."""
    honest = row.get("honest_sites")
    counted = "an unknown number of" if honest is None else f"at least {honest}"
    return (
        f"epsilon holds if {counted} sites are honest; if the other sites collude with the "
        f"coordinator {_epsilon(row, 'epsilon_collusion')}"
    )


def _replace_one_how(row: Mapping[str, Any]) -> str:
    """How the replace-one guarantee was reached, for the site's line ("" when not known)."""
    how = {"pld": "replace-one PLD", "group-privacy": "group privacy of 2"}
    method = row.get("replace_one_method")
    return f" ({how[method]})" if method in how else ""


def _site_details(row: Mapping[str, Any]) -> list[str]:
    """The parts of a site's line under the table, as plain text."""
    parts = [
        _per_unit(row),
        f"epsilon (RDP cross-check) {_epsilon(row, 'epsilon_rdp')}",
        *([_collusion_text(row)] if row.get("epsilon_collusion") is not None else []),
        f"against the coordinator (replace-one) {_epsilon(row, 'epsilon_replace_one')} at delta "
        f"{_g(row['delta_replace_one'])}{_replace_one_how(row)}",
        f"sigma {_values(row['sigma_values'])}",
        f"q {_values(row['q_values'])}",
        f"steps per round {row['steps_per_round'] if row['steps_per_round'] else '-'}",
    ]
    if row["quantile_charges"]:
        parts.append(
            f"clip-estimate steps {row['quantile_steps']:,} ({row['quantile_charges']} "
            f"estimate(s), sigma {_values(row['quantile_sigma_values'])})"
        )
    if row["unconfirmed_rounds"]:
        codes = ", ".join(row.get("unconfirmed_codes", []))
        parts.append(
            f"unconfirmed {row['unconfirmed_rounds']} round(s), {row['unconfirmed_steps']:,} "
            f"steps ({codes})"
        )
    parts.append(f"rng {', '.join(str(v) for v in row['rng'])}")
    return parts


def _site_lines(report: Mapping[str, Any]) -> str:
    items = []
    for i, row in enumerate(report["sites"]):
        text = " &middot; ".join(html.escape(p) for p in _site_details(row))
        marks = row.get("marks", [])
        if marks:
            text += f'. <span class="marks">{html.escape("; ".join(marks))}</span>'
        if row["note"]:
            text += f". {html.escape(row['note'])}"
        items.append(f'<li id="site-{i}"><b>{html.escape(str(row["site_id"]))}</b>: {text}</li>')
    return "\n".join(items)


def _html_warnings(report: Mapping[str, Any]) -> str:
    """Paragraphs spelling out the marks of the report (empty when none applies)."""
    out = []
    if report["unconfirmed_charges"]:
        out.append(
            f"{report['unconfirmed_charges']} unconfirmed charge(s): rounds a site was asked to "
            "run and gave no valid answer for (an error reply, a time-out, facts that do not "
            "match the configuration). The site may have charged itself, so they are counted "
            "in its epsilon at its last confirmed parameters: a worst-case epsilon."
        )
    if report["epsilon_unknown"]:
        out.append(
            f"Epsilon unknown (worst case) for {', '.join(report['epsilon_unknown'])}: an "
            "unconfirmed charge of a site with no confirmed parameters."
        )
    marked = report["not_private_against_coordinator"]
    if marked["sites"]:
        out.append(
            f"NOT PRIVATE AGAINST THE COORDINATOR: {', '.join(marked['sites'])} (runs "
            f"{', '.join(marked['runs'])}) ran with reproducible (seeded) randomness, for tests "
            "and benchmarks; their epsilon holds against outsiders only."
        )
    return "\n".join(f'<p class="warn">{html.escape(text)}</p>' for text in out)


def _server_eval_line(report: Mapping[str, Any]) -> str:
    """One sentence: the held-out metric before and after training (empty without one)."""
    server_eval = report.get("server_eval")
    if not server_eval:
        return ""
    key = server_eval["metric"]
    points = [p for p in server_eval["rounds"] if key in p]
    if not points:
        return ""
    first, last = points[0], points[-1]
    examples = f" on {int(last['examples']):,} examples" if "examples" in last else ""
    start = "the start" if first["round"] == 0 else f"round {first['round']}"
    text = (
        f"Held-out {_metric_name(key)} of the global model (the coordinator's server-eval-data"
        f"{examples}): {first[key]:.3f} at {start}, {last[key]:.3f} after round {last['round']}."
    )
    return f'<p class="meta">{html.escape(text)}</p>'


def _render_html(report: Mapping[str, Any], png: bytes) -> str:
    cols = "".join(f'<col style="width: {w}%">' for _, w, _ in _TABLE)
    head = "".join(f"<th{f' class={c}' if c else ''}>{html.escape(t)}</th>" for t, _, c in _TABLE)
    body = "\n".join(_table_row(i, row) for i, row in enumerate(report["sites"]))
    acc = report["accountant"]
    img = base64.b64encode(png).decode("ascii")
    alt = "epsilon per round for each site, caps dashed"
    if report.get("server_eval"):
        alt += "; beside it the held-out metric per round"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>prism-fl privacy budget report</title>
<style>{_CSS}</style>
</head>
<body>
<h1>Privacy budget report</h1>
<p class="meta">Ledger {html.escape(str(report["ledger"]))} &middot; generated
{html.escape(report["generated_at"])} &middot; runs {html.escape(", ".join(report["run_ids"]))}
&middot; epsilon by the {html.escape(acc["epsilon"].upper())} accountant, cross-checked by
{html.escape(acc["cross_check"].upper())}; recomputed from every recorded event.</p>
<p class="meta">{html.escape(report["guarantee"]["text"])}</p>
{_html_warnings(report)}
<table>
<colgroup>{cols}</colgroup>
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<p class="meta">sigma and q: the last used, (+n): n other values before it (listed per site
below); rounds left: further rounds of the last sigma, q and steps per round that fit under the
cap. Every value is in report.json and report.csv.</p>
{_server_eval_line(report)}
<img alt="{html.escape(alt)}" src="data:image/png;base64,{img}">
<h2>Per site</h2>
<ul class="sites">
{_site_lines(report)}
</ul>
</body>
</html>
"""


def write_reports(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.csv`` (one row per site) and ``report.html`` to ``out_dir``.

    Each file is replaced atomically. The HTML is self-contained: inline CSS, the per-site
    table and lines, and an embedded PNG plot (epsilon per round, and the held-out metric per
    round beside it when ``report["server_eval"]`` has one).

    Returns:
        ``{"json": path, "csv": path, "html": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "csv": out / "report.csv", "html": out / "report.html"}
    texts = {
        "json": json.dumps(_jsonable(report), indent=2, allow_nan=False) + "\n",
        "csv": _csv_text(report),
        "html": _render_html(report, _plot_png(report)),
    }
    for kind, text in texts.items():
        atomic_write(paths[kind], _writer(text.encode("utf-8")))
    return paths


def _writer(data: bytes) -> Callable[[BinaryIO], object]:
    return lambda f: f.write(data)
