"""The coordinator's run: set up the run folder, drive the strategy, write adapter and reports.

Outputs in one run folder (default ``runs/<UTC timestamp>/``): ``run-config.json``,
``ledger.sqlite`` (the privacy ledger), ``report.json`` / ``report.csv`` / ``report.html``
(budget reports), ``summary.json`` (per-round outcomes, ``rounds-applied``, any server-side
evaluation and where the adapter is), ``checkpoint.safetensors`` (the coordinator's resume state
after the last finished round, see ``server.checkpoint``; not a model) and ``adapter/`` (peft
format, loads on the original base model).

No adapter without training: when no round was applied (every site refused, every reply was
rejected or every aggregate discarded), ``adapter/`` is NOT written, since it would be the
untrained start point under a trained model's name. The run says so: a WARNING naming why, and
``summary.json`` holds ``"rounds-applied": 0``, ``"adapter": null`` and ``"adapter-reason"``.

Resume: running again with the same ``run-dir`` continues after the checkpointed round. The run
config must be the same (a different one is refused, naming the keys that differ). A round that
was interrupted is run again from the same state: the sites are asked the same question, the
sites resend what they already answered, and the ledger ignores the identical events it already
holds, so nothing is lost or counted twice. A site that answered the first attempt with an error
or not at all was charged UNCONFIRMED then; its resent stored reply now confirms that charge
(counted once), and a conflicting record rejects that one reply, never the round.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy.result import Result

from prism_runtime.config import RunConfig, site_method
from prism_runtime.data import load_examples
from prism_runtime.data.settings import pairs_problem, text_pairs_origin
from prism_runtime.durable import atomic_write
from prism_runtime.evaluate import evaluate
from prism_runtime.exchange import head_named, load_arrays, to_arrays
from prism_runtime.export import export_adapter
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.model import LoadedModel, load_model, model_config_for
from prism_runtime.plan import BudgetPlan
from prism_runtime.synthetic import synthetic_examples, synthetic_stream
from server.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    config_differences,
    load_checkpoint,
    save_checkpoint,
)
from server.errors import ConfigError
from server.ledger import Ledger
from server.report import build_report, format_round_table, round_rows
from server.report_files import write_reports
from server.strategy import PrismStrategy, RoundSummary
from server.strategy.contract import STATE_PREFIX as ROUND_STATE

__all__ = ["ADAPTER_DIR", "make_run_dir", "no_adapter_reason", "run_federation"]

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
RESUME_STATE_NOTE = (
    "the coordinator's resume state (not a model): run again with the same run-dir to continue"
)


def make_run_dir(run: RunConfig) -> Path:
    """The run folder: ``run-dir`` if set, else ``runs/<UTC timestamp>``."""
    if run.run_dir:
        path = Path(run.run_dir)
    else:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        path = Path("runs") / stamp
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _server_eval(run: RunConfig, loaded: LoadedModel) -> Any:
    if not run.server_eval_data:
        return None
    if run.server_eval_data == "synthetic":  # a held-out draw of the built-in task
        examples = synthetic_examples(200, seed=synthetic_stream(run.seed, "server-eval"))
    else:
        labels = loaded.config.num_labels if run.task == "seq-cls" else None
        examples = load_examples(run.server_eval_data, run.task, num_labels=labels)
        pairs = "text_a" in examples[0]  # the model reads what it trains on: pairs or not
        origin = text_pairs_origin(run)
        problem = pairs_problem(pairs, loaded.config.text_pairs, run.server_eval_data, origin)
        if run.task == "seq-cls" and problem:
            raise ConfigError(f"server-eval-data: {problem}")

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_arrays(loaded, arrays.to_torch_state_dict())
        metrics = evaluate(loaded, examples, max_length=run.max_length)
        log.info("round %d: server-side evaluation %s", server_round, metrics)
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    return evaluate_fn


def _check_same_config(run_dir: Path, config: dict[str, Any]) -> None:
    """Write ``run-config.json``, or refuse a run folder that holds a different run."""
    path = run_dir / "run-config.json"
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}: unreadable run config ({exc}); the run folder cannot be resumed. Use "
                "another run-dir."
            ) from exc
        differences = config_differences(stored, config)
        if differences:
            raise ConfigError(
                f"run-dir {run_dir} holds a run with another configuration, so it cannot be "
                f"resumed with this one; differing keys: {'; '.join(differences)}. Resume with "
                "the stored configuration, or choose a new run-dir for a new run."
            )
        return
    text = json.dumps(config, indent=2).encode()
    atomic_write(path, lambda f: f.write(text))


def _previous_result(ckpt: Checkpoint) -> Result:
    result = Result()
    for r, m in ckpt.train_metrics.items():
        result.train_metrics_clientapp[r] = MetricRecord(m)
    for r, m in ckpt.eval_metrics.items():
        result.evaluate_metrics_serverapp[r] = MetricRecord(m)
    return result


def no_adapter_reason(summaries: list[RoundSummary]) -> str:
    """Why no round was applied, from the rounds' summaries (empty when one was)."""
    if any(s.applied for s in summaries):
        return ""
    if not summaries:
        return "no round ran: no site could take part within its privacy cap"
    refused = sum(len(s.refused) for s in summaries)
    rejected = sum(len(s.rejected) for s in summaries)
    discarded = sum(bool(s.discarded) for s in summaries)
    codes = sorted({code for s in summaries for code in s.refusal_codes.values()})
    why = f"refusals: {refused}" + (f" ({', '.join(codes)})" if codes else "")
    why += f", rejected replies: {rejected}, discarded aggregates: {discarded}"
    return (
        f"no round was applied in {len(summaries)} round(s) ({why}): the adapter would be the "
        "untrained start point, so none is exported"
    )


