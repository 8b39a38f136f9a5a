"""The coordinator's durable, append-only privacy ledger (docs/design.md §3).

One SQLite file holds every accounting fact the server configured and the sites reported: per
site and round, the mechanism, neighbouring relation, sampling method, sigma, q, steps, delta
and privacy unit (and the site's epsilon cap; under secure aggregation, the honest sites the
charge counts on and the sigma of the site's own noise share). Epsilon is never stored:
``Ledger.epsilon`` recomputes it from the site's whole history with ``prism_core.accounting``
(PRV, with the RDP cross-check) every time.

File layout (schema version 1):

- ``meta(key, value)``: ``application = "prism-fl-ledger"``, ``schema_version = "1"``,
  ``created_at``; the SQLite header also carries
  ``application_id = LEDGER_APPLICATION_ID`` and ``user_version = SCHEMA_VERSION``, so a foreign
  file is recognised from its first 100 bytes.
- ``events``: append-only (TRIGGERs abort any UPDATE or DELETE). Each row is a charge, either
  *confirmed* (``confirmed = 1``: the site's own accounting facts, cross-checked by the
  coordinator) or *unconfirmed* (``confirmed = 0``: a site that was asked to run a round and gave
  no valid answer, an error reply, a time-out, facts that do not match the configuration; it may
  have charged itself, so the coordinator charges it at the site's last confirmed parameters, or
  with ``params_known = 0`` and sigma 0, i.e. epsilon infinite, when it has none). ``code`` says
  why a charge is unconfirmed (a coordinator code, never site text); ``rng`` is the site's
  ``rng`` fact (``os-csprng`` or ``reproducible``; NULL when not known); ``unit`` the event's
  privacy unit (``prism_core.records.PRIVACY_UNITS``: ``record`` or ``user``);
  ``honest_sites`` and ``share_sigma`` are set (both) exactly on a secure-aggregation event
  (``prism_core.records.SKELLAM_MECHANISM``): H, the honest sites its sigma counts on, and the
  RDP-equivalent multiplier of the site's own noise share (``<= sigma``), by which
  ``budget.collusion_epsilon`` gives the site's epsilon if every other site colluded with the
  coordinator; NULL on every other event.
  ``UNIQUE (run_id, round, site_id, mechanism, confirmed)``: at most one confirmed and one
  unconfirmed row per (run, round, site, mechanism), so a replayed record is never counted twice,
  and a round can hold a training row and the row of a private clip estimate
  (``prism_core.quantile.QUANTILE_MECHANISM``) charged in the same round. A confirmed row
  *supersedes* every unconfirmed row of the same (run, round, site), whatever its mechanism (a
  valid reply states everything the site charged that round): ``Ledger.events`` (the history
  every epsilon is computed from) leaves the superseded rows out; ``Ledger.records`` shows all.
- ``runs(run_id, started_at, config_json)``: one row per federated run, append-only too.

A file of another schema version is refused, unchanged, naming the version it found; this
prism-fl reads and writes version 1 only.

Durability: WAL journal, ``synchronous = FULL`` (a committed append survives power loss), every
write in one ``BEGIN IMMEDIATE`` transaction. A new ledger is built in a temporary file and
linked into place, so a half-initialised ledger never appears under the real name.

The triggers guard against accidents (a stray ``DELETE``), not against someone with write access
to the file, who can drop them; the trust model is in docs/security.md.

Modules: ``events`` (the event record and its validation), ``schema`` (tables, triggers, row
conversion, creation), ``checks`` (opening a file read-only first, refusing anything
that is not a prism-fl ledger), ``store`` (the ``Ledger``), ``budget`` (epsilon maths over a
history).
"""

from server.ledger.budget import epsilon_points, epsilon_series
from server.ledger.events import (
    DEFAULT_MECHANISM,
    UNKNOWN_HONEST_SITES,
    UNKNOWN_Q,
    UNKNOWN_SIGMA,
    LedgerEvent,
    RunRecord,
)
from server.ledger.schema import (
    APPLICATION,
    LEDGER_APPLICATION_ID,
    SCHEMA_VERSION,
)
from server.ledger.store import Ledger

__all__ = [
    "APPLICATION",
    "DEFAULT_MECHANISM",
    "LEDGER_APPLICATION_ID",
    "SCHEMA_VERSION",
    "UNKNOWN_HONEST_SITES",
    "UNKNOWN_Q",
    "UNKNOWN_SIGMA",
    "Ledger",
    "LedgerEvent",
    "RunRecord",
    "epsilon_points",
    "epsilon_series",
]
