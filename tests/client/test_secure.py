"""A site's secure stages against a coordinator that lies (client.secure, through the ClientApp).

Each test plays one attack class with deployed sites answering through the real ClientApp and
a coordinator that writes its own messages (``helpers.secure_federation``): inconsistent
participant and survivor views with no colluder; "dropped to some, survived to others" with
t - 1 colluders under the old majority rule; an honest site dropping after sharing beyond what
the others tolerate; a lost node state followed by a re-sent mask request; an unpinned or
coordinator-written peer key; an oversized noise share. Each ends by TRYING to read one honest
site's input with every share the coordinator obtained and its colluders' secrets
(``Adversary.recover``): it must fail, and every honest site's ledger must hold exactly the
charges its replies stated. A control shows the recovery succeeds where the site's own policy
allows it (H - D = 1: its charge is its own share's), exactly, so a failure above is the
protocol's doing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.supercore.task_identity import TaskIdentity
from helpers.secure_federation import ROUND, Adversary, Federation, Reply, run_config

import client.masked_input as masked_input_module
from prism_core.distributed import FIELD_BITS
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    CommittedRoster,
    MaskingGraph,
    RoundTrust,
    UnmaskRequest,
    UnmaskResponse,
    centre,
    common_graph,
    least_common_threshold,
    sample_size,
    unmask_sum,
)
from prism_runtime.secure_sum.messages import decode_unmask_reply

FIELD = (1 << FIELD_BITS) - 1


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


@pytest.fixture
def inputs(monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """Every honest site's encoded input (its rounded clipped sum plus its noise share, before
    the masks), in the order the sites masked: what the coordinator must never read alone."""
    seen: list[np.ndarray] = []
    encode = masked_input_module.encode_signed

    def recording(*args: Any, **kwargs: Any) -> Any:
        encoded = encode(*args, **kwargs)
        seen.append(encoded.copy())
        return encoded

    monkeypatch.setattr(masked_input_module, "encode_signed", recording)
    return seen


@dataclass
class Played:
    """What the lying coordinator got from one round, stage by stage."""

    fed: Federation
    length: int
    arrays: Any
    roster: dict[str, AdvertisedKeys] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)
    participants: dict[str, frozenset[str]] = field(default_factory=dict)
    masked: dict[str, np.ndarray] = field(default_factory=dict)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    signatures: dict[str, bytes] = field(default_factory=dict)
    revealed: list[UnmaskResponse] = field(default_factory=list)
    codes: dict[str, dict[str, int]] = field(default_factory=dict)

    def refused(self, stage: str, site: str, reply: Reply) -> bool:
        if reply.code is None:
            return False
        self.codes.setdefault(stage, {})[site] = reply.code
        return True

    def adversary(self, threshold: int) -> Adversary:
        return Adversary(self.roster, threshold, self.fed.colluders, self.revealed)


def play(
    fed: Federation,
    *,
    threshold: int,
    colluder_share: float | None = None,
    colluder_trust: RoundTrust | None = None,
) -> Played:
    """Advertise (``advertise``), then share with every site at the coordinator's
    ``threshold`` (``share_keys``)."""
    game = advertise(fed, colluder_share=colluder_share, colluder_trust=colluder_trust)
    share_keys(game, threshold)
    return game


def advertise(
    fed: Federation,
    *,
    colluder_share: float | None = None,
    colluder_trust: RoundTrust | None = None,
) -> Played:
    """Every site's signed keys; the colluders advertise ``colluder_share`` (default: the
    honest sites' largest share) and ``colluder_trust`` (default: every roster site honest, a
    minority missing: they accept any majority threshold)."""
    arrays, length = fed.broadcast()
    game = Played(fed, length, arrays)
    for site in sorted(fed.honest):
        reply = fed.advertise(site, length)
        assert reply.code is None, reply.code
        game.roster[site] = fed.keys_of(reply, site)
    share = max(k.noise_share for k in game.roster.values())
    sites = len(fed.honest) + len(fed.colluders)
    trust = colluder_trust or RoundTrust(sites, (sites - 1) // 2)
    for site, colluder in fed.colluders.items():
        chosen = share if colluder_share is None else colluder_share
        game.roster[site] = colluder.start(noise_share=chosen, trust=trust)
    return game


def share_keys(game: Played, threshold: int) -> None:
    fed = game.fed
    for site in sorted(fed.honest):
        reply = fed.share(site, game.roster, threshold)
        if not game.refused("share", site, reply):
            game.sealed[site] = fed.sealed_of(reply, site, game.roster)
    if game.sealed:
        for site, colluder in fed.colluders.items():
            assert colluder.round is not None
            game.sealed[site] = colluder.round.share(
                game.roster, registered=fed.registered, threshold=threshold
            )


def mask(game: Played, participants: dict[str, Iterable[str]]) -> None:
    """Each site masks with the participants the coordinator tells it (colluders: zeros)."""
    fed = game.fed
    for site, told in participants.items():
        game.participants[site] = frozenset(told)
        if site in fed.colluders:
            colluder = fed.colluders[site]
            assert colluder.round is not None
            colluder.round.receive({s: game.sealed[s][site] for s in told if s != site})
            zeros = np.zeros(game.length, dtype=np.uint64)
            game.masked[site] = colluder.round.mask(zeros, participants=told)
            continue
        reply = fed.mask(site, game.sealed, told, game.arrays)
        if game.refused("mask", site, reply):
            continue
        game.facts[site] = reply.facts
        game.masked[site] = fed.masked_of(reply, site, game.length)


def sign(game: Played, survivors: dict[str, Iterable[str]]) -> None:
    """Each site signs the survivors the coordinator tells it; colluders sign anything."""
    fed = game.fed
    for site, told in survivors.items():
        if site in fed.colluders:
            continue
        reply = fed.consistency(site, told)
        if not game.refused("consistency", site, reply):
            game.signatures[site] = fed.signature_of(reply, site)


def unmask(game: Played, survivors: dict[str, Iterable[str]]) -> None:
    """Each site is asked for its shares with the survivors it is told and every signature of
    those survivors the coordinator has (its colluders' on the view told to that site)."""
    fed = game.fed
    for site, told in survivors.items():
        if site in fed.colluders:
            continue
        view = frozenset(told)
        participants = game.participants.get(site, frozenset(game.roster))
        dropped = participants - view
        forged = {c: fed.colluders[c].sign(participants, view) for c in fed.colluders}
        signatures = {s: v for s, v in {**game.signatures, **forged}.items() if s in view}
        reply = fed.unmask(site, view, dropped, signatures)
        if not game.refused("unmask", site, reply):
            request = UnmaskRequest(view, dropped)
            game.revealed.append(fed.shares_of(reply, site, request))


def assert_charged_as_stated(game: Played) -> None:
    """Every honest site's ledger holds one charge per masked reply it sent, with the noise and
    share that reply stated, and nothing for a round it refused."""
    for site in game.fed.honest:
        lines = game.fed.ledger_lines(site)
        if site not in game.facts:
            assert lines == [], site
            continue
        (line,) = lines
        facts = game.facts[site]
        assert (line["sigma"], line["share_sigma"], line["steps"]) == (
            facts["sigma"],
            facts["share-sigma"],
            1,
        ), site


# -- inconsistent views, no colluder -------------------------------------------------------------

FIVE = ("a", "b", "c", "d", "e")


@pytest.mark.parametrize("honest", [2, 3])
def test_a_threshold_below_the_condition_is_refused_before_anything_is_shared(
    tiny_bert, tmp_path, honest
):
    """Five sites counting on H = 2 (or 3) honest ones: t = 3 (the old majority) is refused by
    every site (t >= n - D = 5 is needed), nothing is shared or charged."""
    node = {"min-honest-sites": honest}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in FIVE})
    game = play(fed, threshold=3)
    assert game.codes["share"] == {s: 4010 for s in FIVE}
    assert game.sealed == {}
    assert game.adversary(3).secret("a", "seed") is None
    assert_charged_as_stated(game)


