"""What a trained round releases: its DP update and its facts, built from what ran.

The facts come from the mechanism's own records (``PrivacyEvent``, one per step, composed into
one event by ``client.reply.released_event``) and must agree with the charge made before the
steps ran (``client.charge.check_charged``), else the round fails and nothing is sent. The update
is the tangent displacement at the broadcast point (PRISM,
``prism_core.manifold.tangent_displacement``) or the end factors (the baselines), plus the DP
head; with ``step-at = coordinator`` it is the step's own release (``released_gradient``). The
un-noised training loss is added only when the run asks and the site allows it, labelled
non-private.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from client.charge import check_charged
from client.reply import RoundReply, SiteFacts, noise_scales, released_event
from client.request import RoundRequest
from client.site_ledger import SiteLedgerEntry
from client.training import Trained
from prism_core.manifold import Point, tangent_displacement
from prism_core.mechanism import PrivateStep
from prism_core.records import PrivacyEvent
from prism_runtime.errors import AccountingMismatchError
from prism_runtime.exchange import head_named
from prism_runtime.facts import ReplyFacts
from prism_runtime.model import LoadedModel
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.trainer import StepResult, noise_records

__all__ = ["release", "released_facts", "released_gradient", "update"]


def release(
    trained: Trained,
    charged: SiteLedgerEntry,
    request: RoundRequest,
    *,
    facts: SiteFacts,
    spent: float,
    quantile: PrivacyEvent | None,
    loaded: LoadedModel,
    method: str,
    report_train_loss: bool,
) -> RoundReply:
    """The reply to a trained round.

    Args:
        trained: what the round's steps produced.
        charged: the round's charge.
        request: the round's request (the broadcast the update is taken at).
        facts: the site's facts for this run.
        spent: epsilon on the site's ledger, this round's charges included.
        quantile: the event of a private clip estimate charged this round, or None.
        loaded: the site's model (its LoRA modules and DP head).
        method: the site's trainer method (``prism_runtime.config.site_method``).
        report_train_loss: add the un-noised mean training loss (the site's policy allowed it).

    Raises:
        AccountingMismatchError: the mechanism's records do not match the charge.
    """
    out = released_facts(
        trained.results,
        charged,
        facts=facts,
        spent=spent,
        quantile=quantile,
        private=method != "nondp",
    )
    if trained.released is not None:
        arrays = released_gradient(loaded, trained.released)
    else:
        arrays = update(
            loaded, request.arrays, trained.start, trained.end, tangent=method == "prism"
        )
    reply = RoundReply(arrays, out)
    if report_train_loss:
        results = trained.results
        reply.nonprivate["nonprivate-train-loss"] = sum(r.loss for r in results) / len(results)
    return reply


def released_facts(
    results: Sequence[StepResult],
    charged: SiteLedgerEntry,
    *,
    facts: SiteFacts,
    spent: float,
    quantile: PrivacyEvent | None,
    private: bool,
) -> ReplyFacts:
    """Facts of a trained round, from the mechanism's records, checked against the charge.

    Args:
        results: the round's ``StepResult``s.
        charged: the round's charge.
        facts: the site's facts for this run.
        spent: epsilon on the site's ledger, this round's charges included.
        quantile: the event of a private clip estimate charged this round (its own facts).
        private: False for a non-private run, whose steps record nothing.

    Raises:
        AccountingMismatchError: records where none may be, or records that are not the charge.
    """
    records = noise_records(results)
    if not private:  # no mechanism ran: nothing protects the data
        if records:
            raise AccountingMismatchError("a non-private round returned noise records")
        event = PrivacyEvent(
            0.0, facts.sample_rate, len(results), mechanism=facts.mechanism, unit=facts.unit
        )
    else:
        event = released_event(records, facts.mechanism)
    check_charged(event, charged, what="the mechanism", site_id=facts.site_id)
    return facts.released(
        charged.server_round,
        event,
        spent=spent,
        scales=noise_scales(records),
        quantile=quantile,
    )


def update(
    loaded: LoadedModel,
    broadcast: dict[str, Tensor],
    start: list[Point],
    end: list[Point],
    *,
    tangent: bool,
) -> dict[str, Tensor]:
    """What the site sends: the tangent update at ``start`` (``tangent``, PRISM) or the end
    factors (the baselines), and the DP head's change from the broadcast (PRISM) or its end
    value, all float32 and contiguous."""
    out: dict[str, Tensor] = {}
    for h, s, e in zip(loaded.handles, start, end, strict=True):
        if tangent:
            d = tangent_displacement(s.A, s.B, e.A, e.B)
            out[key(h.name, "dA")], out[key(h.name, "dB")] = d.dA.float(), d.dB.float()
        else:
            out[key(h.name, "A")], out[key(h.name, "B")] = e.A.float(), e.B.float()
    for name, param in head_named(loaded):
        value = param.detach().float().cpu()
        out[HEAD_PREFIX + name] = (
            value - broadcast[HEAD_PREFIX + name].float() if tangent else value
        )
    return {k: v.contiguous() for k, v in out.items()}


def released_gradient(loaded: LoadedModel, released: PrivateStep) -> dict[str, Tensor]:
    """What a site sends when the coordinator takes the step (``step-at = coordinator``): the
    release of its one step at the broadcast point, the min-norm lift of the noisy mean
    tangent ``(dA, dB)`` of every module (under the update's ``dA``/``dB`` keys) and the DP
    head's noisy mean gradient, all float32 and contiguous. Nothing else of the step leaves."""
    out: dict[str, Tensor] = {}
    for h, t in zip(loaded.handles, released.tangents, strict=True):
        out[key(h.name, "dA")] = t.dA.detach().float().cpu()
        out[key(h.name, "dB")] = t.dB.detach().float().cpu()
    for (name, _), grad in zip(head_named(loaded), released.euclidean, strict=True):
        out[HEAD_PREFIX + name] = grad.detach().float().cpu()
    return {k: v.contiguous() for k, v in out.items()}
