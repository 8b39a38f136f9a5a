"""A site's reply as the coordinator reads it: typed and range-checked accounting facts, the
fixed text of an error reply, and the facts' match with what the run configured.

Nothing a site writes as free text is logged or stored: an error reply is shown by its
``Error.code`` and that code's fixed text (``prism_runtime.protocol.SITE_ERROR_CODES``), a
refusal by its reason code (``prism_runtime.protocol.REFUSAL_REASONS``); ``Error.reason`` is
never read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message
from flwr.common.constant import ErrorCode

from prism_core.bounds import FLOAT32_SLACK
from prism_core.records import ADJACENCY, SAMPLING
from prism_runtime.facts import FactsError, ReplyFacts
from prism_runtime.protocol import (
    ACCOUNTING,
    REFUSAL_REASONS,
    RNG_MODES,
    SITE_ERROR_CODES,
    SITE_ID,
    STATUS_OK,
    STATUS_REFUSED,
)
from server.errors import ReplyError
from server.strategy.bounds import AutoClip

__all__ = [
    "RunTerms",
    "error_reply",
    "error_reply_text",
    "facts_of",
    "in_order",
    "read_facts",
    "unconfirmed_code",
]

_SCALE_RTOL = 1e-6  # a reply's sigma, C and b must equal the run's to this relative tolerance
_FLOWER_ERRORS = {
    value: name for name, value in vars(ErrorCode).items() if isinstance(value, int)
}  # Flower's own codes (a ClientApp that crashed or raised, a node gone): fixed names


def read_facts(record: Mapping[str, Any]) -> ReplyFacts:
    """A reply's accounting facts, typed and range-checked by ``ReplyFacts.parse``; raises
    ``ReplyError`` with code ``facts`` naming what is wrong."""
    try:
        return ReplyFacts.parse(record)
    except FactsError as exc:
        raise ReplyError(str(exc), "facts") from None


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


def facts_of(msg: Message) -> ReplyFacts:
    """The reply's accounting facts (``read_facts``); raises ``ReplyError``."""
    record = msg.content.get(ACCOUNTING)
    if not isinstance(record, ConfigRecord):
        raise ReplyError("reply has no accounting facts record", "facts")
    return read_facts(dict(record))


def in_order(replies: Iterable[Message]) -> list[Message]:
    """Replies sorted by claimed site id, then node: a fixed summation order, so the aggregate
    does not depend on arrival order (float addition is not associative)."""

    def order(msg: Message) -> tuple[str, int]:
        site = ""
        if not msg.has_error() and ACCOUNTING in msg.content:
            site = str(msg.content[ACCOUNTING].get(SITE_ID, ""))
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

    def check(self, facts: ReplyFacts) -> None:
        """The reply's facts against what the coordinator configured; raises ``ReplyError``.

        ``facts-mismatch``: steps other than the round's (0 for a refusal), another mechanism,
        sampling other than Poisson, adjacency other than add/remove, an ``rng`` not in
        ``prism_runtime.protocol.RNG_MODES``, sigma 0 for a DP method, a sigma, C or b other than
        the run's where the run fixes it, delta above the run's, or one of these facts missing.
        ``refusal-reason``: a refusal whose reason is not one of
        ``prism_runtime.protocol.REFUSAL_REASONS`` (a malformed refusal). No site text is echoed.
        """
        refused = facts.status == STATUS_REFUSED
        if refused and facts.reason not in REFUSAL_REASONS:
            raise ReplyError(
                "refused reply without a known reason code "
                "(prism_runtime.protocol.REFUSAL_REASONS)",
                "refusal-reason",
            )
        for name, stated, value in (
            ("mechanism", facts.mechanism, self.mechanism),
            ("sampling", facts.sampling, SAMPLING),
            ("adjacency", facts.adjacency, ADJACENCY),
        ):
            if stated != value:
                raise ReplyError(f"fact {name} is not the run's {value!r}", "facts-mismatch")
        if facts.rng not in RNG_MODES:
            raise ReplyError(f"fact rng is not one of {list(RNG_MODES)}", "facts-mismatch")
        steps = 0 if refused else self.local_steps
        if facts.steps != steps:
            raise ReplyError(
                f"reply ran {facts.steps} steps, the round asked for {steps}", "facts-mismatch"
            )
        # A refusal spent nothing: a site that refused up front never calibrated (sigma 0).
        if self.dp and not refused and not facts.sigma > 0:
            raise ReplyError("sigma = 0 for a differentially private method", "facts-mismatch")
        if self.dp and not refused and self.noise_multiplier is not None:
            sigma = facts.sigma
            if not math.isclose(sigma, self.noise_multiplier, rel_tol=_SCALE_RTOL):
                raise ReplyError(
                    f"fact sigma {sigma!r} is not the run's noise-multiplier "
                    f"{self.noise_multiplier!r}",
                    "facts-mismatch",
                )
        if self.dp and not refused:
            for label, scale, run_scale in (
                ("max-norm", facts.max_norm, self.max_norm),
                ("expected-batch-size", facts.expected_batch_size, self.expected_batch_size),
            ):
                if scale is None or (
                    run_scale is not None
                    and not math.isclose(scale, run_scale, rel_tol=_SCALE_RTOL)
                ):
                    raise ReplyError(
                        f"fact {label} is missing or not the run's {run_scale!r}", "facts-mismatch"
                    )
            q = self.sample_rate
            if q is not None and not math.isclose(facts.q, q, rel_tol=_SCALE_RTOL):
                raise ReplyError(f"fact q is not the run's sample-rate {q!r}", "facts-mismatch")
        if not refused and (facts.delta is None or facts.delta > self.delta):
            raise ReplyError(
                f"delta {facts.delta!r} is missing or above the run's {self.delta}",
                "facts-mismatch",
            )
        self._check_clip(facts)

    def _check_clip(self, facts: ReplyFacts) -> None:
        """``max-norm = auto``: an ok reply's ``max-norm`` in ``AutoClip``'s range, and a clip
        estimate's facts only on an ok reply of such a run, with the run's K steps."""
        estimate = facts.quantile
        auto = self.auto_clip
        if estimate is not None and (auto is None or facts.status != STATUS_OK):
            raise ReplyError(
                "clip-estimate facts on a refusal or in a run without max-norm = auto",
                "facts-mismatch",
            )
        if auto is None or facts.status != STATUS_OK:
            return
        if estimate is not None and estimate.steps != auto.steps:
            raise ReplyError(
                f"the clip estimate ran {estimate.steps} steps, the run asks {auto.steps}",
                "facts-mismatch",
            )
        clip = math.nan if facts.max_norm is None else facts.max_norm
        low, high = auto.low * (1 - FLOAT32_SLACK), auto.high * (1 + FLOAT32_SLACK)
        if not low <= clip <= high:
            raise ReplyError(
                f"max-norm {facts.max_norm!r} is missing or outside [{auto.low:.6g}, "
                f"{auto.high:.6g}], the clips a private estimate of this run can give",
                "facts-mismatch",
            )