def test_inconsistent_participant_and_survivor_views_reveal_nothing(tiny_bert, tmp_path, inputs):
    """No colluder; five sites that count on all five being honest and tolerate two missing
    accept t = 3. The coordinator tells a that the participants are a, b, c and everyone else
    that all five are; at the consistency check d and e are told b and c dropped, b that c
    dropped, c that b dropped, a that a, b, c survived (the attack that rebuilt a's seed and b's
    and c's mask keys). Every site signs its own view, no view has t = 3 signatures, and every
    site refuses to unmask (4012): no share is revealed and a's input stays masked."""
    node = {"min-honest-sites": 5, "secure-max-dropouts": 2}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in FIVE})
    game = play(fed, threshold=3)
    assert "share" not in game.codes
    everyone = set(FIVE)
    mask(game, {"a": {"a", "b", "c"}, **{s: everyone for s in "bcde"}})
    assert set(game.masked) == everyone  # a masked with b and c only: 2 missing <= D
    views = {
        "a": {"a", "b", "c"},
        "b": everyone - {"c"},
        "c": everyone - {"b"},
        "d": {"a", "d", "e"},
        "e": {"a", "d", "e"},
    }
    sign(game, views)
    assert set(game.signatures) == everyone  # each view is its site's own to sign
    unmask(game, views)
    assert game.codes["unmask"] == {s: 4012 for s in FIVE}
    assert game.revealed == []
    adversary = game.adversary(3)
    assert adversary.recover("a", game.masked["a"], game.participants["a"]) is None
    assert all(adversary.secret(s, kind) is None for s in FIVE for kind in ("seed", "key"))
    assert len(inputs) == 5
    assert_charged_as_stated(game)


