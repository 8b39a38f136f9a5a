"""A site's privacy policy, resolved from its node config: what it allows and where it keeps state.

The node config (``prism_runtime.config.SiteConfig``) is the site's policy; the run config is a
REQUEST. ``site_policy`` resolves the node config once (errors here are configuration errors:
the site cannot run at all), and ``SitePolicy.refusal`` says whether a run's request is allowed
(a refusal is an answer, never an error: the site replies ``refused`` with a
``prism_runtime.protocol.REFUSAL_REASONS`` code and charges nothing).

Deployed and simulated sites differ only in defaults:

- deployed (no ``partition-id``, or a ``data-path``): ``epsilon-cap``, ``delta`` and
  ``state-dir`` are REQUIRED, and reproducible randomness is refused
  (``require-secure-rng`` defaults to true);
- simulated (``partition-id`` without ``data-path``): ``epsilon-cap`` defaults to
  ``SIMULATION_EPSILON_CAP``, ``delta`` to ``SIMULATION_DELTA``, and ``state-dir`` to
  ``<run-dir>/sites/<site-id>`` (``runs/flwr-run-<run id>/sites/<site-id>`` without a run-dir):
  the simulated sites and the coordinator share one operator and one machine.

Randomness: by default every random draw that protects a record (Poisson sampling, dropout,
noise) comes from the OS at the site (``SitePolicy.round_seed`` returns None). Reproducible
mode (tests, benchmarks) needs a secret the SITE holds (node-config ``rng-secret`` or the site
process's ``PRISM_FL_RNG_SECRET``; never sent): each charged release is seeded by
``HMAC-SHA256(secret, site-id : round : ledger position)``. It is not private against anyone
who knows the secret, and the site says so in every reply (``rng = reproducible``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from prism_runtime.config import DEFAULT_MAX_RECORDS_PER_USER, RunConfig, SiteConfig
from prism_runtime.errors import ConfigError
from prism_runtime.protocol import RNG_REPRODUCIBLE, RNG_SECURE
from prism_runtime.secure_sum.trust import RoundTrust

__all__ = [
    "RNG_SECRET_ENV",
    "SIMULATION_DELTA",
    "SIMULATION_EPSILON_CAP",
    "SitePolicy",
    "delta_below_one_over_n",
    "site_policy",
]

RNG_SECRET_ENV = "PRISM_FL_RNG_SECRET"
"""Environment variable of the SITE process holding a reproducible-mode secret."""

SIMULATION_EPSILON_CAP = 8.0
"""A simulated site's cap when its node config sets none: a ceiling for experiments."""

SIMULATION_DELTA = 1e-5
"""A simulated site's delta when its node config sets none."""


def delta_below_one_over_n(delta: float, num_examples: int) -> bool:
    """Whether ``delta < 1/N`` for a site's ``N`` examples (a guarantee with a larger delta
    allows leaking a whole record with probability delta): the rule of every private run."""
    return delta < 1.0 / num_examples


