"""A site's reply as the coordinator reads it: typed and range-checked accounting facts, the
fixed text of an error reply, and the facts' match with what the run configured.

Nothing a site writes as free text is logged or stored: an error reply is shown by its
``Error.code`` and that code's fixed text (``prism_runtime.protocol.SITE_ERROR_CODES``), a
refusal by its reason code (``prism_runtime.protocol.REFUSAL_REASONS``); ``Error.reason`` is
never read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message
from flwr.common.constant import ErrorCode

from prism_core.bounds import FLOAT32_SLACK
from prism_core.records import ADJACENCY, PRIVACY_UNITS, SAMPLING, SKELLAM_MECHANISM
from prism_runtime.protocol import (
    ACCOUNTING,
    ACCOUNTING_KEYS,
    MAX_EXAMPLES,
    REFUSAL_REASONS,
    RNG,
    RNG_MODES,
    ROUND_NONCE,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    STATUS_OK,
    STATUS_REFUSED,
)
from prism_runtime.ranges import SIGMA_MAX, SIGMA_MIN
from server.errors import ReplyError
from server.strategy.bounds import AutoClip

__all__ = [
    "SECURE_FACTS",
    "RunTerms",
    "error_reply",
    "error_reply_text",
    "facts_of",
    "in_order",
    "unconfirmed_code",
    "validate_facts",
]

_MAX_STEPS = 10**6  # more local steps than any real round; larger is a garbled fact
_MAX_SCALE = 1e9  # largest C or expected batch a reply may state
_SCALE_RTOL = 1e-6  # a reply's sigma, C and b must equal the run's to this relative tolerance
_MAX_COUNT_SIGMA = 1e8  # a clip estimate's count noise (sigma_b = noise * b) grows with b
_QUANTILE_FACTS = ("quantile-sigma", "quantile-q", "quantile-steps")
SECURE_FACTS = ("honest-sites", "share-sigma")
"""The facts of a secure-aggregation reply (mechanism ``SKELLAM_MECHANISM``): H, the honest
sites its sigma counts on, and the noise multiplier of the site's own share alone."""
_MAX_HONEST_SITES = 10_000  # more honest sites than any federation here; larger is garbled
_FLOWER_ERRORS = {
    value: name for name, value in vars(ErrorCode).items() if isinstance(value, int)
}  # Flower's own codes (a ClientApp that crashed or raised, a node gone): fixed names
_OPTIONAL_FACTS: dict[str, type] = {
    SERVER_ROUND: int,
    ROUND_NONCE: str,
    RNG: str,
    "reason": str,
    "mechanism": str,
    "adjacency": str,
    "sampling": str,
    "delta": float,
    "epsilon-cap": float,
    "epsilon": float,
    "num-examples": int,
    "max-norm": float,
    "expected-batch-size": float,
    "quantile-sigma": float,
    "quantile-q": float,
    "quantile-steps": int,
    "unit": str,
    "honest-sites": int,
    "share-sigma": float,
}


def _check_type(name: str, value: Any, kind: type) -> None:
    """Type (and for numbers finiteness) of one fact; the site's own ``epsilon`` may be inf."""
    if kind is float and not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise ReplyError(f"accounting fact {name}={value!r} is not a number", "facts")
    if kind is float and name != "epsilon" and not math.isfinite(float(value)):
        raise ReplyError(f"accounting fact {name}={value!r} is not finite", "facts")
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ReplyError(f"accounting fact {name}={value!r} is not an integer", "facts")
    if kind is str and not isinstance(value, str):
        raise ReplyError(f"accounting fact {name}={value!r} is not a string", "facts")
    if kind is str and (len(value) > 1000 or not value.isprintable()):
        raise ReplyError(f"accounting fact {name} is too long or has control characters", "facts")


