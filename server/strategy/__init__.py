"""The coordinator's strategy, in parts:

- ``core``: ``PrismStrategy``, the Flower strategy that wires the parts: selection (sites that can
  still run within their caps, ``connect-timeout``), then per reply, in order: ``replies`` (typed
  facts, error replies by code, the facts against the run's terms), ``binding`` (node <-> site,
  round and nonce), ``charges`` (confirmed and unconfirmed ledger charges), ``bounds`` (what an
  honest update can be), ``aggregator`` (Flower-free weighted streaming sums and the server step).
  ``PrismStrategy.from_run`` builds it from a validated run config.
- ``rounds``: the per-round summary; ``loop``: the round loop of ``PrismStrategy.start``.

See ``core`` for the mathematics of the tangent aggregation and the factor-averaging baselines.
"""

from server.strategy.aggregator import StreamingAggregator
from server.strategy.bounds import AutoClip, UpdateBound, UpdateChecker
from server.strategy.core import PrismStrategy
from server.strategy.replies import RunTerms, error_reply_text, validate_facts
from server.strategy.rounds import RoundSummary

__all__ = [
    "AutoClip",
    "PrismStrategy",
    "RoundSummary",
    "RunTerms",
    "StreamingAggregator",
    "UpdateBound",
    "UpdateChecker",
    "error_reply_text",
    "validate_facts",
]
