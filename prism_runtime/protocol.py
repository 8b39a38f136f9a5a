"""Message layout between the coordinator and the sites (one place, named constants).

Server -> site (train): RecordDict with
  ``ARRAYS``   ArrayRecord: per LoRA module ``<module>/A`` (m, r) and ``<module>/B`` (n, r)
               float32 in PRISM layout (docs/design.md §1), and ``head/<name>`` for a DP head;
  ``CONFIG``   ConfigRecord: ``server-round``, ``run-id`` (the coordinator run: a site resends
               its stored reply to a re-asked round), ``run-dir`` (simulation only).
Site -> server (train reply): RecordDict with
  ``UPDATE``   ArrayRecord: PRISM: ``<module>/dA``, ``<module>/dB`` (the tangent update at the
               broadcast point) and ``head/<name>`` deltas; factor-averaging baselines: the end
               factors ``<module>/A``, ``<module>/B`` and ``head/<name>`` values;
  ``ACCOUNTING`` ConfigRecord of accounting facts only (``prism_runtime.facts.ReplyFacts``);
  ``NONPRIVATE`` MetricRecord, present only when the run opts in (labelled non-private).

Refusals and errors: a site that will not run a round replies
``status = STATUS_REFUSED`` with ``reason`` set to one of ``REFUSAL_REASONS`` (a code, never free
text) and charges nothing. A site that fails replies with a Flower error message whose
``Error.code`` is one of ``SITE_ERROR_CODES`` and whose ``Error.reason`` is that code's fixed text:
never exception text or data (the full error stays in the site's own log). A site that stops its
part in a secure round replies with one of ``SECURE_ERRORS`` (one code per kind of refusal).

Randomness: ``RNG`` in the facts says where the site's sampling/dropout/noise randomness came
from: ``RNG_SECURE`` (OS CSPRNG, the default) or ``RNG_REPRODUCIBLE`` (seeded from a site-local
secret for tests and benchmarks; NOT private against the coordinator, and reported so).

Clip: an ``ok`` reply's ``max-norm`` is the clip C (the sensitivity) its steps ran with. With
``max-norm = auto`` the round in which a site estimated C privately (``client.clip_quantile``)
also reports that estimate's own event: ``quantile-sigma`` (the noise multiplier of the count),
``quantile-q`` and ``quantile-steps`` (mechanism ``prism_core.quantile.QUANTILE_MECHANISM``).

Freshness: every train message's ``CONFIG`` also carries ``ROUND_NONCE`` (random, new each
round); the ClientApp echoes it in ``ACCOUNTING`` next to ``server-round`` (``SERVER_ROUND``),
so the coordinator rejects a stale or replayed reply.
"""

from __future__ import annotations

__all__ = [
    "ACCOUNTING",
    "APP_ID",
    "ARRAYS",
    "CONFIG",
    "HEAD_PREFIX",
    "MAX_EXAMPLES",
    "MAX_SITE_ID_CHARS",
    "NONPRIVATE",
    "REFUSAL_REASONS",
    "RNG",
    "RNG_MODES",
    "RNG_REPRODUCIBLE",
    "RNG_SECURE",
    "ROUND_NONCE",
    "SECURE_ADVERTISE",
    "SECURE_CONSISTENCY",
    "SECURE_ERRORS",
    "SECURE_MASK",
    "SECURE_SAMPLE",
    "SECURE_SHARE",
    "SECURE_STAGES",
    "SECURE_UNMASK",
    "SERVER_ROUND",
    "SITE_ERROR_CODES",
    "SITE_ID",
    "STATUS_OK",
    "STATUS_REFUSED",
    "TRAIN",
    "UPDATE",
    "key",
    "message_type",
]

APP_ID = "prism-fl/prism-fl"
"""The Flower app id (``publisher/name`` of ``pyproject.toml``) a site's worker serves
(``client.worker``: a run of any other app bundle is refused)."""

ARRAYS = "arrays"
CONFIG = "config"
UPDATE = "update"
ACCOUNTING = "accounting"
NONPRIVATE = "nonprivate-metrics"
HEAD_PREFIX = "head/"

TRAIN = "train"
"""The plain round's action (Flower message type ``train``)."""
SECURE_ADVERTISE = "secure_advertise"
SECURE_SHARE = "secure_share"
SECURE_MASK = "secure_mask"
SECURE_CONSISTENCY = "secure_consistency"
SECURE_SAMPLE = "secure_sample"
SECURE_UNMASK = "secure_unmask"
SECURE_STAGES = (
    SECURE_ADVERTISE,
    SECURE_SHARE,
    SECURE_MASK,
    SECURE_CONSISTENCY,
    SECURE_SAMPLE,
    SECURE_UNMASK,
)
"""The secure round's actions, in order: round keys, Shamir shares, the masked input (the
charged stage), the signed participant and survivor sets (the consistency check), the site's
draw of the committed signatures it checks, the shares that unmask the sum (docs/design.md
§3.3)."""