def validate_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """Check a reply's accounting facts; return them typed. Raises ``ReplyError``.

    Required: ``site-id``, ``status``, ``sigma``, ``q``, ``steps``; every other key must be one
    of ``prism_runtime.protocol.ACCOUNTING_KEYS`` with the right type; values must be in range.
    A noise multiplier (``sigma``, ``quantile-sigma``) is at least ``SIGMA_MIN``, the smallest a
    site runs (``prism_runtime.ranges``); ``sigma`` may also be 0, for a refusal or a non-DP
    method (``RunTerms.check`` refuses 0 in an ok reply of a DP run). A ``unit``, where given,
    is one of ``prism_core.records.PRIVACY_UNITS`` (absent: the facts are per record). The
    ``SECURE_FACTS`` follow ``_check_secure_facts``.
    """
    unknown = sorted(set(facts) - {*ACCOUNTING_KEYS, *SECURE_FACTS})
    if unknown:
        raise ReplyError(f"unknown accounting facts {unknown[:3]}", "facts")
    required = {"site-id": str, "status": str, "sigma": float, "q": float, "steps": int}
    for name, kind in required.items():
        if name not in facts:
            raise ReplyError(f"accounting facts lack {name!r}", "facts")
        _check_type(name, facts[name], kind)
    for name, kind in _OPTIONAL_FACTS.items():
        if name in facts:
            _check_type(name, facts[name], kind)
    if not facts["site-id"] or len(facts["site-id"]) > 128:
        raise ReplyError(f"site-id {facts['site-id'][:20]!r} is empty or too long", "facts")
    if facts["status"] not in (STATUS_OK, STATUS_REFUSED):
        raise ReplyError(f"unknown status {facts['status'][:20]!r}", "facts")
    sigma, q, steps = float(facts["sigma"]), float(facts["q"]), int(facts["steps"])
    if not (0 <= sigma <= SIGMA_MAX and 0 < q <= 1 and 0 <= steps <= _MAX_STEPS):
        raise ReplyError(
            f"impossible mechanism parameters sigma={sigma}, q={q}, steps={steps}", "facts"
        )
    if 0 < sigma < SIGMA_MIN:
        raise ReplyError(
            f"sigma={sigma} is neither 0 (no noise) nor in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], the "
            "noise multipliers a site runs",
            "facts",
        )
    if "delta" in facts and not 0 < float(facts["delta"]) < 1:
        raise ReplyError(f"delta={facts['delta']!r} is not in (0, 1)", "facts")
    for name in ("max-norm", "expected-batch-size"):
        if name in facts and not 0 < float(facts[name]) <= _MAX_SCALE:
            raise ReplyError(f"{name}={facts[name]!r} is not in (0, {_MAX_SCALE:g}]", "facts")
    if "num-examples" in facts and not 1 <= int(facts["num-examples"]) <= MAX_EXAMPLES:
        raise ReplyError(f"num-examples={facts['num-examples']!r} is not in [1, 1e12]", "facts")
    if "unit" in facts and facts["unit"] not in PRIVACY_UNITS:
        raise ReplyError(
            f"unit {facts['unit'][:20]!r} is not one of {list(PRIVACY_UNITS)}", "facts"
        )
    if SERVER_ROUND in facts and int(facts[SERVER_ROUND]) < 0:
        raise ReplyError(f"server-round={facts[SERVER_ROUND]!r} is negative", "facts")
    _check_quantile_facts(facts)
    _check_secure_facts(facts)
    return facts


def _check_secure_facts(facts: dict[str, Any]) -> None:
    """A secure-aggregation reply's facts (``validate_facts``, types already checked): both of
    ``SECURE_FACTS`` or neither; present on an ``ok`` reply exactly when its mechanism is
    ``SKELLAM_MECHANISM`` (a refusal of such a run may state neither: nothing ran), never on a
    reply of another mechanism; ``1 <= honest-sites <= 10000`` and
    ``0 <= share-sigma <= sigma``."""
    given = [name for name in SECURE_FACTS if name in facts]
    secure = facts.get("mechanism") == SKELLAM_MECHANISM
    if not given:
        if secure and facts["status"] != STATUS_REFUSED:
            raise ReplyError(
                f"a {SKELLAM_MECHANISM} reply without its facts {list(SECURE_FACTS)}", "facts"
            )
        return
    if not secure:
        raise ReplyError(
            f"secure-aggregation facts {given} on a reply whose mechanism is not "
            f"{SKELLAM_MECHANISM}",
            "facts",
        )
    if len(given) != len(SECURE_FACTS):
        raise ReplyError(f"secure-aggregation facts {given} without the others", "facts")
    honest, share = int(facts["honest-sites"]), float(facts["share-sigma"])
    if not 1 <= honest <= _MAX_HONEST_SITES:
        raise ReplyError(f"honest-sites={honest} is not in [1, {_MAX_HONEST_SITES}]", "facts")
    sigma = float(facts["sigma"])
    if not 0 <= share <= sigma:
        raise ReplyError(f"share-sigma={share} is not in [0, sigma={sigma}]", "facts")


