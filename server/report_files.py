"""The report's files: ``report.json``, ``report.csv`` and a self-contained ``report.html`` with
an epsilon-per-round plot, written atomically from a report of ``server.report.build_report``."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from server.report import (
    CSV_COLUMNS,
    format_number,
)

__all__ = ["write_reports"]


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
.warn { color: #a00; } td.marks { color: #a00; font-weight: bold; }
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
    ("quantile_steps", "clip-estimate steps"),
    ("projected_rounds_left", "rounds left"),
    ("status", "status"),
    ("unconfirmed_rounds", "unconfirmed"),
    ("rng", "rng"),
    ("marks", "marks"),
    ("note", "note"),
)


def _html_cell(key: str, row: Mapping[str, Any]) -> str:
    value = row[key]
    if key in ("epsilon", "epsilon_rdp") and not row.get("epsilon_known", True):
        text = "unknown"
    elif key in ("rng", "marks"):
        text = html.escape("; ".join(str(v) for v in value))
    elif key == "projected_rounds_left" and value is not None and row["projection_capped"]:
        text = f"&ge; {value}"
    elif isinstance(value, float):
        text = html.escape(
            f"{value:.4g}" if key in ("delta", "q") else format_number(value, 0).strip()
        )
    elif isinstance(value, list):
        text = html.escape(", ".join(f"{v:g}" for v in value))
    else:
        text = html.escape("-" if value is None else str(value))
    cls = ' class="l"' if key in ("site_id", "note", "rng") else ""
    if key == "marks":
        cls = ' class="l marks"'
    if key == "status":
        cls = f' class="{html.escape(str(value))}"'
    return f"<td{cls}>{text}</td>"


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


def _render_html(report: Mapping[str, Any], png: bytes) -> str:
    head = "".join(
        f"<th{' class=l' if k in ('site_id', 'note', 'rng', 'marks') else ''}>{html.escape(t)}</th>"
        for k, t in _HTML_COLUMNS
    )
    body = "\n".join(
        "<tr>" + "".join(_html_cell(k, row) for k, _ in _HTML_COLUMNS) + "</tr>"
        for row in report["sites"]
    )
    acc = report["accountant"]
    img = base64.b64encode(png).decode("ascii")
    warnings = _html_warnings(report)
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
<p class="meta">{html.escape(report["guarantee"]["text"])}</p>
{warnings}
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
