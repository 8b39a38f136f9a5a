"""Test helper: the facts an honest site's reply states (its ``ACCOUNTING`` record).

One definition for the server tests, which each wrote the whole dict out before. Keywords
change a fact (underscores for the hyphens of the fact names: ``max_norm`` is ``max-norm``);
``None`` leaves the fact out, as a site that does not send it. ``honest_reply_facts`` is the same
record as the coordinator reads it (``ReplyFacts.parse``), for the strategy's parts that take the
typed facts.
"""

from __future__ import annotations

from typing import Any

from prism_runtime.facts import ReplyFacts
from prism_runtime.protocol import ROUND_NONCE, SERVER_ROUND

HONEST_FACTS: dict[str, Any] = {
    "status": "ok",
    "reason": "",
    "mechanism": "prism-tangent-gaussian",
    "adjacency": "add-remove",
    "sampling": "poisson",
    "sigma": 1.0,
    "q": 0.05,
    "max-norm": 0.05,
    "expected-batch-size": 16.0,
    "steps": 1,
    "delta": 1e-5,
    "epsilon-cap": 100.0,
    "epsilon": 0.5,
    "rng": "os-csprng",
}


def honest_facts(site_id: str, config: Any = None, **changes: Any) -> dict[str, Any]:
    """``HONEST_FACTS`` for ``site_id`` with ``changes``; with the request's ``config``, the
    round and its nonce echoed as an honest site's ClientApp does."""
    facts: dict[str, Any] = {"site-id": site_id, **HONEST_FACTS}
    if config is not None:
        facts.update({SERVER_ROUND: config[SERVER_ROUND], ROUND_NONCE: config[ROUND_NONCE]})
    facts.update({name.replace("_", "-"): value for name, value in changes.items()})
    return {name: value for name, value in facts.items() if value is not None}


def honest_reply_facts(site_id: str = "site-a", config: Any = None, **changes: Any) -> ReplyFacts:
    """``honest_facts`` parsed as the coordinator reads them (``ReplyFacts.parse``)."""
    return ReplyFacts.parse(honest_facts(site_id, config, **changes))