def _check_quantile_facts(facts: dict[str, Any]) -> None:
    """A private clip estimate's facts: all three or none, in range (``validate_facts``)."""
    given = [name for name in _QUANTILE_FACTS if name in facts]
    if not given:
        return
    if len(given) != len(_QUANTILE_FACTS):
        raise ReplyError(f"clip-estimate facts {given} without the others", "facts")
    sigma, q = float(facts["quantile-sigma"]), float(facts["quantile-q"])
    steps = int(facts["quantile-steps"])
    if not (SIGMA_MIN <= sigma <= _MAX_COUNT_SIGMA and 0 < q <= 1 and 1 <= steps <= _MAX_STEPS):
        raise ReplyError(
            f"impossible clip-estimate parameters sigma={sigma}, q={q}, steps={steps}", "facts"
        )


def error_reply_text(code: object) -> str:
    """The fixed text shown for a site's error reply with ``Error.code`` ``code``.

    A code of ``prism_runtime.protocol.SITE_ERROR_CODES`` gets its text; one of Flower's own
    error codes (a ClientApp that crashed or raised, a node gone) its Flower name; any other code is
    "unknown site error code N". The site's ``Error.reason`` is never used: it is free text.
    """
    if not isinstance(code, int) or isinstance(code, bool):
        return "site error code is not an integer"
    if code in SITE_ERROR_CODES:
        return SITE_ERROR_CODES[code]
    if code in _FLOWER_ERRORS:
        return f"Flower error {_FLOWER_ERRORS[code]} (the site's ClientApp or node failed)"
    return f"unknown site error code {code}"


def _error_code(msg: Message) -> int | None:
    code = msg.error.code
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def error_reply(msg: Message) -> ReplyError:
    """The rejection of an error reply: its code and that code's fixed text, nothing else."""
    code = _error_code(msg)
    shown = "?" if code is None else str(code)
    return ReplyError(f"error reply {shown}: {error_reply_text(code)}", "error-reply")


def unconfirmed_code(error: ReplyError, msg: Message) -> str:
    """The ledger code of the unconfirmed charge a rejected reply leads to."""
    if error.code == "error-reply" and msg.has_error():
        code = _error_code(msg)
        return "error-reply" if code is None else f"error-reply-{code}"
    return error.code


def facts_of(msg: Message) -> dict[str, Any]:
    """The reply's accounting facts, checked by ``validate_facts``; raises ``ReplyError``."""
    record = msg.content.get(ACCOUNTING)
    if not isinstance(record, ConfigRecord):
        raise ReplyError("reply has no accounting facts record", "facts")
    return validate_facts(dict(record))


def in_order(replies: Iterable[Message]) -> list[Message]:
    """Replies sorted by claimed site id, then node: a fixed summation order, so the aggregate
    does not depend on arrival order (float addition is not associative)."""

    def order(msg: Message) -> tuple[str, int]:
        site = ""
        if not msg.has_error() and ACCOUNTING in msg.content:
            site = str(msg.content[ACCOUNTING].get("site-id", ""))
        return site, int(msg.metadata.src_node_id)

    return sorted(replies, key=order)


