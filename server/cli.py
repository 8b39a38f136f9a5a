"""``prism-fl``: the coordinator's command line.

Subcommands:

- ``report --ledger FILE --out DIR [--planned-steps-per-round N]``: write ``report.json``,
  ``report.csv`` and ``report.html`` (budget per site, epsilon recomputed from the ledger; the
  held-out metric per round from ``summary.json`` beside the ledger when the run has one). The
  ledger is opened read-only and never modified.

- ``audit --ledger FILE [--run-config FILE] [--out DIR] [--canaries N] ...``: the privacy
  self-audit (``server.audit``): the run's configuration and the sites' facts (a non-private
  run, or a setting or fact outside its accepted range, fails), accountant cross-check per
  site, record/replay checks of the mechanism with per-block noise tests, canaries with a
  one-run lower bound on epsilon and per-block noise tests; prints tables, the verdict and
  why, and writes ``audit.json``.

- ``evaluate RUN_DIR --data FILE [--json OUT] [--predictions FILE]``: load the run's exported
  model (peft adapter on the original base, plus pooling and head for a classifier), print its
  accuracy (classification) or exact match (causal-lm) on FILE and write one prediction per
  row (JSON Lines).

- ``predict RUN_DIR --data FILE --out FILE``: the same predictions for rows without labels.

- ``plan --passes P | --example-gradients E --rows-per-site N [--epsilon E] [--delta D]
  [--sites K] [--model M]``: from public facts only, the run config the budget study found best
  for the budget (``prism_runtime.plan``), the sigma a site calibrates for it, the noise of one
  step in units of C, and the epsilon the run charges.

Exit codes: 0 success, 1 cannot write the output, 2 bad ledger, data or arguments, 3 an audit
check failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from server.errors import ConfigError, LedgerError
from server.ledger import Ledger
from server.report import build_report, format_round_table
from server.report_files import read_server_eval, write_reports

__all__ = ["EXIT_AUDIT_FAILED", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

log = logging.getLogger(__name__)

PROG = "prism-fl"
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_AUDIT_FAILED = 3


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
        report = build_report(
            ledger,
            planned_steps_per_round=args.planned_steps_per_round,
            server_eval=read_server_eval(Path(args.ledger).parent),
        )
    try:
        paths = write_reports(report, args.out)
    except OSError as exc:
        print(f"{PROG}: cannot write the report to {args.out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(format_round_table(report["sites"]))
    for kind, path in paths.items():
        print(f"{PROG}: {kind} report written to {path}")
    return EXIT_OK


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), found {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), found {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, found {value}")
    return value


def _audit(args: argparse.Namespace) -> int:
    from server.audit import (
        CanarySettings,
        ReplaySettings,
        format_audit,
        mechanism_by_name,
        run_audit,
        write_audit,
    )

    try:
        canary = CanarySettings(
            canaries=args.canaries,
            guesses=args.guesses if args.guesses is not None else 2 * (args.canaries // 10),
            noise_multiplier=args.canary_sigma,
            steps=args.canary_steps,
            delta=args.delta,
            confidence=args.confidence,
            seed=args.seed,
        )
    except ValueError as exc:
        raise ConfigError(f"{exc}. See prism-fl audit --help.") from exc
    if args.run_config is not None and not Path(args.run_config).is_file():
        raise ConfigError(
            f"--run-config {args.run_config}: no such file. Give the run folder's "
            "run-config.json, or leave the option out to use the one beside the ledger."
        )
    report = run_audit(
        args.ledger,
        mechanism=mechanism_by_name(args.inject_bug),
        replay=ReplaySettings(noise_multiplier=args.sigma, seed=args.seed),
        canary=canary,
        run_config=args.run_config,
    )
    print(format_audit(report))
    try:
        path = write_audit(report, args.out)
    except OSError as exc:
        print(f"{PROG}: cannot write the audit to {args.out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{PROG}: audit written to {path}")
    return EXIT_OK if report.passed else EXIT_AUDIT_FAILED


def _add_audit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from server.audit.mechanisms import BROKEN

    audit = sub.add_parser(
        "audit",
        help="privacy self-audit: accountants, mechanism record/replay, canary lower bound",
        description="Check that the run was private at all (its recorded config and "
        "run-config.json: method nondp, report-train-loss true, noise-multiplier 0, or a site "
        "reporting rng=reproducible fail) and within the accepted ranges (a run config the "
        "current model refuses, or a sigma, clip, step count or round outside them, fails); "
        "cross-check every site's epsilon (PRV, RDP, "
        "dp_accounting PLD) and cap; run record/replay checks of one real PRISM step "
        "(sensitivity C/b with the global clip, noise independent of the realised batch, noise "
        "std sigma C/b in every block: core, A-perp, B-perp, head); and canaries with a known "
        "clipped signal: a one-run lower bound on epsilon (Steinke, Nasr, Jagielski 2023) next "
        "to the claimed one, and per-block tests of the noise, with the smallest shortfall they "
        "detect. The ledger is opened read-only. Exit status 3 when a check fails.",
    )
    audit.add_argument("--ledger", required=True, metavar="FILE", help="the ledger (SQLite)")
    audit.add_argument(
        "--run-config",
        default=None,
        metavar="FILE",
        help="the run's run-config.json (default: the one beside the ledger, if any)",
    )
    audit.add_argument("--out", default=".", metavar="DIR", help="folder for audit.json (.)")
    audit.add_argument(
        "--canaries", type=_positive_int, default=1000, metavar="N", help="canaries (1000)"
    )
    audit.add_argument(
        "--guesses",
        type=_positive_int,
        default=None,
        metavar="G",
        help="guesses, half 'in' (top scores), half 'out' (default: 20%% of the canaries)",
    )
    audit.add_argument(
        "--canary-sigma",
        type=_positive_float,
        default=2.0,
        metavar="SIGMA",
        help="noise multiplier of the canary experiment (2.0: claimed epsilon 2.0 at 1e-5)",
    )
    audit.add_argument(
        "--canary-steps", type=_positive_int, default=1, metavar="T", help="canary steps (1)"
    )
    audit.add_argument(
        "--sigma",
        type=_positive_float,
        default=1.0,
        metavar="SIGMA",
        help="noise multiplier of the record/replay checks (1.0)",
    )
    audit.add_argument(
        "--delta", type=_fraction, default=1e-5, help="delta of the canary audit (1e-5)"
    )
    audit.add_argument(
        "--confidence", type=_fraction, default=0.95, help="confidence of the lower bound (0.95)"
    )
    audit.add_argument("--seed", type=int, default=0, help="seed of the checks (0)")
    audit.add_argument(
        "--inject-bug",
        choices=sorted(BROKEN),
        default=None,
        help="SELF-TEST: audit a deliberately broken mechanism instead (must fail)",
    )
    audit.set_defaults(handler=_audit)


def _load_run(args: argparse.Namespace) -> Any:
    from server.evaluation import load_run

    return load_run(args.run_dir, model=args.model, max_length=args.max_length, device=args.device)


def _evaluate(args: argparse.Namespace) -> int:
    from prism_runtime.errors import ClientError
    from server.evaluation import evaluate_run, write_jsonl

    try:
        run = _load_run(args)
        metrics, rows = evaluate_run(run, args.data, batch_size=args.batch_size)
    except ClientError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    name = "accuracy" if "accuracy" in metrics else "exact_match"
    extra = f", loss {metrics['loss']:.4f}" if "loss" in metrics else ""
    print(f"{PROG}: {name} {metrics[name]:.4f} on {metrics['examples']} rows of {args.data}{extra}")
    predictions = args.predictions or run.run_dir / "predictions" / f"{Path(args.data).stem}.jsonl"
    report = {"data": str(args.data), "adapter": str(run.adapter), **metrics}
    try:
        print(f"{PROG}: per-row predictions written to {write_jsonl(predictions, rows)}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
            print(f"{PROG}: metrics written to {args.json}")
    except OSError as exc:
        print(f"{PROG}: cannot write the output: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _predict(args: argparse.Namespace) -> int:
    from prism_runtime.errors import ClientError
    from server.evaluation import predict_run, write_jsonl

    try:
        rows = predict_run(_load_run(args), args.data, batch_size=args.batch_size)
    except ClientError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = write_jsonl(args.out, rows)
    except OSError as exc:
        print(f"{PROG}: cannot write the predictions to {args.out}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{PROG}: {len(rows)} predictions written to {path}")
    return EXIT_OK


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder (or its adapter folder)")
    parser.add_argument("--data", required=True, metavar="FILE", help=".jsonl, .csv or dataset")
    parser.add_argument(
        "--model", default=None, help="the ORIGINAL base model (default: the run's own)"
    )
    parser.add_argument(
        "--max-length",
        type=_positive_int,
        default=None,
        help="tokens per example (default: the run's, else 128)",
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, default=64, help="rows per forward pass (64)"
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def _add_model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = sub.add_parser(
        "evaluate",
        help="accuracy / exact match of a run's exported model on a labelled file",
        description="Load the exported adapter on the original base model (with the "
        "classifier's pooling and head), print accuracy (classification) or exact match "
        "(causal-lm) and write one prediction per row.",
    )
    _model_arguments(evaluate)
    evaluate.add_argument("--json", default=None, metavar="OUT", help="write the metrics here")
    evaluate.add_argument(
        "--predictions",
        default=None,
        metavar="FILE",
        help="per-row predictions (default RUN_DIR/predictions/<data name>.jsonl)",
    )
    evaluate.set_defaults(handler=_evaluate)
    predict = sub.add_parser(
        "predict",
        help="predictions of a run's exported model for rows without labels",
        description="Like evaluate, for rows without labels: writes one prediction per row.",
    )
    _model_arguments(predict)
    predict.add_argument("--out", required=True, metavar="FILE", help="predictions (.jsonl)")
    predict.set_defaults(handler=_predict)


def _toml(value: float | str | bool) -> str:
    """``value`` as a ``--run-config`` (TOML) value: true/false, a quoted string or a number."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else f"{value:g}"


