"""The coordinator's secure-aggregation round: four exchanges, then only the sum.

Driven from the round loop (``server.strategy.loop``) when the run sets ``secure-aggregation``;
the sites' side is ``client.secure``. With the round's chosen nodes (``configure_train``):

1. ``secure_advertise``: each node gets the round's field size and vector length. A site that
   refuses answers with the usual refused reply (checked, charged nothing, never asked again);
   the others answer with round keys signed by their identity key. A node is bound to the site
   its advertisement names (the sites verify the signatures against their pinned keys).
2. ``secure_share``: the roster ``U1`` and the threshold ``t = max(H_run, |U1| // 2 + 1)`` go to
   every site of ``U1``; each returns its Shamir shares sealed for the others.
3. ``secure_mask``: each site of ``U2`` (those that shared) gets the broadcast, the round's
   config and the ciphertexts sealed for it; it checks, charges, computes and answers with its
   accounting facts and its masked vector. Facts are checked and charged as in a plain round
   (``PrismStrategy._take``); the masked vectors are kept only until the sum is unmasked.
4. ``secure_unmask``: with at least ``t`` masked inputs, the survivors reveal the shares that
   remove the masks; the coordinator keeps the SUM and drops every masked vector. With fewer,
   the round is ABORTED before anything is unmasked: nothing is released, and the charges of the
   sites that sent masked inputs stand (validate-then-charge, as in a plain round).

The sum then goes to ``server.strategy.central.CentralStep`` (PRISM's post-processing of one
central mechanism). A node asked to mask and without a valid answer is charged UNCONFIRMED, as
in a plain round; a node that never got the mask message cannot have charged and is not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from numpy.typing import NDArray

from prism_core.distributed import FIELD_BITS
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.protocol import ACCOUNTING, ARRAYS, CONFIG, STATUS_OK
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    RoundId,
    SecureSumError,
    UnmaskResponse,
    centre,
    plan_unmask,
    unmask_sum,
)
from prism_runtime.secure_sum.messages import (
    AdvertiseRequest,
    MaskRequest,
    ShareRequest,
    decode_advertise_reply,
    decode_mask_reply,
    decode_share_reply,
    decode_unmask_reply,
    encode_advertise_request,
    encode_mask_request,
    encode_share_request,
    encode_unmask_request,
)
from prism_runtime.secure_sum.wire import RECORD
from server.errors import ReplyError
from server.strategy.central import noise_std_of
from server.strategy.loop import stream_replies

__all__ = ["LIGHT_POLL_S", "secure_round"]

log = logging.getLogger("server.strategy")

LIGHT_POLL_S = 0.05
"""Seconds between polls in the key, share and unmask exchanges (the sites answer them at once)."""


def _part(content: RecordDict) -> RecordDict:
    record = content.get(RECORD)
    if not isinstance(record, ConfigRecord):
        raise SecureSumError("the reply carries no secure-sum record")
    return RecordDict({RECORD: record})


def _send(
    grid: Grid,
    contents: dict[int, RecordDict],
    action: str,
    *,
    timeout: float,
    poll_interval: float,
    server_round: int,
    faults: Faults = NO_FAULTS,
) -> Iterable[Message]:
    messages = [
        Message(content=c, message_type=f"train.{action}", dst_node_id=n)
        for n, c in sorted(contents.items())
    ]
    return stream_replies(
        grid,
        messages,
        timeout=timeout,
        poll_interval=poll_interval,
        server_round=server_round,
        faults=faults,
    )


def _with(base: dict[str, Any], secure: RecordDict) -> RecordDict:
    return RecordDict({**base, RECORD: secure[RECORD]})


def secure_round(
    strategy: Any,
    grid: Grid,
    messages: list[Message],
    *,
    server_round: int,
    timeout: float,
    poll_interval: float,
    faults: Faults = NO_FAULTS,
) -> tuple[ArrayRecord | None, MetricRecord]:
    """One secure-aggregation round (module docstring) from ``configure_train``'s messages;
    returns the next global arrays (None: nothing applied) and the round's metrics."""
    from server.strategy.core import _Tally  # the plain round's per-round bookkeeping

    summary = strategy.summaries[-1]
    tally = _Tally()
    config = cast(ConfigRecord, messages[0].content[CONFIG])
    arrays = cast(ArrayRecord, messages[0].content[ARRAYS])
    nodes = [m.metadata.dst_node_id for m in messages]
    del messages
    run_id = str(config["run-id"])
    round_id = RoundId(run_id, server_round)
    central = strategy.central
    binding = strategy.binding

    def send(
        contents: dict[int, RecordDict], action: str, stage_faults: Faults = NO_FAULTS
    ) -> Iterable[Message]:
        # the key, share and unmask stages are milliseconds of work at a site: poll them often
        light = action != "secure_mask"
        return _send(
            grid,
            contents,
            action,
            timeout=timeout,
            poll_interval=min(poll_interval, LIGHT_POLL_S) if light else poll_interval,
            server_round=server_round,
            faults=stage_faults,
        )

    def abort(why: str) -> tuple[None, MetricRecord]:
        summary.discarded = f"secure sum aborted: {why}"
        log.warning("round %d: secure sum aborted (%s); nothing unmasked", server_round, why)
        strategy._charge_unanswered(server_round, tally, summary)
        return None, strategy._metrics(summary)

    # 1. keys -------------------------------------------------------------------------------
    ask = AdvertiseRequest(bits=FIELD_BITS, length=central.dim)
    contents = {
        n: _with(
            {CONFIG: config},
            encode_advertise_request(ask, round_id=round_id, site_id=binding.site_of(n)),
        )
        for n in nodes
    }
    adverts: dict[str, tuple[int, AdvertisedKeys]] = {}
    for msg in send(contents, "secure_advertise"):
        node = msg.metadata.src_node_id
        if msg.has_error() or ACCOUNTING in msg.content:  # a refusal or an error: as usual
            strategy._take(server_round, msg, tally, summary)
            continue
        try:
            record = msg.content.get(RECORD)
            claimed = record.get("site-id") if isinstance(record, ConfigRecord) else None
            if not isinstance(claimed, str):
                raise SecureSumError("the advertisement names no site")
            keys = decode_advertise_reply(_part(msg.content), round_id=round_id, site_id=claimed)
            bound = binding.node_site.get(node)
            owner = binding.site_node.get(claimed)
            if (bound is not None and bound != claimed) or (owner not in (None, node)):
                raise SecureSumError(f"node {node} claims site {claimed!r}, bound elsewhere")
            if claimed in adverts:
                raise SecureSumError(f"site {claimed!r} advertised twice")
        except (SecureSumError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "round %d: ignoring an advertisement from node %d: %s", server_round, node, exc
            )
            continue
        binding.node_site[node] = claimed
        adverts[claimed] = (node, keys)
    threshold = max(strategy.min_honest_sites, len(adverts) // 2 + 1)
    # only the nodes asked to mask can have charged themselves: the others are not charged
    binding.sent_to = {n: server_round for n in tally.answered | tally.replied}
    if len(adverts) < threshold:
        return abort(f"{len(adverts)} sites advertised keys, the threshold needs {threshold}")

    # 2. shares -----------------------------------------------------------------------------
    roster = {site: keys for site, (_, keys) in adverts.items()}
    share_ask = ShareRequest(roster=roster, threshold=threshold)
    contents = {
        node: _with(
            {CONFIG: config}, encode_share_request(share_ask, round_id=round_id, site_id=site)
        )
        for site, (node, _) in adverts.items()
    }
    sealed: dict[str, dict[str, bytes]] = {}
    for msg in send(contents, "secure_share"):
        site = binding.site_of(msg.metadata.src_node_id)
        if site not in adverts or msg.has_error():
            log.warning("round %d: no shares from %s (error or unknown node)", server_round, site)
            continue
        try:
            sealed[site] = decode_share_reply(
                _part(msg.content), round_id=round_id, site_id=site, roster=list(roster)
            )
        except (SecureSumError, ValueError) as exc:
            log.warning("round %d: ignoring the shares of %s: %s", server_round, site, exc)
    participants = frozenset(sealed)
    if len(participants) < threshold:
        return abort(f"{len(participants)} sites shared, the threshold needs {threshold}")

    # 3. masked inputs (the charged round) ----------------------------------------------------
    contents = {}
    for site in sorted(participants):
        node = adverts[site][0]
        for_site = {sender: sealed[sender][site] for sender in participants if sender != site}
        mask_ask = MaskRequest(sealed=for_site, participants=participants)
        contents[node] = _with(
            {ARRAYS: arrays, CONFIG: config},
            encode_mask_request(mask_ask, round_id=round_id, site_id=site),
        )
        binding.sent_to[node] = server_round
    del sealed
    masked: dict[str, NDArray[np.uint64]] = {}
    shares: dict[str, float] = {}
    divisor: dict[str, float] = {}

    def keep(site: str, facts: dict[str, Any], msg: Message) -> None:
        if site not in participants:
            raise ReplyError(f"{site!r} is not a participant of this round", "invalid")
        if facts["status"] != STATUS_OK:
            return
        try:
            vector = decode_mask_reply(
                _part(msg.content),
                round_id=round_id,
                site_id=site,
                length=central.dim,
                bits=FIELD_BITS,
            )
        except (SecureSumError, ValueError) as exc:
            raise ReplyError(f"masked input: {exc}", "update") from None
        masked[site] = vector
        shares[site] = float(facts["share-sigma"])
        divisor[site] = float(facts["expected-batch-size"])

    for msg in send(contents, "secure_mask", faults):
        strategy._take(server_round, msg, tally, summary, secure=keep)
        del msg
    strategy._charge_unanswered(server_round, tally, summary)
    if len(masked) < threshold:
        summary.discarded = (
            f"secure sum aborted: {len(masked)} masked inputs, the threshold needs {threshold}"
        )
        log.warning("round %d: %s; nothing unmasked", server_round, summary.discarded)
        return None, strategy._metrics(summary)

    # 4. unmask -------------------------------------------------------------------------------
    request = plan_unmask(masked, participants=participants, threshold=threshold)
    contents = {
        adverts[site][0]: _with(
            {CONFIG: config}, encode_unmask_request(request, round_id=round_id, site_id=site)
        )
        for site in sorted(request.survivors)
    }
    answers: list[UnmaskResponse] = []
    for msg in send(contents, "secure_unmask"):
        site = binding.site_of(msg.metadata.src_node_id)
        if site not in request.survivors or msg.has_error():
            continue
        try:
            answers.append(
                decode_unmask_reply(
                    _part(msg.content), round_id=round_id, site_id=site, request=request
                )
            )
        except (SecureSumError, ValueError) as exc:
            log.warning(
                "round %d: ignoring the unmasking answer of %s: %s", server_round, site, exc
            )
    try:
        total = unmask_sum(
            masked,
            answers,
            roster=roster,
            participants=participants,
            threshold=threshold,
            bits=FIELD_BITS,
            round_id=round_id,
        )
    except SecureSumError as exc:
        masked.clear()
        summary.discarded = f"secure sum aborted: {exc}"
        log.warning("round %d: %s", server_round, summary.discarded)
        return None, strategy._metrics(summary)
    survivors = sorted(request.survivors)
    masked.clear()  # from here on the coordinator holds the sum only
    expected = sum(divisor[s] for s in survivors)
    noise = noise_std_of(
        [shares[s] for s in survivors], max_norm=central.max_norm, expected_batch=expected
    )
    broadcast = arrays.to_torch_state_dict()
    new = central.apply(
        broadcast, centre(total, bits=FIELD_BITS), expected_batch=expected, noise_std=noise
    )
    del total
    if not all(bool(np.isfinite(v.numpy()).all()) for v in new.values()):
        summary.discarded = "the unmasked step is not finite"
        return None, strategy._metrics(summary)
    summary.applied = True
    log.info(
        "round %d: secure sum of %d sites (%d dropped after sharing), threshold %d",
        server_round,
        len(survivors),
        len(request.dropped),
        threshold,
    )
    return ArrayRecord(new), strategy._metrics(summary)
