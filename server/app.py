"""Flower ServerApp of the prism-fl coordinator (thin: validate config, run the federation)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from prism_runtime.config import RunConfig, parse_config
from prism_runtime.logs import setup_logging
from server.federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, then run every round (see ``server.federation``)."""
    setup_logging()
    run = parse_config(RunConfig, context.run_config, what="run config")
    run_federation(grid, run)
