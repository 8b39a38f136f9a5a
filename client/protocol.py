"""Message layout between the coordinator and the sites (one place, named constants).

Server -> site (train): RecordDict with
  ``ARRAYS``   ArrayRecord: per LoRA module ``<module>/A`` (m, r) and ``<module>/B`` (n, r)
               float32 in PRISM layout (DESIGN.md §1), and ``head/<name>`` for a DP head;
  ``CONFIG``   ConfigRecord: ``server-round``, ``run-id`` (the coordinator run: a site resends
               its stored reply to a re-asked round), ``run-dir`` (simulation only).
Site -> server (train reply): RecordDict with
  ``UPDATE``   ArrayRecord: PRISM: ``<module>/dA``, ``<module>/dB`` (the tangent update at the
               broadcast point) and ``head/<name>`` deltas; factor-averaging baselines: the end
               factors ``<module>/A``, ``<module>/B`` and ``head/<name>`` values;
  ``ACCOUNTING`` ConfigRecord of accounting facts only (see ``ACCOUNTING_KEYS``);
  ``NONPRIVATE`` MetricRecord, present only when the run opts in (labelled non-private).

Freshness: every train message's ``CONFIG`` also carries ``ROUND_NONCE`` (random, new each
round); the ClientApp echoes it in ``ACCOUNTING`` next to ``server-round`` (``SERVER_ROUND``),
so the coordinator rejects a stale or replayed reply.
"""

from __future__ import annotations

__all__ = [
    "ACCOUNTING",
    "ACCOUNTING_KEYS",
    "ARRAYS",
    "CONFIG",
    "HEAD_PREFIX",
    "NONPRIVATE",
    "ROUND_NONCE",
    "SERVER_ROUND",
    "STATUS_OK",
    "STATUS_REFUSED",
    "UPDATE",
    "key",
]

ARRAYS = "arrays"
CONFIG = "config"
UPDATE = "update"
ACCOUNTING = "accounting"
NONPRIVATE = "nonprivate-metrics"
HEAD_PREFIX = "head/"

SERVER_ROUND = "server-round"
ROUND_NONCE = "round-nonce"

STATUS_OK = "ok"
STATUS_REFUSED = "refused"

ACCOUNTING_KEYS = (
    "site-id",
    "status",
    "reason",
    "server-round",
    "round-nonce",
    "mechanism",
    "adjacency",
    "sampling",
    "sigma",
    "q",
    "steps",
    "delta",
    "epsilon-cap",
    "epsilon",
    "num-examples",
)


def key(module: str, part: str) -> str:
    """ArrayRecord key of one factor (``A``, ``B``) or tangent part (``dA``, ``dB``)."""
    return f"{module}/{part}"
