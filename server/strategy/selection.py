"""Which sites a round asks: the connected ones that can still run within their caps.

A site's cap is checked on the coordinator's ledger (``Ledger.can_run``) at the mechanism the
site last reported; a site that refused, or whose next round would exceed its cap, is exhausted
and never asked again in the run. The choice among eligible sites is seeded (public: it is the
coordinator's, and no privacy amplification is claimed from it).
"""

from __future__ import annotations

import logging
import random
import time

from flwr.serverapp import Grid

from server.errors import SitesUnavailableError
from server.ledger import Ledger

__all__ = ["WAIT_FOR_NODES", "Selection"]

log = logging.getLogger("server.strategy")

WAIT_FOR_NODES = 120.0
"""Seconds a round waits for ``sites-per-round`` connected sites before it goes on with
``min-sites`` (the grid's timing, not a run config key)."""


class Selection:
    """Eligibility, waiting for sites, and the seeded choice of a round's sites.

    Args:
        ledger, run_id: the coordinator's ledger and this run's id in it.
        local_steps, sites_per_round, min_sites, seed: see ``prism_runtime.config.RunConfig``.
        wait_for_nodes: seconds to wait for ``sites_per_round`` sites before going on with
            ``min_sites``.
        connect_timeout: seconds after which fewer than ``min_sites`` connected sites stop the
            run (``SitesUnavailableError``).
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        run_id: str,
        local_steps: int,
        sites_per_round: int,
        min_sites: int,
        seed: int,
        wait_for_nodes: float,
        connect_timeout: float,
    ) -> None:
        self.ledger, self.run_id, self.local_steps = ledger, run_id, local_steps
        self.sites_per_round, self.min_sites = sites_per_round, min_sites
        self.rng = random.Random(seed)
        self.wait_for_nodes, self.connect_timeout = wait_for_nodes, connect_timeout
        self.site_mechanism: dict[str, tuple[float, float, float, float]] = {}  # sigma q cap delta
        self.exhausted: set[str] = set()

    def eligible(self, site: str, server_round: int) -> bool:
        if site in self.exhausted:
            return False
        if site not in self.site_mechanism:
            return True
        sigma, q, cap, delta = self.site_mechanism[site]
        if sigma == 0:  # non-DP run: no budget to enforce
            return True
        ok = self.ledger.can_run(
            site,
            sigma=sigma,
            q=q,
            steps=self.local_steps,
            epsilon_cap=cap,
            delta=delta,
            before=(self.run_id, server_round),  # a re-run round decides as it did at first
        )
        if not ok:
            self.exhausted.add(site)
            log.info("site %s: next round would exceed its cap; no longer selected", site)
        return ok

    def nodes(self, grid: Grid) -> list[int]:
        """The connected nodes: once ``sites_per_round`` are, or ``min_sites`` after
        ``wait_for_nodes`` seconds; fewer than ``min_sites`` after ``connect_timeout`` stops the
        run with ``SitesUnavailableError`` (a coordinator must not wait forever)."""
        start = time.monotonic()
        while True:
            nodes = sorted(grid.get_node_ids())
            waited = time.monotonic() - start
            if len(nodes) >= self.sites_per_round or (
                len(nodes) >= self.min_sites and waited > self.wait_for_nodes
            ):
                return nodes
            if waited > self.connect_timeout:
                raise SitesUnavailableError(
                    f"{len(nodes)} of min-sites={self.min_sites} sites connected after "
                    f"{self.connect_timeout:g} s (connect-timeout): start more sites (SuperNodes) "
                    "or lower min-sites, then run again: applied rounds resume from the checkpoint."
                )
            log.info("waiting for sites: %d connected, want %d", len(nodes), self.sites_per_round)
            time.sleep(1.0)

    def choose(self, eligible: list[int]) -> list[int]:
        """Up to ``sites_per_round`` of the eligible nodes, drawn with the seeded generator."""
        return self.rng.sample(eligible, min(self.sites_per_round, len(eligible)))
