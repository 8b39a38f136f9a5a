"""``prism-fl``: the coordinator's command line.

Subcommands:

- ``report --ledger FILE --out DIR [--planned-steps-per-round N]``: write ``report.json``,
  ``report.csv`` and ``report.html`` (budget per site, epsilon recomputed from the ledger). The
  ledger is opened read-only and never modified.

Exit codes: 0 success, 1 cannot write the output, 2 bad ledger or bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from server.errors import ConfigError, LedgerError
from server.ledger import Ledger
from server.report import build_report, format_round_table, write_reports

__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

log = logging.getLogger(__name__)

PROG = "prism-fl"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {value}")
    return value


def _report(args: argparse.Namespace) -> int:
    with Ledger.open(args.ledger, create=False, read_only=True) as ledger:
        report = build_report(ledger, planned_steps_per_round=args.planned_steps_per_round)
    try:
        paths = write_reports(report, args.out)
    except OSError as exc:
        print(f"{PROG}: cannot write the report to {args.out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(format_round_table(report["sites"]))
    for kind, path in paths.items():
        print(f"{PROG}: {kind} report written to {path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The parser: one subparser per subcommand, each with a ``handler``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="prism-fl coordinator tools.",
        epilog="Exit codes: 0 success, 1 cannot write output, 2 bad ledger or arguments.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser(
        "report",
        help="write JSON, CSV and HTML budget reports from a ledger",
        description="Budget report per site; epsilon is recomputed from the ledger's events "
        "(PRV accountant, RDP cross-check). The ledger is opened read-only.",
    )
    report.add_argument("--ledger", required=True, metavar="FILE", help="the ledger (SQLite)")
    report.add_argument("--out", required=True, metavar="DIR", help="output folder")
    report.add_argument(
        "--planned-steps-per-round",
        type=_positive_int,
        metavar="N",
        default=None,
        help="local steps per future round for the projection (default: each site's last)",
    )
    report.set_defaults(handler=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prism-fl`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (LedgerError, ConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
