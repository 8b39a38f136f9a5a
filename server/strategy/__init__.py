"""The coordinator's strategy, in parts:

- ``core``: ``PrismStrategy``, the Flower strategy: selection (``selection``: sites that can
  still run within their caps, ``connect-timeout``), ``binding`` (node <-> site, round and
  nonce), and one round kind; ``PrismStrategy.from_run`` builds every part from a validated run
  config and picks the kind.
- ``contract``: what a round kind offers the loop (``RoundKind``, ``RoundContext``);
  ``plain`` (``PlainRound``: one exchange, ``bounds`` checks each update, ``aggregator`` keeps
  Flower-free weighted streaming sums and takes the server step) and ``secure``
  (``SecureRound``: six exchanges, only the sum, ``central``'s PRISM step on it).
- ``intake``: ``ReplyIntake``, every reply's way in, whatever the kind: ``replies`` (typed
  facts, error replies by code, the facts against the run's terms), ``binding``, ``charges``
  (confirmed and unconfirmed ledger charges).
- ``transport``: push a round's messages, stream their replies; ``loop``: the round loop of
  ``PrismStrategy.start``; ``rounds``: the per-round summary.

See ``plain`` for the mathematics of the tangent aggregation and the factor-averaging baselines.
"""

from server.strategy.aggregator import StreamingAggregator
from server.strategy.bounds import AutoClip, UpdateBound, UpdateChecker
from server.strategy.contract import RoundContext, RoundKind
from server.strategy.core import PrismStrategy
from server.strategy.intake import ReplyIntake
from server.strategy.plain import PlainRound
from server.strategy.replies import RunTerms, error_reply_text, read_facts
from server.strategy.rounds import RoundSummary
from server.strategy.secure import SecureRound

__all__ = [
    "AutoClip",
    "PlainRound",
    "PrismStrategy",
    "ReplyIntake",
    "RoundContext",
    "RoundKind",
    "RoundSummary",
    "RunTerms",
    "SecureRound",
    "StreamingAggregator",
    "UpdateBound",
    "UpdateChecker",
    "error_reply_text",
    "read_facts",
]