def _export(loaded: LoadedModel, run_dir: Path, summaries: list[RoundSummary]) -> dict[str, Any]:
    """Export the adapter if a round was applied; the summary's adapter entries either way."""
    applied = sum(s.applied for s in summaries)
    entries: dict[str, Any] = {"rounds-applied": applied}
    reason = no_adapter_reason(summaries)
    if reason:
        log.warning("no adapter exported: %s (the run folder %s)", reason, run_dir)
        print(f"prism-fl: WARNING: NO adapter exported: {reason}")
        return {**entries, "adapter": None, "adapter-reason": reason}
    adapter = export_adapter(loaded, run_dir / ADAPTER_DIR)
    log.info("adapter: %s", adapter)
    print(f"prism-fl: adapter in {adapter}")
    return {**entries, "adapter": ADAPTER_DIR}


def _say_plan(plan: BudgetPlan, run: RunConfig) -> None:
    """Say what the run's budget chose (``prism_runtime.plan``)."""
    site_step = not (run.secure_aggregation or run.steps_at_coordinator)
    settings = plan.settings(secure=run.secure_aggregation, site_step=site_step)
    chosen = " ".join(f"{k}={v:g}" for k, v in settings.items())
    line = (
        f"budget of {plan.passes:g} passes over about {plan.rows_per_site} rows a site "
        f"({plan.example_gradients} example-gradients a site): {chosen}"
    )
    log.info("%s", line)
    print(f"prism-fl: {line}")