@dataclass(frozen=True)
class SitePolicy:
    """A site's resolved policy (see the module docstring)."""

    site_id: str
    simulation: bool
    epsilon_cap: float
    delta: float
    state_dir: Path
    allow_nondp: bool
    allow_nonprivate_metrics: bool
    privacy_unit: str | None = None
    """``record``, ``user``, or None: a simulated site that follows the run (``unit_for``)."""
    user_field: str = ""
    max_records_per_user: int | None = None
    """The most records of one sampled person per step; None: ``DEFAULT_MAX_RECORDS_PER_USER``
    when deployed, the run's in simulation (``records_per_user``)."""
    secure_aggregation: str = "allow"
    """``off``, ``allow`` or ``require`` (node config ``secure-aggregation``)."""
    min_honest_sites: int | None = None
    """The most honest sites this site counts on; None: 1 when deployed, the run's in simulation."""
    secure_max_dropouts: int = 0
    """D, the most roster sites this site tolerates missing from a secure sum."""
    secure_graph: str | None = None
    """``complete`` or ``sparse`` (node config ``secure-graph``); None: ``complete`` when
    deployed, the run's in simulation (``sparse_graph``)."""
    secure_peers: Path | None = None
    """Deployed: the folder of the peers' pinned identity keys (``<site-id>.pem``)."""
    secure_identity: Path | None = None
    """The site's identity private key; None: ``<state-dir>/identity.pem``."""
    rng_secret: bytes | None = field(default=None, repr=False)
    cache_dir: Path | None = (
        None  # prism_runtime.cache: from the node config or the site's env only
    )

    @property
    def rng(self) -> str:
        """The ``rng`` fact: ``os-csprng`` or ``reproducible``."""
        return RNG_SECURE if self.rng_secret is None else RNG_REPRODUCIBLE

    def round_seed(self, server_round: int, attempt: int) -> int | None:
        """Seed of one charged release: None (draw from the OS) unless in reproducible mode.

        Args:
            server_round: the coordinator's round.
            attempt: the charge's position in the site's own ledger, so a re-run round (the
                site died before storing its reply) draws fresh randomness, as it is charged.
        """
        if self.rng_secret is None:
            return None
        message = f"{self.site_id}:{server_round}:{attempt}".encode()
        digest = hmac.new(self.rng_secret, message, hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64

    def unit_for(self, run: RunConfig) -> str | None:
        """The privacy unit this site runs ``run`` at, or None when it refuses the run's unit.

        The site's own setting decides and only ever makes the unit stronger: a ``user`` site
        runs per person whatever the run asks; a ``record`` site runs per record and refuses a
        run that asks for ``user`` (it names no person field, or its policy is per record); a
        simulated site that sets nothing follows the run's ``privacy-unit``.
        """
        if self.privacy_unit == "user":
            return "user"
        if self.privacy_unit == "record":
            return None if run.privacy_unit == "user" else "record"
        return run.privacy_unit

    def honest_sites(self, run: RunConfig) -> int:
        """H of a secure-aggregation charge: the run's ``min-honest-sites``, never more than the
        site's own (1 for a deployed site that sets none: its share then carries all the noise);
        a simulated site that sets none follows the run."""
        own = self.min_honest_sites
        if own is None:
            own = run.min_honest_sites if self.simulation else 1
        return min(own, run.min_honest_sites)

    def sparse_graph(self, run: RunConfig) -> bool:
        """Whether this site accepts a sparse masking graph in ``run``'s secure rounds (within
        its own bound, ``RoundTrust.check_graph``)."""
        own = self.secure_graph
        if own is None:
            own = run.secure_graph if self.simulation else "complete"
        return own == "sparse"

    def round_trust(self, run: RunConfig) -> RoundTrust:
        """H and D of this site's secure rounds of ``run`` (``prism_runtime.secure_sum.trust``).

        Raises:
            ConfigError: D is not below H (``refusal`` refuses such a run first).
        """
        return RoundTrust(self.honest_sites(run), self.secure_max_dropouts)

    def records_per_user(self, run: RunConfig) -> int:
        """k, the most records of one sampled person in a step: the run's
        ``max-records-per-user``, never more than the site's own (``DEFAULT_MAX_RECORDS_PER_USER``
        for a deployed site that sets none; a simulated site that sets none follows the run).
        k costs no privacy (a person's records share one clip); it bounds the work and time
        one sampled person costs the site."""
        own = self.max_records_per_user
        if own is None:
            own = run.max_records_per_user if self.simulation else DEFAULT_MAX_RECORDS_PER_USER
        return min(own, run.max_records_per_user)

    def refusal(self, run: RunConfig, num_examples: int) -> str | None:
        """The ``REFUSAL_REASONS`` code for a run this site will not serve, or None.

        The run's ``target-epsilon``/``delta`` are requests: at or below the site's own values
        they are honoured (the site then spends at most what the run asks), above them refused.
        ``num_examples`` is N in the site's privacy unit: its records, or its people.
        """
        if self.unit_for(run) is None:
            return "user-level-not-configured"
        if run.secure_aggregation and self.secure_aggregation == "off":
            return "secure-aggregation-off"
        if not run.secure_aggregation and self.secure_aggregation == "require":
            return "secure-aggregation-required"
        if run.secure_aggregation and not self.simulation and self.secure_peers is None:
            return "secure-aggregation-not-configured"
        if run.secure_aggregation and self.secure_max_dropouts >= self.honest_sites(run):
            return "secure-dropouts-not-below-honest-sites"
        if run.report_train_loss and not self.allow_nonprivate_metrics:
            return "nonprivate-metrics-not-allowed"
        if run.method == "nondp":
            if not self.allow_nondp:
                return "nondp-not-allowed"
        elif run.target_epsilon > self.epsilon_cap:
            return "epsilon-above-site-cap"
        elif run.delta > self.delta:
            return "delta-above-site-policy"
        elif not delta_below_one_over_n(run.delta, num_examples):
            return "delta-not-below-1/n"
        if not run.sample_rate and run.batch_size > num_examples:  # q = b / N above 1
            return "batch-above-site-data"
        return None


def _state_dir(site: SiteConfig, site_id: str, run_dir: str, run_id: int | str) -> Path:
    if site.state_dir:
        return Path(site.state_dir)
    if run_dir:
        return Path(run_dir) / "sites" / site_id
    return Path("runs") / f"flwr-run-{run_id}" / "sites" / site_id


def _cache_dir(site: SiteConfig, env_cache_dir: str) -> Path | None:
    """The site's cache folder: node config, else its env, else ``<node state-dir>/cache``.

    Never derived from the run config (``run-dir``) or a message: the coordinator must not
    choose where a site writes its tokenised data. None: no cache (computed at every start).
    """
    if site.cache_dir:
        return Path(site.cache_dir)
    if env_cache_dir:
        return Path(env_cache_dir)
    if site.state_dir:
        return Path(site.state_dir) / "cache"
    return None


def site_policy(
    site: SiteConfig,
    *,
    run_dir: str = "",
    run_id: int | str = "",
    env_secret: str = "",
    env_cache_dir: str = "",
) -> SitePolicy:
    """Resolve the node config into the site's policy (checked before any charge or training).

    Args:
        site: the validated node config.
        run_dir: the run config's ``run-dir`` (never the message's): a SIMULATED site's default
            state folder is ``<run_dir>/sites/<site-id>``.
        run_id: Flower's run id, for a simulated site's default state folder without run-dir.
        env_secret: the site process's ``PRISM_FL_RNG_SECRET`` (used when the node config sets
            no ``rng-secret``).
        env_cache_dir: the site process's ``PRISM_CACHE_DIR`` (``prism_runtime.cache``; used
            when the node config sets no ``cache-dir``).

    Raises:
        ConfigError: a deployed site without ``epsilon-cap``, ``delta`` or ``state-dir``, or
            set to ``privacy-unit=user`` without ``user-field``, or a reproducible-mode secret
            on a site that requires secure randomness.
    """
    site_id = site.name()
    simulation = site.simulation
    if not simulation:
        missing = [
            key
            for key, value in (
                ("epsilon-cap", site.epsilon_cap),
                ("delta", site.delta),
                ("state-dir", site.state_dir or None),
            )
            if value is None
        ]
        if missing:
            raise ConfigError(
                f"node config of deployed site {site_id!r} lacks {', '.join(missing)}: a site "
                "states its own privacy policy (epsilon-cap: the most epsilon it ever spends; "
                "delta: the largest delta it accepts, well below 1/N) and the folder of its "
                "durable privacy ledger (state-dir, on storage that survives restarts). The "
                "coordinator cannot choose them. Set them in --node-config (site kit: "
                "PRISM_EPSILON_CAP, PRISM_DELTA, PRISM_STATE_DIR)."
            )
    if site.privacy_unit == "user" and not simulation and not site.user_field:
        raise ConfigError(
            f"node config of deployed site {site_id!r} sets privacy-unit=user without "
            "user-field: name the field of each data row that identifies the person (e.g. "
            "user-field=patient_id; site kit: PRISM_USER_FIELD), so that all of a person's "
            "records count as one unit."
        )
    secret = site.rng_secret or env_secret
    require_secure = (
        site.require_secure_rng if site.require_secure_rng is not None else not simulation
    )
    if secret and require_secure:
        where = "node config rng-secret" if site.rng_secret else f"{RNG_SECRET_ENV}"
        raise ConfigError(
            f"site {site_id!r}: {where} asks for reproducible randomness, but this site requires "
            "secure randomness (require-secure-rng is true, the default for a deployed site). "
            "Reproducible mode makes sampling and noise predictable to whoever knows the secret; "
            f"remove the secret ({where}), or set require-secure-rng=false for a test site."
        )
    return SitePolicy(
        site_id=site_id,
        simulation=simulation,
        epsilon_cap=site.epsilon_cap if site.epsilon_cap is not None else SIMULATION_EPSILON_CAP,
        delta=site.delta if site.delta is not None else SIMULATION_DELTA,
        state_dir=_state_dir(site, site_id, run_dir, run_id),
        allow_nondp=site.allow_nondp,
        allow_nonprivate_metrics=site.allow_nonprivate_metrics,
        privacy_unit=site.privacy_unit if simulation else (site.privacy_unit or "record"),
        user_field=site.user_field,
        max_records_per_user=site.max_records_per_user,
        secure_aggregation=site.secure_aggregation,
        min_honest_sites=site.min_honest_sites,
        secure_max_dropouts=site.secure_max_dropouts,
        secure_graph=site.secure_graph,
        secure_peers=Path(site.secure_peers) if site.secure_peers else None,
        secure_identity=Path(site.secure_identity) if site.secure_identity else None,
        rng_secret=secret.encode() if secret else None,
        cache_dir=_cache_dir(site, env_cache_dir),
    )