def message_type(action: str) -> str:
    """Flower's message type of a round action: ``train`` or ``train.<secure stage>``."""
    return TRAIN if action == TRAIN else f"{TRAIN}.{action}"


SITE_ID = "site-id"
"""The site's id in a reply's facts (``prism_runtime.facts.ReplyFacts.site_id``) and in every
secure-sum message that names its sender or addressee."""
MAX_SITE_ID_CHARS = 128
"""Longest site id (printable characters, at least one)."""
SERVER_ROUND = "server-round"
ROUND_NONCE = "round-nonce"

STATUS_OK = "ok"
STATUS_REFUSED = "refused"

RNG = "rng"
RNG_SECURE = "os-csprng"
RNG_REPRODUCIBLE = "reproducible"
RNG_MODES = (RNG_SECURE, RNG_REPRODUCIBLE)

REFUSAL_REASONS: dict[str, str] = {
    "cap-exhausted": "the round's steps would take the site past its own epsilon cap",
    "epsilon-above-site-cap": "the run asks for a larger epsilon than the site's policy allows",
    "delta-above-site-policy": "the run asks for a larger delta than the site's policy allows",
    "delta-not-below-1/n": "delta must be below 1/N for the site's N examples",
    "batch-above-site-data": "the run's expected batch is larger than the site's N examples",
    "nondp-not-allowed": "the run asks for a non-private method; the site does not allow it",
    "nonprivate-metrics-not-allowed": "the run asks for non-private metrics; not allowed",
    "bad-broadcast": "the broadcast adapter is not finite, of the wrong shape, above the site's "
    "magnitude limits, or not of rank r with a bounded condition number",
    "bad-round": "the round number is not an integer in the range the site accepts",
    "user-level-not-configured": "the run asks for a per-person guarantee (privacy-unit=user); "
    "the site's policy is per record (set privacy-unit=user and user-field at the site)",
    "secure-aggregation-required": "the site takes part only in secure-aggregation rounds "
    "(its secure-aggregation is require); the run's round is plain",
    "secure-aggregation-off": "the run asks for secure aggregation; the site's policy is off",
    "secure-aggregation-not-configured": "the run asks for secure aggregation; the deployed site "
    "names no pinned identity keys of its peers (set secure-peers at the site)",
    "secure-dropouts-not-below-honest-sites": "the site tolerates as many dropouts as the honest "
    "sites it counts on for this run (secure-max-dropouts >= min-honest-sites): no noise share "
    "keeps its charge true",
}
"""Codes a site may put in ``reason`` of a ``refused`` reply, with their fixed meaning."""

SECURE_ERRORS: dict[int, str] = {
    4010: "secure round refused: the roster, threshold or masking graph does not meet this "
    "site's threshold condition; nothing shared",
    4011: "secure round refused: more of the round's sites are missing than this site tolerates; "
    "nothing charged or revealed",
    4012: "secure round refused: the participant or survivor sets disagree with those this site "
    "was given or its peers signed; nothing revealed",
    4013: "secure round refused: this round's masks were used already or its secrets are gone; "
    "never masked twice",
    4014: "secure round refused: a peer's identity key is not pinned here, or a signature or a "
    "sealed share does not verify; nothing shared",
    4015: "secure round refused: a roster site's noise share exceeds this site's whole noise; "
    "nothing charged",
}
"""The error codes with which a site stops its part in a secure round (``prism_runtime.
secure_sum.errors``: each refusal's class carries its code), with their fixed text; the
details go to the site's own log only."""

SITE_ERROR_CODES: dict[int, str] = {
    4001: "site configuration error (see the site's log)",
    4002: "site data error (see the site's log)",
    4003: "site internal error (see the site's log)",
    **SECURE_ERRORS,
}
"""``Error.code`` of a site's error reply and its fixed ``Error.reason`` text."""

MAX_EXAMPLES = 10**12
"""The largest shard a reply may state: its ``num-examples``, or ``b / q`` for examples weights."""


def key(module: str, part: str) -> str:
    """ArrayRecord key of one factor (``A``, ``B``) or tangent part (``dA``, ``dB``)."""
    return f"{module}/{part}"