def _plan(args: argparse.Namespace) -> int:
    from prism_core.errors import PrivacyParameterError
    from prism_runtime.config import MINILM
    from prism_runtime.plan import STEP_SETTINGS_FROM_PASSES, budget_report, plan_budget

    passes = args.passes
    if args.example_gradients is not None:
        passes = args.example_gradients / args.rows_per_site
    try:
        plan = plan_budget(passes=passes, rows_per_site=args.rows_per_site)
        report = budget_report(plan, epsilon=args.epsilon, delta=args.delta)
    except (ValueError, PrivacyParameterError) as exc:
        raise ConfigError(f"plan: {exc}") from None
    keys: dict[str, float | str | bool] = {
        "budget": round(plan.passes, 6),
        "rows-per-site": plan.rows_per_site,
    }
    keys.update({"target-epsilon": args.epsilon, "delta": args.delta})
    keys["sites-per-round"] = args.sites
    honest = args.sites if args.honest_sites is None else args.honest_sites
    if args.honest_sites is not None and not args.secure:
        raise ConfigError("plan: --honest-sites is for secure aggregation: add --secure")
    if honest > args.sites:
        raise ConfigError(
            f"plan: --honest-sites {honest} > --sites {args.sites}: a site can count on at most "
            "the sites of its round"
        )
    if args.secure:
        keys.update({"secure-aggregation": True, "min-honest-sites": honest})
    if args.model != MINILM:
        keys["model"] = args.model
    print(
        f"# {plan.passes:g} passes over {plan.rows_per_site} rows a site, epsilon {args.epsilon:g}"
    )
    print("# run config (flwr run . <federation> --run-config '...'):")
    print(" ".join(f"{k}={_toml(v)}" for k, v in keys.items()))
    print("# what the budget sets:")
    for key, value in plan.settings(secure=args.secure).items():
        print(f"{key} = {value:g}")
    print(f"# sample rate q = b / N: {plan.sample_rate:.5g}")
    print(f"# example-gradients per site: {plan.example_gradients}")
    print(f"# sigma (calibrated by each site of {plan.rows_per_site} rows): {report.sigma:.4f}")
    print(f"# noise std of one step's mean gradient: {report.step_noise:.3g} C (sigma / b)")
    if args.secure:  # each of K sites adds sigma / sqrt(H): sqrt(K / H) sigma in the sum, over K b
        summed = report.step_noise * (args.sites / honest) ** 0.5 / args.sites
        print(
            f"# ... of the secure sum's mean over {args.sites} sites, each counting on "
            f"{honest} honest: {summed:.3g} C"
        )
    else:
        federated = report.step_noise / args.sites**0.5
        print(f"# ... of the mean over {args.sites} equal sites: {federated:.3g} C")
        print(
            "# the coordinator takes one adaptive step on the mean (step-at = auto): in the "
            "study 0.820 and 0.814 on SST-2 dev at two passes, against at most 0.762 when each "
            f"site steps on its own; secure aggregation (--secure) puts one sigma in the sum, sqrt("
            f"{args.sites}) times less noise in the mean (0.826 / 0.829; docs/benchmarks.md)"
        )
        if plan.passes < STEP_SETTINGS_FROM_PASSES:
            print(
                f"# below {STEP_SETTINGS_FROM_PASSES:g} passes that step keeps the demo's lr, clip "
                "and head: at the demo's budget 0.783 on SST-2 dev (two seeds) against 0.756 "
                "with the larger budgets' settings"
            )
    print(
        f"# epsilon charged per site: {report.charged:.4f} (<= {args.epsilon:g}) "
        f"at delta {args.delta:g}"
    )
    if args.model != MINILM:
        print(
            f"# note: the rules were chosen on MiniLM (docs/benchmarks.md); {args.model} is "
            "untested"
        )
    return EXIT_OK


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan",
        help="the run config for a compute budget at an epsilon, from public facts",
        description="From public facts only (the budget, about how many rows a site holds, "
        "epsilon, delta), print the run config the budget study found best (batch, rounds, "
        "lr), the sigma each site calibrates, the noise of a step in units of C and the "
        "epsilon a site charges. Rules and study: docs/benchmarks.md.",
    )
    budget = plan.add_mutually_exclusive_group(required=True)
    budget.add_argument("--passes", type=_positive_float, help="passes over each site's data")
    budget.add_argument(
        "--example-gradients",
        type=_positive_float,
        metavar="E",
        help="example-gradients per site (passes = E / rows-per-site)",
    )
    plan.add_argument(
        "--rows-per-site",
        type=_positive_int,
        required=True,
        metavar="N",
        help="about how many rows (people, per person) a site holds: public",
    )
    plan.add_argument("--epsilon", type=_positive_float, default=3.0, help="default 3")
    plan.add_argument("--delta", type=_positive_float, default=1e-5, help="default 1e-5")
    plan.add_argument("--sites", type=_positive_int, default=3, help="sites per round (3)")
    plan.add_argument("--model", default="minilm", help="the run's model (default minilm)")
    plan.add_argument(
        "--secure",
        action="store_true",
        help="secure aggregation: the budget sets one public sample-rate (b / N) and the "
        "secure runs' lr and clip",
    )
    plan.add_argument(
        "--honest-sites",
        type=_positive_int,
        metavar="H",
        help="with --secure: the honest sites each site counts on (min-honest-sites; default "
        "--sites); 1: each site's own noise covers it alone, as in plain rounds",
    )
    plan.set_defaults(handler=_plan)


def build_parser() -> argparse.ArgumentParser:
    """The parser: one subparser per subcommand, each with a ``handler``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="prism-fl coordinator tools.",
        epilog="Exit codes: 0 success, 1 cannot write output, 2 bad ledger, data or arguments, "
        "3 an audit check failed.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser(
        "report",
        help="write JSON, CSV and HTML budget reports from a ledger",
        description="Budget report per site; epsilon is recomputed from the ledger's events "
        "(PRV accountant, RDP cross-check). The ledger is opened read-only. When the ledger's "
        "folder is a finished run's (summary.json), the page also plots the coordinator's "
        "held-out metric per round.",
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
    _add_audit(sub)
    _add_model_commands(sub)
    _add_plan(sub)
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