# -- dropped to some, survived to others, t - 1 colluders ----------------------------------------

HONEST = ("a", "b", "c")
COLLUDERS = ("x", "y")


def test_dropped_to_some_survived_to_others_isolates_no_input(tiny_bert, tmp_path, inputs):
    """Three honest sites counting on H = 3 of five (so up to two colluders, x and y) and
    tolerating D = 1 missing. The old rule t = n // 2 + 1 = 3 is refused (t - 1 = 2 colluders
    plus one honest answer would reach it); at t = 4 the coordinator tells a and c that b
    dropped and b that c dropped (with t = 3 this rebuilt a's seed and b's and c's mask keys).
    a and c share a view and reveal; b's view has 3 signatures and it refuses. The coordinator
    gets the sum of a, c and its colluders, which holds H - D = 2 honest inputs, and cannot
    remove a's pairwise mask with c: a's input alone stays hidden."""
    node = {"min-honest-sites": 3, "secure-max-dropouts": 1}
    fed = Federation.build(
        tmp_path, run_config(tiny_bert), {s: node for s in HONEST}, colluders=COLLUDERS
    )
    game = play(fed, threshold=3)
    assert game.codes["share"] == {s: 4010 for s in HONEST}  # t - c = 1 <= D: refused
    share_keys(game, 4)  # the same round, the least threshold every site accepts
    everyone = set(HONEST) | set(COLLUDERS)
    mask(game, {s: everyone for s in sorted(everyone)})
    assert set(game.masked) == everyone
    views = {
        "a": everyone - {"b"},
        "c": everyone - {"b"},
        "b": everyone - {"c"},
        **{x: everyone for x in COLLUDERS},
    }
    sign(game, views)
    unmask(game, views)
    assert game.codes["unmask"] == {"b": 4012}
    assert sorted(r.site_id for r in game.revealed) == ["a", "c"]
    adversary = game.adversary(4)
    for target in HONEST:
        assert adversary.recover(target, game.masked[target], everyone) is None, target
    assert adversary.secret("a", "seed") is not None  # a survived: its seed was revealed
    assert adversary.secret("b", "key") is not None  # b "dropped" for a and c
    assert adversary.secret("c", "key") is None  # b refused: c's mask stays
    # what the coordinator does get is the sum of the view a and c signed, exactly
    survivors = frozenset(views["a"])
    request = UnmaskRequest(survivors, frozenset(everyone) - survivors)
    forged = {x: fed.colluders[x].sign(everyone, survivors) for x in COLLUDERS}
    colluder_answers = [
        fed.colluders[x].answer(request, {**game.signatures, **forged}, fed.registered)
        for x in COLLUDERS
    ]
    total = unmask_sum(
        {s: game.masked[s] for s in survivors},
        [*game.revealed, *colluder_answers],
        roster=game.roster,
        participants=everyone,
        threshold=4,
        bits=FIELD_BITS,
        round_id=ROUND,
    )
    order = sorted(HONEST)  # the sites masked in this order: a, b, c
    expected = (inputs[order.index("a")] + inputs[order.index("c")]) & np.uint64(FIELD)
    np.testing.assert_array_equal(total, expected)
    assert np.abs(centre(total, bits=FIELD_BITS)).max() > 0  # a sum that carries something
    assert_charged_as_stated(game)


