"""Flower ServerApp of the prism-fl coordinator (thin: validate config, run the federation)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from prism_runtime.config import RunConfig, parse_config
from prism_runtime.faults import faults_from_env
from prism_runtime.logs import setup_logging
from server.federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, then run every round (see ``server.federation``).

    The entry point is the one place that builds the crash-test fault object
    (``prism_runtime.faults.faults_from_env``: a no-op unless a test set its variable).
    """
    setup_logging()
    run = parse_config(RunConfig, context.run_config, what="run config")
    run_federation(grid, run, faults=faults_from_env())
