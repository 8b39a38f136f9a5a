"""The coordinator's secure-aggregation round: six exchanges, then only the sum.

The round kind of a run that sets ``secure-aggregation`` (``server.strategy.contract``); the
sites' side is ``client.secure``. A workflow: one state record (``SecureState``) and one method
per stage, each returning whether the round goes on (``SecureRound.run`` reads as the protocol).
With the round's chosen nodes (``configure_train``):

1. ``secure_advertise``: each node gets the round's field size and vector length. A site that
   refuses answers with the usual refused reply (checked, charged nothing, never asked again);
   the others answer with round keys, noise share, H and D signed by their identity key. A node
   is bound to the site its advertisement names (the sites verify the signatures against their
   pinned keys). The threshold is the least every advertiser accepts for the roster ``U1`` of
   ``n`` sites (``prism_runtime.secure_sum.least_common_threshold``: each site's
   ``t >= n - D`` and ``t > n - H + D``).
2. ``secure_share``: the threshold and its part of the roster go to every site of ``U1`` (the
   roster's sorted ids, the largest noise share, and its neighbourhood's advertisements with
   their Merkle proof: ``prism_runtime.secure_sum.CommittedRoster``); each returns its Shamir
   shares sealed for the others (for that t and roster).
3. ``secure_mask``: each site of ``U2`` (those that shared) gets the broadcast, the round's
   config and the ciphertexts sealed for it; it checks, charges, computes and answers with its
   accounting facts and its masked vector. Facts are checked and charged as in a plain round
   (the round's ``ReplyIntake``); the masked vectors are kept only until the sum is unmasked.
4. ``secure_consistency``: each survivor (``U3``: its masked input arrived) gets the survivor
   set and signs it with its participants (Bonawitz et al.'s ConsistencyCheck); the coordinator
   keeps the signatures to forward.
5. ``secure_sample``: with at least ``t`` masked inputs and ``t`` signatures, the survivors get
   the unmasking request and the root of a Merkle tree over the signatures
   (``prism_runtime.secure_sum.SignatureBook``); each draws which it checks (all, or a random
   sample under a sparse graph) and answers with its draw.
6. ``secure_unmask``: each survivor that drew gets the signatures it drew with their multiproof
   and reveals the shares that remove the masks (only for exactly the sets it signed, confirmed
   by the signatures it drew); the coordinator keeps the SUM and drops every masked vector.
   With fewer masked inputs or signatures than t, the round is ABORTED before anything is
   unmasked: nothing is released, and the charges of the sites that sent masked inputs stand
   (validate-then-charge, as in a plain round).

The sum then goes to ``server.strategy.central.CentralStep`` (PRISM's post-processing of one
central mechanism). A node asked to mask and without a valid answer is charged UNCONFIRMED, as
in a plain round; a node that never got the mask message cannot have charged and is not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from torch import Tensor

from prism_core.distributed import FIELD_BITS
from prism_runtime.facts import ReplyFacts
from prism_runtime.faults import NO_FAULTS, Faults
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    SECURE_ADVERTISE,
    SECURE_CONSISTENCY,
    SECURE_MASK,
    SECURE_SAMPLE,
    SECURE_SHARE,
    SECURE_UNMASK,
    SITE_ID,
    STATUS_OK,
    message_type,
)
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    CommittedRoster,
    MaskedSum,
    MaskingGraph,
    RoundId,
    SecureSumError,
    SignatureBook,
    UnmaskRequest,
    UnmaskResponse,
    centre,
    common_graph,
    least_common_threshold,
    plan_unmask,
)
from prism_runtime.secure_sum.messages import (
    AdvertiseRequest,
    ConsistencyRequest,
    MaskRequest,
    SampleRequest,
    ShareRequest,
    SignedUnmaskRequest,
    decode_advertise_reply,
    decode_consistency_reply,
    decode_mask_reply,
    decode_sample_reply,
    decode_share_reply,
    decode_unmask_reply,
    encode_advertise_request,
    encode_consistency_request,
    encode_mask_request,
    encode_sample_request,
    encode_share_request,
    encode_unmask_request,
)
from prism_runtime.secure_sum.site import share_too_large
from prism_runtime.secure_sum.wire import RECORD
from server.errors import ReplyError
from server.strategy.binding import SiteBinding
from server.strategy.central import CentralStep, noise_std_of
from server.strategy.contract import RoundContext
from server.strategy.intake import ReplyIntake
from server.strategy.transport import LIGHT_POLL_S, send

__all__ = ["SecureRound", "SecureState"]

log = logging.getLogger("server.strategy")

T = TypeVar("T")


@dataclass
class SecureState:
    """One secure round as it goes through its stages (``SecureRound``)."""

    round_: RoundContext
    round_id: RoundId
    config: ConfigRecord
    arrays: ArrayRecord
    nodes: list[int]
    adverts: dict[str, tuple[int, AdvertisedKeys]] = field(default_factory=dict)
    threshold: int = 0
    sparse: tuple[int, int] | None = None  # a sparse graph's degree and neighbourhood threshold
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)
    participants: frozenset[str] = frozenset()
    masked: MaskedSum | None = None  # the running sum of the masked inputs that arrived
    shares: dict[str, float] = field(default_factory=dict)  # site -> its share's sigma
    divisor: dict[str, float] = field(default_factory=dict)  # site -> its expected batch
    signatures: dict[str, bytes] = field(default_factory=dict)  # survivor -> its view's signature
    book: SignatureBook | None = None  # the signatures forwarded, committed by their root
    drawn: dict[str, tuple[int, ...]] = field(default_factory=dict)  # survivor -> what it drew
    unmask: UnmaskRequest | None = None
    answers: list[UnmaskResponse] = field(default_factory=list)

    @property
    def intake(self) -> ReplyIntake:
        return self.round_.intake

    @property
    def roster(self) -> dict[str, AdvertisedKeys]:
        return {site: keys for site, (_, keys) in self.adverts.items()}

    def node_of(self, site: str) -> int:
        return self.adverts[site][0]

    @functools.cached_property
    def committed(self) -> CommittedRoster:
        """The roster committed (its ids, the Merkle tree of its advertisements and the
        largest noise share, stated): what each site receives its part of."""
        return CommittedRoster(self.roster)

    @functools.cached_property
    def graph(self) -> MaskingGraph:
        """The masking graph every site derives from the roster, t and ``sparse`` it shared
        with (the complete graph unless ``sparse``)."""
        committed = self.committed
        degree = len(committed.ids) - 1 if self.sparse is None else self.sparse[0]
        seed = committed.seed(self.threshold, self.sparse)
        return MaskingGraph.derive(committed.ids, degree=degree, seed=seed)

    @property
    def masked_from(self) -> frozenset[str]:
        """The participants whose masked input arrived."""
        return frozenset() if self.masked is None else frozenset(self.masked.sites)


def _part(content: RecordDict) -> RecordDict:
    record = content.get(RECORD)
    if not isinstance(record, ConfigRecord):
        raise SecureSumError("the reply carries no secure-sum record")
    return RecordDict({RECORD: record})


def _with(base: dict[str, Any], secure: RecordDict) -> RecordDict:
    return RecordDict({**base, RECORD: secure[RECORD]})


def _no_masked_input(site: str, facts: ReplyFacts, msg: Message) -> Callable[[], None]:
    """The key exchange's handler: an answer there with accepted facts has no input to add."""
    raise ReplyError("update is a NoneType, not an ArrayRecord", "keys")