# -- an honest site dropping after sharing, beyond D ---------------------------------------------


@pytest.mark.parametrize("declared", [False, True], ids=["drops", "declared-dropped"])
def test_an_honest_site_missing_beyond_d_stops_the_others_revealing(tiny_bert, tmp_path, declared):
    """Three sites, a and b honest (H = 2, D = 0: t = 3), x colluding. b drops after sharing,
    or masks and is declared dropped to a: the sum of a and x alone would pass a check that
    counts the sites ASKED. a refuses to sign a survivor set missing b (4011); b, told that all
    three survived, has its view signed by itself and x only (4012; without a masked input it
    has nothing to sign, 4013): neither reveals anything and a's input stays masked. a was
    charged once, at the share for H - D = 2 honest inputs its reply stated."""
    fed = Federation.build(
        tmp_path,
        run_config(tiny_bert),
        {s: {"min-honest-sites": 2} for s in ("a", "b")},
        colluders=["x"],
    )
    game = play(fed, threshold=3, colluder_trust=RoundTrust(2, 0))
    everyone = {"a", "b", "x"}
    mask(game, {s: everyone for s in ("a", "x", "b") if declared or s != "b"})
    views = {"a": {"a", "x"}, "b": everyone}  # a is told b dropped; b that all survived
    sign(game, views)
    assert game.codes["consistency"] == ({"a": 4011} if declared else {"a": 4011, "b": 4013})
    unmask(game, views)
    assert game.codes["unmask"] == {"a": 4012, "b": 4012}  # neither signed the view it is asked
    assert game.revealed == []
    adversary = game.adversary(3)
    assert adversary.recover("a", game.masked["a"], everyone) is None
    assert_charged_as_stated(game)
    assert game.facts["a"]["honest-sites"] == 2


# -- a lost node state and a re-sent mask request ------------------------------------------------