@dataclass(frozen=True)
class RunTerms:
    """What the coordinator configured that a reply's facts must match (``check``).

    Attributes:
        mechanism: the mechanism the run's method runs on each site.
        dp: whether it adds noise (a DP reply must report sigma > 0, the run's C and b).
        local_steps: the steps a round asks for.
        delta: the run's delta (a reply's may be smaller, never larger).
        noise_multiplier: the run's sigma (None: not fixed by the run, each site calibrates).
        max_norm, expected_batch_size: the run's C and b (None: not fixed by the run).
        sample_rate: the run's one public q (secure aggregation with ``sample-rate``; each
            site's b is then its own q N_k); None: each site's q is b / N_k.
        auto_clip: set for a run with ``max-norm = auto``.
    """

    mechanism: str
    dp: bool
    local_steps: int
    delta: float
    noise_multiplier: float | None = None
    max_norm: float | None = None
    expected_batch_size: float | None = None
    sample_rate: float | None = None
    auto_clip: AutoClip | None = None

    def check(self, facts: dict[str, Any]) -> None:
        """The reply's facts against what the coordinator configured; raises ``ReplyError``.

        ``facts-mismatch``: steps other than the round's (0 for a refusal), another mechanism,
        sampling other than Poisson, adjacency other than add/remove, an ``rng`` not in
        ``prism_runtime.protocol.RNG_MODES``, sigma 0 for a DP method, a sigma, C or b other than
        the run's where the run fixes it, delta above the run's, or one of these facts missing.
        ``refusal-reason``: a refusal whose reason is not one of
        ``prism_runtime.protocol.REFUSAL_REASONS`` (a malformed refusal). No site text is echoed.
        """
        refused = facts["status"] == STATUS_REFUSED
        if refused and facts.get("reason") not in REFUSAL_REASONS:
            raise ReplyError(
                "refused reply without a known reason code "
                "(prism_runtime.protocol.REFUSAL_REASONS)",
                "refusal-reason",
            )
        wanted: dict[str, object] = {
            "mechanism": self.mechanism,
            "sampling": SAMPLING,
            "adjacency": ADJACENCY,
        }
        for name, value in wanted.items():
            if facts.get(name) != value:
                raise ReplyError(f"fact {name} is not the run's {value!r}", "facts-mismatch")
        if facts.get(RNG) not in RNG_MODES:
            raise ReplyError(f"fact rng is not one of {list(RNG_MODES)}", "facts-mismatch")
        steps = 0 if refused else self.local_steps
        if int(facts["steps"]) != steps:
            raise ReplyError(
                f"reply ran {facts['steps']} steps, the round asked for {steps}", "facts-mismatch"
            )
        # A refusal spent nothing: a site that refused up front never calibrated (sigma 0).
        if self.dp and not refused and not float(facts["sigma"]) > 0:
            raise ReplyError("sigma = 0 for a differentially private method", "facts-mismatch")
        if self.dp and not refused and self.noise_multiplier is not None:
            sigma = float(facts["sigma"])
            if not math.isclose(sigma, self.noise_multiplier, rel_tol=_SCALE_RTOL):
                raise ReplyError(
                    f"fact sigma {sigma!r} is not the run's noise-multiplier "
                    f"{self.noise_multiplier!r}",
                    "facts-mismatch",
                )
        if self.dp and not refused:
            for name, value in (
                ("max-norm", self.max_norm),
                ("expected-batch-size", self.expected_batch_size),
            ):
                stated = facts.get(name)
                if stated is None or (
                    value is not None and not math.isclose(stated, value, rel_tol=_SCALE_RTOL)
                ):
                    raise ReplyError(
                        f"fact {name} is missing or not the run's {value!r}", "facts-mismatch"
                    )
            q = self.sample_rate
            if q is not None and not math.isclose(float(facts["q"]), q, rel_tol=_SCALE_RTOL):
                raise ReplyError(f"fact q is not the run's sample-rate {q!r}", "facts-mismatch")
        if not refused and ("delta" not in facts or float(facts["delta"]) > self.delta):
            raise ReplyError(
                f"delta {facts.get('delta')!r} is missing or above the run's {self.delta}",
                "facts-mismatch",
            )
        self._check_clip(facts)

    def _check_clip(self, facts: dict[str, Any]) -> None:
        """``max-norm = auto``: an ok reply's ``max-norm`` in ``AutoClip``'s range, and a clip
        estimate's facts only on an ok reply of such a run, with the run's K steps."""
        estimated = "quantile-steps" in facts
        auto = self.auto_clip
        if estimated and (auto is None or facts["status"] != STATUS_OK):
            raise ReplyError(
                "clip-estimate facts on a refusal or in a run without max-norm = auto",
                "facts-mismatch",
            )
        if auto is None or facts["status"] != STATUS_OK:
            return
        if estimated and int(facts["quantile-steps"]) != auto.steps:
            raise ReplyError(
                f"the clip estimate ran {facts['quantile-steps']} steps, the run asks {auto.steps}",
                "facts-mismatch",
            )
        clip = float(facts.get("max-norm", math.nan))
        low, high = auto.low * (1 - FLOAT32_SLACK), auto.high * (1 + FLOAT32_SLACK)
        if not low <= clip <= high:
            raise ReplyError(
                f"max-norm {facts.get('max-norm')!r} is missing or outside [{auto.low:.6g}, "
                f"{auto.high:.6g}], the clips a private estimate of this run can give",
                "facts-mismatch",
            )