class SecureRound:
    """The secure-aggregation round kind (module docstring).

    Args:
        central: PRISM's step on the unmasked sum (``CentralStep``), with its moments.
        binding: the strategy's node <-> site binding (advertisements bind nodes to sites).
        min_honest_sites: the run's ``min-honest-sites`` (what the sites are asked to count on;
            each site's own H and D, signed in its advertisement, set the threshold).
        sparse_graph: the run's ``secure-graph = sparse``: a sparse masking graph that every
            site's own H and D accept (``common_graph``), where one is smaller than complete.
    """

    def __init__(
        self,
        *,
        central: CentralStep,
        binding: SiteBinding,
        min_honest_sites: int,
        sparse_graph: bool = False,
    ) -> None:
        self.central, self.binding, self.min_honest_sites = central, binding, min_honest_sites
        self.sparse_graph = sparse_graph

    def begin(self, server_round: int, broadcast: dict[str, Tensor]) -> None:
        """Nothing to prepare: the central step reads the broadcast from the mask messages."""

    def run(self, round_: RoundContext) -> ArrayRecord | None:
        """The six exchanges, then the central step on the sum (None: aborted or discarded);
        each stage's wall time is logged (``round N: secure stage NAME in S s``)."""
        state = self.start(round_)
        stages = (
            self.advertise,
            self.share_keys,
            self.collect_masked,
            self.check_consistency,
            self.sample_signatures,
            self.unmask_sum,
        )
        for stage in stages:
            started = time.monotonic()
            going = stage(state)
            log.info(
                "round %d: secure stage %s in %.2f s",
                round_.server_round,
                stage.__name__,
                time.monotonic() - started,
            )
            if not going:
                return None
        return self.step(state)

    def start(self, round_: RoundContext) -> SecureState:
        config = cast(ConfigRecord, round_.messages[0].content[CONFIG])
        arrays = cast(ArrayRecord, round_.messages[0].content[ARRAYS])
        nodes = [m.metadata.dst_node_id for m in round_.messages]
        round_.messages.clear()  # the broadcast lives on in ``arrays``
        return SecureState(
            round_=round_,
            round_id=RoundId(str(config["run-id"]), round_.server_round),
            config=config,
            arrays=arrays,
            nodes=nodes,
        )

    # -- stages ----------------------------------------------------------------------------

    def advertise(self, state: SecureState) -> bool:
        """1. Each chosen node's signed round keys, bound to the site its advertisement names."""
        ask = AdvertiseRequest(bits=FIELD_BITS, length=self.central.dim)
        contents = {
            n: _with(
                {CONFIG: state.config},
                encode_advertise_request(
                    ask, round_id=state.round_id, site_id=self.binding.site_of(n)
                ),
            )
            for n in state.nodes
        }
        binding = self.binding
        for msg in self._send(state, contents, SECURE_ADVERTISE):
            node = msg.metadata.src_node_id
            if msg.has_error() or ACCOUNTING in msg.content:  # a refusal or an error: as usual
                state.intake.take(msg, _no_masked_input)
                continue
            try:
                record = msg.content.get(RECORD)
                claimed = record.get(SITE_ID) if isinstance(record, ConfigRecord) else None
                if not isinstance(claimed, str):
                    raise SecureSumError("the advertisement names no site")
                keys = decode_advertise_reply(
                    _part(msg.content), round_id=state.round_id, site_id=claimed
                )
                bound = binding.node_site.get(node)
                owner = binding.site_node.get(claimed)
                if (bound is not None and bound != claimed) or (owner not in (None, node)):
                    raise SecureSumError(f"node {node} claims site {claimed!r}, bound elsewhere")
                if claimed in state.adverts:
                    raise SecureSumError(f"site {claimed!r} advertised twice")
                keys.trust  # noqa: B018 - raises ConfigError unless 0 <= D < H
            except (SecureSumError, ValueError, KeyError, TypeError) as exc:  # ConfigError too
                log.warning(
                    "round %d: ignoring an advertisement from node %d: %s",
                    state.round_.server_round,
                    node,
                    exc,
                )
                continue
            binding.node_site[node] = claimed
            state.adverts[claimed] = (node, keys)
        # only the nodes asked to mask can have charged themselves: the others are not charged
        binding.sent_to = {
            n: state.round_.server_round for n in state.intake.answered | state.intake.replied
        }
        trusts = [keys.trust for _, keys in state.adverts.values()]
        threshold = least_common_threshold(trusts, len(trusts)) if trusts else None
        # None: no site advertised, or one counts on more honest sites than advertised: abort
        state.threshold = len(trusts) + 1 if threshold is None else threshold
        if self.sparse_graph and threshold is not None:
            state.sparse = common_graph(trusts, len(trusts))
        refusing, refused = self._refusers(state)
        # a site that would refuse the largest share drops out at the mask stage: with fewer
        # than t others left the round cannot succeed, so it stops now, saying why
        return self._enough(
            state, len(state.adverts) - len(refusing), "sites advertised keys", why=refused
        )

    def _refusers(self, state: SecureState) -> tuple[list[str], str]:
        """The advertisers that will refuse the roster's largest noise share (above their whole
        noise: ``SiteRound.noise_share``, whose rule this is; the sites still check for
        themselves), and why, with what to set ('' when every advertiser adds it)."""
        if not state.adverts:
            return [], ""
        needy, (_, most) = max(state.adverts.items(), key=lambda item: item[1][1].noise_share)
        refusing = sorted(
            site for site, (_, keys) in state.adverts.items()
            if share_too_large(most.noise_share, keys)
        )  # fmt: skip
        if not refusing:
            return [], ""
        reason = (
            f"{', '.join(map(repr, refusing))} will refuse site {needy!r}'s noise share of "
            f"{most.noise_share:.6g}, above their whole noise: the sites' sigmas differ too much "
            "(shards of very different sizes, or different ledgers or epsilons); set sample-rate "
            "(one public q: one sigma for shards of any size), or a larger min-honest-sites "
            "(smaller shares)"
        )
        log.warning("round %d: %s", state.round_.server_round, reason)
        return refusing, reason

    def share_keys(self, state: SecureState) -> bool:
        """2. The threshold and each advertiser's part of the roster (its neighbourhood's
        advertisements with their Merkle proof); their sealed Shamir shares back."""
        degree, local = state.sparse or (0, 0)
        graph, committed = state.graph, state.committed
        contents = {
            node: _with(
                {CONFIG: state.config},
                encode_share_request(
                    ShareRequest(
                        roster=committed.part(graph.neighbourhood(site)),
                        threshold=state.threshold,
                        graph_degree=degree,
                        graph_threshold=local,
                    ),
                    round_id=state.round_id,
                    site_id=site,
                ),
            )
            for site, (node, _) in state.adverts.items()
        }
        shares = self._replies(
            state,
            contents,
            SECURE_SHARE,
            state.adverts,
            "shares",
            lambda site, part: decode_share_reply(
                part, round_id=state.round_id, site_id=site, roster=graph.neighbourhood(site)
            ),
        )
        state.sealed.update(shares)
        state.participants = frozenset(state.sealed)
        return self._enough(state, len(state.participants), "sites shared")

    def collect_masked(self, state: SecureState) -> bool:
        """3. The charged stage: each participant's facts (through the intake) and masked input."""
        contents = {}
        graph = state.graph
        for site in sorted(state.participants):
            node = state.node_of(site)
            near = graph.neighbourhood(site)
            for_site = {
                sender: state.sealed[sender][site]
                for sender in state.participants & set(near)
                if sender != site
            }
            mask_ask = MaskRequest(sealed=for_site, participants=state.participants)
            contents[node] = _with(
                {ARRAYS: state.arrays, CONFIG: state.config},
                encode_mask_request(
                    mask_ask,
                    round_id=state.round_id,
                    site_id=site,
                    roster=state.committed.ids,
                    near=near,
                ),
            )
            self.binding.sent_to[node] = state.round_.server_round
        state.sealed.clear()
        running = state.masked = MaskedSum(self.central.dim, bits=FIELD_BITS)

        def keep_masked(site: str, facts: ReplyFacts, msg: Message) -> Callable[[], None]:
            if site not in state.participants:
                raise ReplyError(f"{site!r} is not a participant of this round", "invalid")
            if facts.status != STATUS_OK:
                return lambda: None
            secure, divisor = facts.secure, facts.expected_batch_size
            if secure is None or divisor is None:  # ReplyFacts.parse and RunTerms.check
                raise ReplyError("a masked input without its Skellam facts", "facts")
            try:
                vector = decode_mask_reply(
                    _part(msg.content),
                    round_id=state.round_id,
                    site_id=site,
                    length=self.central.dim,
                    bits=FIELD_BITS,
                )
            except (SecureSumError, ValueError) as exc:
                raise ReplyError(f"masked input: {exc}", "update") from None
            share = secure.share_sigma

            def add() -> None:
                running.add(site, vector)  # one running sum: the vector is not kept
                state.shares[site] = share
                state.divisor[site] = divisor

            return add

        for msg in self._send(state, contents, SECURE_MASK, state.round_.exchange.faults):
            state.intake.take(msg, keep_masked)
            del msg
        state.intake.charge_unanswered()
        return self._enough(state, len(running.sites), "masked inputs", charged=True)

    def check_consistency(self, state: SecureState) -> bool:
        """4. Every survivor signs its participants and the survivor set; at least t signatures
        go on (the sites verify them: the coordinator holds no pinned key)."""
        request = state.unmask = plan_unmask(
            state.masked_from, participants=state.participants, threshold=state.threshold
        )
        ask = ConsistencyRequest(survivors=request.survivors)
        contents = {
            state.node_of(site): _with(
                {CONFIG: state.config},
                encode_consistency_request(
                    ask, round_id=state.round_id, site_id=site, roster=state.committed.ids
                ),
            )
            for site in sorted(request.survivors)
        }
        signatures = self._replies(
            state,
            contents,
            SECURE_CONSISTENCY,
            request.survivors,
            "signature",
            lambda site, part: decode_consistency_reply(
                part, round_id=state.round_id, site_id=site
            ),
        )
        state.signatures.update(signatures)
        if self._enough(state, len(state.signatures), "survivors signed", charged=True):
            state.book = SignatureBook(state.signatures)
            return True
        state.masked = None
        return False

    def sample_signatures(self, state: SecureState) -> bool:
        """5. The unmasking request with the root of the signatures to forward: each survivor
        draws which of them it checks (all, or a random sample under a sparse graph) and says
        which; a site that does not draw is not asked to unmask, and with fewer than t draws the
        round is aborted."""
        request, book = state.unmask, state.book
        assert request is not None and book is not None
        ask = SampleRequest(request=request, signers=frozenset(book.signers), root=book.root)
        contents = {
            state.node_of(site): _with(
                {CONFIG: state.config},
                encode_sample_request(
                    ask, round_id=state.round_id, site_id=site, roster=state.committed.ids
                ),
            )
            for site in sorted(request.survivors)
        }
        draws = self._replies(
            state,
            contents,
            SECURE_SAMPLE,
            request.survivors,
            "draw",
            lambda site, part: decode_sample_reply(
                part, round_id=state.round_id, site_id=site, forwarded=len(book.signers)
            ),
        )
        state.drawn.update(draws)
        return self._enough(state, len(state.drawn), "survivors drew", charged=True)

    def unmask_sum(self, state: SecureState) -> bool:
        """6. The survivors that drew reveal the shares that remove the masks, each for the sets
        it signed (with the signatures it drew, opened against their root, that confirm them):
        the coordinator keeps the SUM and drops every masked vector."""
        request, book = state.unmask, state.book
        assert request is not None and book is not None
        contents = {}
        for site, drawn in sorted(state.drawn.items()):
            opened, proof = book.open(drawn)
            signed = SignedUnmaskRequest(request=request, signatures=opened, proof=proof)
            contents[state.node_of(site)] = _with(
                {CONFIG: state.config},
                encode_unmask_request(
                    signed,
                    round_id=state.round_id,
                    site_id=site,
                    roster=state.committed.ids,
                    drawn=opened,
                ),
            )
        answers = self._replies(
            state,
            contents,
            SECURE_UNMASK,
            state.drawn,
            "unmasking answer",
            lambda site, part: decode_unmask_reply(
                part,
                round_id=state.round_id,
                site_id=site,
                request=request,
                near=state.graph.neighbourhood(site),
            ),
        )
        state.answers.extend(answer for _, answer in answers)
        return True

    def step(self, state: SecureState) -> ArrayRecord | None:
        """The sum, then PRISM's central step on it (``CentralStep.apply``)."""
        summary = state.intake.summary
        request = state.unmask
        assert request is not None
        running = state.masked
        assert running is not None
        try:
            total = running.unmask(
                state.answers,
                roster=state.roster,
                participants=state.participants,
                threshold=state.threshold,
                round_id=state.round_id,
                graph=state.graph,
                graph_threshold=None if state.sparse is None else state.sparse[1],
            )
        except SecureSumError as exc:
            state.masked = None
            summary.discarded = f"secure sum aborted: {exc}"
            log.warning("round %d: %s", state.round_.server_round, summary.discarded)
            return None
        survivors = sorted(request.survivors)
        state.masked = None  # from here on the coordinator holds the sum only
        expected = sum(state.divisor[s] for s in survivors)
        max_norm = self.central.max_norm
        assert max_norm is not None  # RunConfig: a secure run's clip is a number
        noise = noise_std_of(
            [state.shares[s] for s in survivors],
            max_norm=max_norm,
            expected_batch=expected,
        )
        broadcast = state.arrays.to_torch_state_dict()
        new = self.central.apply(
            broadcast, centre(total, bits=FIELD_BITS), expected_batch=expected, noise_std=noise
        )
        del total
        if not all(bool(np.isfinite(v.numpy()).all()) for v in new.values()):
            summary.discarded = "the unmasked step is not finite"
            return None
        summary.applied = True
        log.info(
            "round %d: secure sum of %d sites (%d dropped after sharing), threshold %d, "
            "masking graph degree %d",
            state.round_.server_round,
            len(survivors),
            len(request.dropped),
            state.threshold,
            state.graph.degree,
        )
        return ArrayRecord(new)

    # -- helpers ---------------------------------------------------------------------------

    def _send(
        self,
        state: SecureState,
        contents: dict[int, RecordDict],
        action: str,
        faults: Faults = NO_FAULTS,
    ) -> Iterator[Message]:
        round_ = state.round_
        # the key, share, consistency and unmask stages are milliseconds of work at a site: poll
        # them often
        light = action != SECURE_MASK
        return send(
            round_.grid,
            contents,
            message_type(action),
            timeout=round_.exchange.timeout,
            server_round=round_.server_round,
            pull_batch=round_.exchange.pull_batch,
            poll_interval=min(round_.exchange.poll_interval, LIGHT_POLL_S)
            if light
            else round_.exchange.poll_interval,
            faults=faults,
        )

    def _replies(
        self,
        state: SecureState,
        contents: dict[int, RecordDict],
        action: str,
        among: Collection[str],
        what: str,
        decode: Callable[[str, RecordDict], T],
    ) -> Iterator[tuple[str, T]]:
        """Each site of ``among`` that answers a light stage, with its reply's secure-sum
        record decoded (``decode(site, record)``); a reply that is an error, from another node,
        or that ``decode`` refuses (``SecureSumError``, ``ValueError``) is logged as ``what``
        and skipped."""
        round_number = state.round_.server_round
        for msg in self._send(state, contents, action):
            site = self.binding.site_of(msg.metadata.src_node_id)
            if site not in among or msg.has_error():
                log.warning(
                    "round %d: no %s from %s (error or unknown node)", round_number, what, site
                )
                continue
            try:
                decoded = decode(site, _part(msg.content))
            except (SecureSumError, ValueError) as exc:
                log.warning("round %d: ignoring the %s of %s: %s", round_number, what, site, exc)
                continue
            yield site, decoded

    def _enough(
        self, state: SecureState, count: int, what: str, *, charged: bool = False, why: str = ""
    ) -> bool:
        """Whether ``count`` reaches the threshold; else the round is aborted, nothing unmasked
        (the nodes asked and unanswered are charged unconfirmed unless already ``charged``);
        ``why`` is added to the reason."""
        if count >= state.threshold:
            return True
        summary = state.intake.summary
        summary.discarded = (
            f"secure sum aborted: {count} {what}, the threshold needs {state.threshold}"
            + (f" ({why})" if why else "")
        )
        log.warning("round %d: %s; nothing unmasked", state.round_.server_round, summary.discarded)
        if not charged:
            state.intake.charge_unanswered()
        return False

    def describe(self) -> str:
        graph = "sparse" if self.sparse_graph else "complete"
        return (
            f"secure aggregation, min-honest-sites={self.min_honest_sites}, {graph} masking "
            f"graph, lr={self.central.lr}"
        )

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The central step's moments (``CentralStep.state_dict``)."""
        return self.central.state_dict(), {}

    def load_state_dict(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        self.central.load_state_dict(dict(tensors))