def test_a_resent_mask_request_after_a_lost_state_is_refused_never_masked_again(
    tiny_bert, tmp_path, inputs
):
    """The node's state is saved only after the reply left; if that save is lost (or the site
    restarts), the coordinator re-sends the mask request: the site refuses it (4013) from its
    durable record, charges nothing more and masks nothing again, so the coordinator never
    holds two inputs under the same masks. A re-sent share request after a lost save is
    refused the same way; the round's later stages still run from the record."""
    node = {"min-honest-sites": 3}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in HONEST})
    game = advertise(fed)
    before_share = {s: RecordDict(dict(fed.states[s].items())) for s in HONEST}
    share_keys(game, 3)
    everyone = set(HONEST)
    before = {s: RecordDict(dict(fed.states[s].items())) for s in HONEST}
    mask(game, {s: everyone for s in HONEST})
    first = game.masked["a"]
    assert len(inputs) == 3

    for lost in (before["a"], RecordDict()):  # a lost save of the state; a restart
        fed.states["a"] = lost
        again = fed.mask("a", game.sealed, everyone, game.arrays)
        assert again.code == 4013
        other = fed.mask("a", game.sealed, {"a", "b"}, game.arrays)
        assert other.code == 4013
    assert len(inputs) == 3  # no second input was ever masked
    assert len(fed.ledger_lines("a")) == 1

    for state in (fed.states["b"], before_share["b"]):  # as it is; its save after sharing lost
        fed.states["b"] = state
        assert fed.share("b", game.roster, 3).code == 4013
    fed.states["b"] = before["b"]
    fed.states["a"] = before["a"]  # the state before masking: the record completes it
    sign(game, {s: everyone for s in HONEST})
    assert "consistency" not in game.codes
    adversary = game.adversary(3)
    assert adversary.recover("a", first, everyone) is None
    assert_charged_as_stated(game)


def test_a_sparse_site_draws_once_a_round_even_after_a_lost_save(tiny_bert, tmp_path):
    """Under a sparse graph a site checks the committed signatures on a random sample, so it
    draws ONCE a round, its draw durable before it leaves: after signatures that do not
    confirm its view (refused, 4012) it refuses the true ones too (another root), also when the
    save of its state after the first draw was lost; a site asked once answers."""
    sites = ("a", "b", "c", "d", "e", "f")
    node = {"min-honest-sites": 6, "secure-max-dropouts": 1, "secure-graph": "sparse"}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in sites})
    game = advertise(fed)
    trusts = [RoundTrust(6, 1)] * 6
    graph, threshold = common_graph(trusts, 6), least_common_threshold(trusts, 6)
    assert graph == (4, 3) and threshold == 5
    seed = CommittedRoster(game.roster).seed(threshold, graph)
    ring = MaskingGraph.derive(game.roster, degree=4, seed=seed)
    for site in sites:
        reply = fed.share(site, game.roster, threshold, graph)
        assert reply.code is None, reply.code
        game.sealed[site] = fed.sealed_of(reply, site, ring.neighbourhood(site))
    everyone = set(sites)
    for site in sites:
        reply = fed.mask(site, game.sealed, everyone, game.arrays, ring.neighbourhood(site))
        assert reply.code is None, reply.code
    sign(game, {s: everyone for s in sites})
    assert not game.codes and len(game.signatures) == 6
    before = RecordDict(dict(fed.states["a"].items()))
    wrong = {**game.signatures, **{s: game.signatures["c"] for s in ("b", "d", "e")}}
    # 3 valid: fewer than the 4 genuine a view needs here ((6 + 0) // 2 + 1), so any sample of
    # sample_size(6, 4) = 4 draws a bad one, and the full count finds 3 < t = 5
    assert sample_size(6, 4) == 4
    assert fed.unmask("a", everyone, set(), wrong).code == 4012
    assert fed.unmask("a", everyone, set(), game.signatures).code == 4012
    fed.states["a"] = before  # the state as it was before the first check
    assert fed.unmask("a", everyone, set(), game.signatures).code == 4012
    answered = fed.unmask("b", everyone, set(), game.signatures)
    assert answered.code is None
    shares = decode_unmask_reply(
        answered.part,
        round_id=ROUND,
        site_id="b",
        request=UnmaskRequest(frozenset(everyone), frozenset()),
        near=ring.neighbourhood("b"),
    )
    assert set(shares.seed_shares) == set(ring.neighbourhood("b"))


# -- an unpinned or coordinator-written peer key -------------------------------------------------