def run_federation(grid: Grid, run: RunConfig, *, faults: Faults = NO_FAULTS) -> Path:
    """Run the whole federation for ``run`` on ``grid`` (resuming a checkpointed run folder).

    ``faults``: crash points for tests (``prism_runtime.faults``), passed to the round loop,
    the ledger and the checkpoint; production passes none.
    """
    run_dir = make_run_dir(run)
    if run.plan is not None:
        _say_plan(run.plan, run)
    config = run.model_dump(by_alias=True)
    _check_same_config(run_dir, config)
    ckpt = load_checkpoint(run_dir)
    if ckpt is not None:
        differences = config_differences(ckpt.run_config, config)
        if differences:
            raise ConfigError(
                f"{run_dir / CHECKPOINT} was written by another configuration "
                f"({'; '.join(differences)}); use another run-dir."
            )
    loaded = load_model(model_config_for(run), method=site_method(run.method))
    initial = to_arrays(loaded)
    modules = [h.name for h in loaded.handles]
    head = [name for name, _ in head_named(loaded)]
    ledger = Ledger.open(run_dir / "ledger.sqlite", faults=faults)
    try:
        run_id = run_dir.name
        ledger.record_run(run_id, config)
        strategy = PrismStrategy.from_run(
            run, modules=modules, head=head, ledger=ledger, run_id=run_id, arrays=initial
        )
        if run.secure_aggregation and not run.sample_rate:
            log.warning(
                "secure aggregation with sample-rate = 0: every site samples batch-size = "
                "%d units of its own, so the sites weigh EQUALLY (aggregation = %s is not "
                "used) and every site adds the noise the smallest one needs; set sample-rate "
                "= sites x batch-size / total units for shard-size weights and one noise "
                "level (docs/usage.md)",
                run.batch_size,
                run.aggregation,
            )

        first_round, initial_record, previous = 1, ArrayRecord(initial), None
        if ckpt is not None:
            strategy.load_state_dict(ckpt.strategy)
            strategy.round_kind.load_state_dict(ckpt.arrays, ckpt.round_state)
            first_round = ckpt.server_round + 1
            initial_record = ArrayRecord(
                {k: v for k, v in ckpt.arrays.items() if not k.startswith(ROUND_STATE)}
            )
            previous = _previous_result(ckpt)
            log.info("resuming run %s after round %d (%s)", run_id, ckpt.server_round, run_dir)
            print(f"prism-fl: resuming {run_dir} at round {first_round}")

        def on_round_end(
            server_round: int, arrays: ArrayRecord, summary: RoundSummary, result: Result
        ) -> None:
            faults.reach("before-checkpoint", server_round)
            round_tensors, round_state = strategy.round_kind.state_dict()
            save_checkpoint(
                run_dir,
                Checkpoint(
                    server_round=server_round,
                    arrays={**arrays.to_torch_state_dict(), **round_tensors},
                    run_config=config,
                    strategy=strategy.state_dict(),
                    round_state=round_state,
                    train_metrics={r: dict(m) for r, m in result.train_metrics_clientapp.items()},
                    eval_metrics={r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
                ),
                faults=faults,
            )
            faults.reach("after-checkpoint", server_round)
            log.info(
                "round %d: %d accepted, %d refused, %d rejected, applied=%s\n%s",
                server_round,
                len(summary.accepted),
                len(summary.refused),
                len(summary.rejected),
                summary.applied,
                format_round_table(round_rows(ledger, strategy.exhausted)),
            )

        result = strategy.start(
            grid,
            initial_record,
            num_rounds=run.num_rounds,
            timeout=run.round_timeout,
            train_config=ConfigRecord({"run-dir": str(run_dir), "run-id": run_id}),
            evaluate_fn=_server_eval(run, loaded),
            on_round_end=on_round_end,
            first_round=first_round,
            previous=previous,
            faults=faults,
        )
        load_arrays(loaded, result.arrays.to_torch_state_dict())
        adapter = _export(loaded, run_dir, strategy.summaries)
        report = build_report(
            ledger,
            planned_steps_per_round=run.local_steps,
            server_eval=result.evaluate_metrics_serverapp,
        )
        report_files = write_reports(report, run_dir)
        summary = {
            "run-id": run_id,
            **adapter,
            "checkpoint": {"file": CHECKPOINT, "what": RESUME_STATE_NOTE},
            "rounds": [vars(s) for s in strategy.summaries],
            "server-eval": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
        }
        text = json.dumps(summary, indent=2, default=str).encode()
        atomic_write(run_dir / "summary.json", lambda f: f.write(text))
    finally:  # on an error too: the ledger file is left closed and consistent
        ledger.close()
    log.info("budget report: %s", report_files.get("html", run_dir / "report.html"))
    print(
        f"prism-fl: budget report in {run_dir / 'report.html'} (ledger {run_dir / 'ledger.sqlite'})"
    )
    return run_dir