def test_an_unpinned_peer_is_refused_before_anything_is_shared(tiny_bert, tmp_path):
    """The coordinator adds a site of its own (its identity key pinned nowhere) to the roster:
    every honest site refuses (4014) before sharing anything."""
    node = {"min-honest-sites": 3}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in HONEST})
    sybil = Federation.build(tmp_path / "elsewhere", run_config(tiny_bert), {}, colluders=["z"])
    fed.colluders.update(sybil.colluders)  # the coordinator's own site, not pinned here
    fed.registered.update(sybil.registered)
    game = play(fed, threshold=4, colluder_trust=RoundTrust(4, 0))
    assert game.codes["share"] == {s: 4014 for s in HONEST}
    assert game.sealed == {}
    assert game.adversary(4).secret("a", "seed") is None
    assert_charged_as_stated(game)


def test_a_peer_key_written_where_the_coordinator_can_write_is_refused(tiny_bert, tmp_path):
    """The pinned folder is writable by others (a shared volume the coordinator's services
    mount read-write): the coordinator pins a site of its own there, and every honest site
    refuses the roster (4014) because whoever can write the folder could pin anyone."""
    node = {"min-honest-sites": 3}
    fed = Federation.build(tmp_path, run_config(tiny_bert), {s: node for s in HONEST})
    sybil = Federation.build(tmp_path / "coordinator", run_config(tiny_bert), {}, colluders=["z"])
    peers = tmp_path / "peers"
    peers.chmod(0o777)
    (peers / "z.pem").write_bytes((tmp_path / "coordinator" / "peers" / "z.pem").read_bytes())
    fed.colluders.update(sybil.colluders)
    fed.registered.update(sybil.registered)
    game = play(fed, threshold=4, colluder_trust=RoundTrust(4, 0))
    assert game.codes["share"] == {s: 4014 for s in HONEST}
    assert game.sealed == {}
    assert game.adversary(4).secret("a", "seed") is None
    peers.chmod(0o755)  # the operator's fix: the folder is the site's alone again
    (peers / "z.pem").unlink()


# -- an oversized noise share --------------------------------------------------------------------


def test_an_oversized_noise_share_is_refused_before_the_charge(tiny_bert, tmp_path):
    """A colluder signs the largest share the codec accepts (2^50): every honest site would
    add it and the round would carry nothing but noise. Each refuses at the mask stage (4015),
    before its charge: nothing charged, nothing masked."""
    fed = Federation.build(
        tmp_path,
        run_config(tiny_bert),
        {s: {"min-honest-sites": 3} for s in ("a", "b")},
        colluders=["x"],
    )
    game = play(fed, threshold=3, colluder_share=2.0**50, colluder_trust=RoundTrust(3, 0))
    everyone = {"a", "b", "x"}
    mask(game, {s: everyone for s in ("a", "b")})
    assert game.codes["mask"] == {"a": 4015, "b": 4015}
    assert game.masked == {}
    assert_charged_as_stated(game)


# -- the control: where the policy allows it, the recovery succeeds ------------------------------


def test_a_site_counting_on_itself_alone_is_recovered_exactly_at_its_stated_charge(
    tiny_bert, tmp_path, inputs
):
    """a counts on itself alone (H = 1, D = 0: the deployed default); x and y collude. The
    round is consistent, so a reveals its shares, and the coordinator with its colluders reads
    a's input exactly: the recovery above is real. a's charge states exactly that: its share
    alone carries the sum's noise (share sigma = sigma)."""
    fed = Federation.build(tmp_path, run_config(tiny_bert), {"a": {}}, colluders=COLLUDERS)
    game = play(fed, threshold=3, colluder_trust=RoundTrust(1, 0))
    everyone = {"a", *COLLUDERS}
    mask(game, {s: everyone for s in sorted(everyone)})
    views = {s: everyone for s in sorted(everyone)}
    sign(game, views)
    unmask(game, views)
    assert "unmask" not in game.codes
    recovered = game.adversary(3).recover("a", game.masked["a"], everyone)
    assert recovered is not None
    (alone,) = inputs
    np.testing.assert_array_equal(recovered, alone)
    assert game.facts["a"]["share-sigma"] == game.facts["a"]["sigma"]
    assert_charged_as_stated(game)
