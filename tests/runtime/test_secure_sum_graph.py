"""The sparse masking graph of the secure sum (prism_runtime.secure_sum.graph), end to end in one
process: every site derives the same graph, the sum is exact under the dropouts its
neighbourhoods tolerate, a pattern below a neighbourhood's threshold aborts with nothing
revealed, a site told another graph is caught before anything is revealed, and a site's mask
work is (k + 1) d words whatever n (counted, not timed)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    CommittedRoster,
    ConsistencyError,
    KeyBindingError,
    MaskedSum,
    MaskingGraph,
    NoiseShareError,
    RosterPart,
    RoundDecisions,
    RoundId,
    RoundTrust,
    RoundView,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    SignatureBook,
    SiteRound,
    ThresholdError,
    centre,
    check_signatures,
    common_graph,
    encode_signed,
    least_common_threshold,
    plan_unmask,
    round_transcript,
    sample_size,
    sparse_parameters,
    unmask_sum,
)
from prism_runtime.secure_sum import masks as masks_module
from prism_runtime.secure_sum import views as views_module
from prism_runtime.secure_sum.graph import graph_abort, graph_failure
from prism_runtime.secure_sum.merkle import MerkleTree, root_of

BITS = 32
Vector = npt.NDArray[np.uint64]


@dataclass
class Round:
    round_id: RoundId
    sites: dict[str, SiteRound]
    identities: dict[str, ec.EllipticCurvePrivateKey]
    registered: dict[str, ec.EllipticCurvePublicKey]
    roster: dict[str, AdvertisedKeys]
    threshold: int
    graph: tuple[int, int] | None


_IDENTITIES: dict[str, ec.EllipticCurvePrivateKey] = {}


def _identity(site: str) -> ec.EllipticCurvePrivateKey:
    if site not in _IDENTITIES:
        _IDENTITIES[site] = ec.generate_private_key(ec.SECP256R1())
    return _IDENTITIES[site]


def start(n: int, *, honest: int, dropouts: int, sparse: bool = True) -> Round:
    """n sites that count on ``honest`` and tolerate ``dropouts``, with the round's least
    common threshold and, if ``sparse``, the common sparse graph."""
    round_id = RoundId("run-graph", 1)
    ids = [f"site-{i:04d}" for i in range(n)]
    trust = RoundTrust(honest, dropouts)
    sites = {
        s: SiteRound(
            site_id=s,
            round_id=round_id,
            identity_key=_identity(s),
            bits=BITS,
            noise_share=1.0,
            trust=trust,
        )
        for s in ids
    }
    threshold = least_common_threshold([trust] * n, n)
    assert threshold is not None
    return Round(
        round_id=round_id,
        sites=sites,
        identities={s: _identity(s) for s in ids},
        registered={s: _identity(s).public_key() for s in ids},
        roster={s: site.advertised for s, site in sites.items()},
        threshold=threshold,
        graph=common_graph([trust] * n, n) if sparse else None,
    )


def share(rnd: Round, sharing: Collection[str]) -> list[str]:
    sealed = {
        s: rnd.sites[s].share(
            rnd.roster, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
        )
        for s in sorted(sharing)
    }
    for receiver in sharing:
        rnd.sites[receiver].receive(
            {s: box[receiver] for s, box in sealed.items() if receiver in box}
        )
    return sorted(sharing)


def finish(
    rnd: Round, inputs: dict[str, Vector], participants: list[str], masked_from: Collection[str]
) -> Vector:
    any_site = rnd.sites[participants[0]]
    running = MaskedSum(len(next(iter(inputs.values()))), bits=BITS)
    for s in sorted(masked_from):
        running.add(s, rnd.sites[s].mask(inputs[s], participants=participants))
    request = plan_unmask(running.sites, participants=participants, threshold=rnd.threshold)
    signatures = {
        s: rnd.sites[s].sign_view(request.survivors, identity_key=rnd.identities[s])
        for s in request.survivors
    }
    answers = [
        rnd.sites[s].answer(request, signatures=signatures, registered=rnd.registered)
        for s in sorted(request.survivors)
    ]
    return running.unmask(
        answers,
        roster=rnd.roster,
        participants=participants,
        threshold=rnd.threshold,
        round_id=rnd.round_id,
        graph=any_site.graph,
        graph_threshold=None if rnd.graph is None else rnd.graph[1],
    )


def inputs_for(sites: Collection[str], length: int, seed: int) -> tuple[dict[str, Vector], dict]:
    rng = np.random.default_rng(seed)  # test data only
    bound = 1000
    plain = {s: rng.integers(-bound, bound, size=length, endpoint=True) for s in sorted(sites)}
    return {s: encode_signed(v, bits=BITS, bound=bound) for s, v in plain.items()}, plain


def test_every_site_derives_the_coordinators_graph_and_it_is_regular_and_symmetric() -> None:
    rnd = start(100, honest=90, dropouts=10)
    assert rnd.graph is not None
    k, _ = rnd.graph
    share(rnd, rnd.sites)
    graphs = {s.graph for s in rnd.sites.values()}
    assert len(graphs) == 1  # every site, the same order and degree
    graph = graphs.pop()
    seed = CommittedRoster(rnd.roster).seed(rnd.threshold, rnd.graph)
    assert graph == MaskingGraph.derive(rnd.roster, degree=k, seed=seed)
    for s in rnd.sites:
        near = graph.neighbours(s)
        assert len(near) == k and s not in near
        assert all(s in graph.neighbours(p) for p in near)
    assert graph.edges() == 100 * k // 2
    other = MaskingGraph.derive(rnd.roster, degree=k, seed=b"another run")
    assert other.order != graph.order and sorted(other.order) == sorted(graph.order)


def test_the_complete_graph_is_the_protocol_without_a_graph() -> None:
    """Degree n - 1 is the protocol without a graph, exactly: the same transcript, holders and
    shares."""
    rnd = start(6, honest=6, dropouts=1, sparse=False)
    share(rnd, rnd.sites)
    site = next(iter(rnd.sites.values()))
    assert site.graph.complete and site.graph.neighbours(site.site_id) == set(rnd.sites) - {
        site.site_id
    }
    assert site.transcript == round_transcript(rnd.threshold, rnd.roster.values())
    graph = MaskingGraph.derive(rnd.roster, degree=5, seed=b"ignored")
    assert graph.complete and graph.order == tuple(sorted(rnd.roster))
    alone = MaskingGraph.derive(["site-0000"], degree=0, seed=b"")  # a one-site roster
    assert alone.complete and alone.neighbourhood("site-0000") == ["site-0000"]
    with pytest.raises(ConfigError, match="even degree"):
        MaskingGraph(tuple(sorted(rnd.roster)), 3)


@pytest.mark.parametrize(
    ("n", "drop_before", "drop_after"),
    [(10, 0, 0), (40, 2, 2), (100, 0, 0), (100, 5, 5), (100, 0, 10)],
)
def test_the_sparse_sum_equals_the_plain_sum_exactly(n: int, drop_before: int, drop_after: int):
    """Dropped before masking (participants) and after (survivors), within D."""
    dropouts = max(drop_before + drop_after, 1)
    rnd = start(n, honest=n - n // 10 if n >= 40 else n, dropouts=dropouts)
    ids = sorted(rnd.sites)
    participants = share(rnd, ids[drop_before:])
    survivors = participants[: len(participants) - drop_after]
    assert rnd.graph is not None and rnd.graph[0] < n - 1
    encoded, plain = inputs_for(participants, 64, seed=n)
    total = finish(rnd, encoded, participants, survivors)
    expected = np.sum([plain[s] for s in survivors], axis=0)
    np.testing.assert_array_equal(centre(total, bits=BITS), expected)


def test_streaming_and_whole_unmasking_agree() -> None:
    rnd = start(30, honest=27, dropouts=3)
    participants = share(rnd, sorted(rnd.sites))
    encoded, _ = inputs_for(participants, 16, seed=1)
    masked = {s: rnd.sites[s].mask(encoded[s], participants=participants) for s in participants}
    survivors = participants[:-2]
    request = plan_unmask(survivors, participants=participants, threshold=rnd.threshold)
    signatures = {
        s: rnd.sites[s].sign_view(request.survivors, identity_key=rnd.identities[s])
        for s in survivors
    }
    answers = [
        rnd.sites[s].answer(request, signatures=signatures, registered=rnd.registered)
        for s in survivors
    ]
    graph = rnd.sites[survivors[0]].graph
    assert rnd.graph is not None
    kwargs = dict(
        roster=rnd.roster,
        participants=participants,
        threshold=rnd.threshold,
        round_id=rnd.round_id,
        graph=graph,
        graph_threshold=rnd.graph[1],
    )
    whole = unmask_sum({s: masked[s] for s in survivors}, answers, bits=BITS, **kwargs)
    running = MaskedSum(16, bits=BITS)
    for s in survivors:
        running.add(s, masked[s])
    np.testing.assert_array_equal(running.unmask(answers, **kwargs), whole)


def test_a_neighbourhood_below_its_threshold_aborts_with_nothing_revealed() -> None:
    """At t = k, two of a site's neighbours missing leave fewer than t holders of its shares:
    the site refuses to mask, and a coordinator left short of its shares aborts before it
    rebuilds any secret."""
    rnd = start(60, honest=54, dropouts=6)
    assert rnd.graph is not None
    k, _ = rnd.graph
    rnd.graph = (k, k)  # a stricter threshold every site accepts
    share(rnd, rnd.sites)
    victim = sorted(rnd.sites)[0]
    gone = sorted(rnd.sites[victim].graph.neighbours(victim))[:2]
    participants = sorted(set(rnd.sites) - set(gone))
    with pytest.raises(SecureSumAbortedError, match="neighbourhood threshold needs"):
        rnd.sites[victim].check_participants(participants)

    rnd = start(60, honest=54, dropouts=6)
    rnd.graph = (k, k)
    everyone = share(rnd, rnd.sites)
    encoded, _ = inputs_for(everyone, 8, seed=2)
    running = MaskedSum(8, bits=BITS)
    for s in everyone:
        running.add(s, rnd.sites[s].mask(encoded[s], participants=everyone))
    request = plan_unmask(running.sites, participants=everyone, threshold=rnd.threshold)
    signatures = {
        s: rnd.sites[s].sign_view(request.survivors, identity_key=rnd.identities[s])
        for s in everyone
    }
    graph = rnd.sites[victim].graph
    withheld = set(sorted(graph.neighbours(victim))[:2])
    answers = [
        rnd.sites[s].answer(request, signatures=signatures, registered=rnd.registered)
        for s in everyone
        if s not in withheld
    ]
    with pytest.raises(SecureSumAbortedError, match="too few shares"):
        running.unmask(
            answers,
            roster=rnd.roster,
            participants=everyone,
            threshold=rnd.threshold,
            round_id=rnd.round_id,
            graph=graph,
            graph_threshold=k,
        )


def test_a_site_told_another_graph_is_caught_before_anything_is_revealed() -> None:
    """The coordinator tells one site a larger degree: the shares it seals open at none of the
    others, theirs open not at it, and its transcript, which every survivor signs with its
    view, is another: the others' signatures confirm nothing of its view."""
    rnd = start(50, honest=45, dropouts=5)
    assert rnd.graph is not None
    k, t = rnd.graph
    told = "site-0007"
    sealed = {
        s: rnd.sites[s].share(
            rnd.roster,
            registered=rnd.registered,
            threshold=rnd.threshold,
            graph=(k + 2, t + 1) if s == told else rnd.graph,
        )
        for s in sorted(rnd.sites)
    }
    honest = sorted(set(rnd.sites) - {told})
    true_graph = rnd.sites[honest[0]].graph
    assert rnd.sites[told].graph != true_graph
    assert rnd.sites[told].transcript != rnd.sites[honest[0]].transcript
    for peer in sorted(true_graph.neighbours(told) & set(sealed[told]))[:3]:
        with pytest.raises(ShareError):
            rnd.sites[peer].receive({told: sealed[told][peer]})
    senders = sorted(s for s in honest if told in sealed[s])
    with pytest.raises(ShareError):
        rnd.sites[told].receive({senders[0]: sealed[senders[0]][told]})
    # The honest sites run the round among themselves and sign their views; the told site's
    # view (another transcript) is confirmed by none of those signatures.
    for receiver in honest:
        rnd.sites[receiver].receive(
            {s: sealed[s][receiver] for s in honest if s != receiver and receiver in sealed[s]}
        )
    encoded, _ = inputs_for(honest, 4, seed=3)
    for s in honest:
        rnd.sites[s].mask(encoded[s], participants=honest)
    signatures = {s: rnd.sites[s].sign_view(honest, identity_key=rnd.identities[s]) for s in honest}
    view = RoundView(frozenset(honest), frozenset(honest), rnd.sites[told].transcript)
    for sampled, refusal in ((False, "0 of 49 forwarded"), (True, "49 of the 49 signatures")):
        with pytest.raises(ConsistencyError, match=refusal):
            check_signatures(
                view,
                signatures,
                round_id=rnd.round_id,
                registered=rnd.registered,
                threshold=rnd.threshold,
                sampled=sampled,
            )


def test_a_graph_below_a_sites_condition_is_refused_before_sharing() -> None:
    """A site shares under a graph only if its own bound (n - H colluders, its D) is at most
    2^-40: sparser graphs are refused, the common one and denser ones accepted."""
    n, honest, dropouts = 200, 150, 20
    rnd = start(n, honest=honest, dropouts=dropouts)
    assert rnd.graph is not None
    k, t = rnd.graph
    verdicts = {}
    for graph in [
        (2, 2),
        (k // 2 - k // 2 % 2, (k // 2 - k // 2 % 2) // 2 + 1),
        (k, t),
        (k + 10, t + 5),
    ]:
        site = start(n, honest=honest, dropouts=dropouts).sites["site-0000"]
        bound = graph_failure(
            n, degree=graph[0], threshold=graph[1], corrupt=n - honest, dropouts=dropouts
        )
        try:
            site.share(
                rnd.roster | {"site-0000": site.advertised},
                registered=rnd.registered,
                threshold=rnd.threshold,
                graph=graph,
            )
            verdicts[graph] = True
        except ThresholdError as exc:
            assert "breaks this site's guarantee" in str(exc)
            verdicts[graph] = False
        assert verdicts[graph] == (bound <= 2.0**-40)
    assert verdicts[(k, t)] and not verdicts[(2, 2)]
    site = start(n, honest=honest, dropouts=dropouts).sites["site-0000"]
    with pytest.raises(ThresholdError, match="a majority of the neighbourhood"):
        site.share(
            rnd.roster | {"site-0000": site.advertised},
            registered=rnd.registered,
            threshold=rnd.threshold,
            graph=(k, k // 2),
        )


def test_the_parameters_meet_their_bounds_and_grow_as_log_n() -> None:
    """k from sparse_parameters keeps both bounds; it is the least even degree that does; and
    from n = 100 to 10,000 it grows at most by a constant per doubling (O(log n))."""
    degrees = {}
    for n in (100, 1000, 10_000):
        c, d = n // 10, n // 10
        params = sparse_parameters(n, corrupt=c, dropouts=d)
        assert params is not None
        k, t = params
        assert graph_failure(n, degree=k, threshold=t, corrupt=c, dropouts=d) <= 2.0**-40
        assert graph_abort(n, degree=k, threshold=t, dropouts=d) <= 2.0**-20
        smaller = [
            graph_failure(n, degree=k - 2, threshold=s, corrupt=c, dropouts=d) <= 2.0**-40
            and graph_abort(n, degree=k - 2, threshold=s, dropouts=d) <= 2.0**-20
            for s in range((k - 2) // 2 + 1, k - 1)
        ]
        assert not any(smaller)
        degrees[n] = k
    assert degrees[10_000] - degrees[1000] <= 2 * (degrees[1000] - degrees[100]) + 2
    assert degrees[10_000] <= 4 * math.log2(10_000) * 2


def test_a_sites_mask_work_is_k_plus_one_times_d_whatever_n(monkeypatch) -> None:
    """Counted words of ChaCha mask stream per site: (k + 1) d at n = 40 and at n = 160 with
    the same degree, against (n) d for the complete graph."""
    counted: list[int] = []
    real = masks_module.expand_mask

    def counting(key: bytes, length: int, *, bits: int):
        counted.append(length)
        return real(key, length, bits=bits)

    monkeypatch.setattr(masks_module, "expand_mask", counting)
    d = 32
    work = {}
    for n, sparse in ((40, True), (160, True), (40, False)):
        rnd = start(n, honest=n, dropouts=2, sparse=sparse)
        if sparse:
            rnd.graph = (8, 5)
        participants = share(rnd, rnd.sites)
        encoded, _ = inputs_for(participants, d, seed=n)
        counted.clear()
        rnd.sites[participants[0]].mask(encoded[participants[0]], participants=participants)
        work[(n, sparse)] = sum(counted)
    assert work[(40, True)] == work[(160, True)] == (8 + 1) * d
    assert work[(40, False)] == 40 * d


class _CountingKey:
    """A registered identity key that counts its signature checks."""

    def __init__(self, key: ec.EllipticCurvePublicKey, checks: list[str]) -> None:
        self._key, self._checks, self.curve = key, checks, key.curve

    def verify(self, signature: bytes, data: bytes, algorithm: object) -> None:
        self._checks.append("verify")
        self._key.verify(signature, data, algorithm)  # type: ignore[arg-type]


def test_sample_size_is_the_least_that_keeps_the_bound_and_stays_flat_in_n() -> None:
    """C(needed - 1, s) / C(F, s) <= 2^-40 at s and not at s - 1, checked in exact integers; at
    H = 0.9 n the sample never exceeds its size for an unbounded roster, 47."""
    for forwarded, needed in [(100, 56), (1000, 551), (900, 551), (60, 31), (20, 19), (12, 7)]:
        s = sample_size(forwarded, needed)
        assert 1 <= s <= forwarded
        bound = 2**40 * math.comb(needed - 1, s)
        if s < forwarded:
            assert bound <= math.comb(forwarded, s)
            assert 2**40 * math.comb(needed - 1, s - 1) > math.comb(forwarded, s - 1)
    sizes = {
        n: sample_size(n, RoundTrust(n - n // 10, 0).confirmations(n))
        for n in (100, 1000, 10_000, 100_000)
    }
    # drawn without replacement it grows toward the with-replacement size, which n leaves alone:
    # ceil(40 / log2(1 / 0.55)) = 47 (needed / F tends to (1 + 0.1) / 2)
    limit = math.ceil(40 / math.log2(1 / 0.55))
    assert sorted(sizes.values()) == list(sizes.values()) and sizes[100_000] == limit == 47
    assert RoundTrust(90, 0).confirmations(100) == 56  # (100 + 10) // 2 + 1


def _mask_and_sign(rnd: Round, everyone: list[str]) -> tuple[Any, dict[str, bytes]]:
    """Every site of ``everyone`` masks with all of them and signs them all as survivors."""
    encoded, _ = inputs_for(everyone, 4, seed=len(everyone))
    for s in everyone:
        rnd.sites[s].mask(encoded[s], participants=everyone)
    request = plan_unmask(everyone, participants=everyone, threshold=rnd.threshold)
    signatures = {
        s: rnd.sites[s].sign_view(request.survivors, identity_key=rnd.identities[s])
        for s in everyone
    }
    return request, signatures


def test_a_sites_signature_checks_do_not_grow_with_n() -> None:
    """Counted ECDSA checks of one site over a whole sparse round: its neighbourhood's k + 1
    advertisements and a sample of the survivors' signatures, the same at n = 60 and 240 (and
    so with colluders allowed for, n = 200, H = 180); with the complete graph every
    advertisement and every signature, as before."""
    checks = {}
    site = "site-0001"
    for n, honest, sparse in ((60, 60, True), (240, 240, True), (200, 180, True), (40, 40, False)):
        rnd = start(n, honest=honest, dropouts=1, sparse=sparse)
        if sparse and honest == n:
            rnd.graph = (8, 5)
        per_site: list[str] = []
        counting = {s: _CountingKey(k, per_site) for s, k in rnd.registered.items()}
        sealed = {
            s: rnd.sites[s].share(
                rnd.roster,
                registered=counting if s == site else rnd.registered,  # type: ignore[arg-type]
                threshold=rnd.threshold,
                graph=rnd.graph,
            )
            for s in sorted(rnd.sites)
        }
        advertisements = len(per_site)
        for receiver in rnd.sites:
            rnd.sites[receiver].receive(
                {s: box[receiver] for s, box in sealed.items() if receiver in box}
            )
        request, signatures = _mask_and_sign(rnd, sorted(rnd.sites))
        per_site.clear()
        rnd.sites[site].answer(
            request,
            signatures=signatures,
            registered=counting,  # type: ignore[arg-type]
        )
        degree = n - 1 if rnd.graph is None else rnd.graph[0]
        needed = RoundTrust(honest, 1).confirmations(n)
        checks[(n, sparse)] = (advertisements, len(per_site), degree + 1, sample_size(n, needed))
    for n in (60, 240, 200):
        adverts, signatures, neighbourhood, sample = checks[(n, True)]
        assert (adverts, signatures) == (neighbourhood, sample) and sample < n
    assert checks[(60, True)][:2] == (9, sample_size(60, 31))
    assert sum(checks[(240, True)][:2]) <= 60 < 2 * 240
    assert checks[(40, False)][:2] == (40, 40)


def _signed_round(n: int, honest: int) -> tuple[Round, list[str], Any, dict[str, bytes]]:
    """A sparse round of n sites run to the consistency stage: every site masked and signed."""
    rnd = start(n, honest=honest, dropouts=1)
    everyone = share(rnd, rnd.sites)
    return (rnd, everyone, *_mask_and_sign(rnd, everyone))


class _Draw:
    """Stands in for ``secrets.SystemRandom`` in ``views``: draws the places it is told to
    (first ``first``, then the lowest others), so a test can put a given signature in or out
    of the sample."""

    first: ClassVar[list[int]] = []

    def sample(self, population: range, k: int) -> list[int]:
        chosen = [p for p in self.first if p in population][:k]
        return chosen + [p for p in population if p not in chosen][: k - len(chosen)]


def test_forged_signatures_are_caught_by_the_sample_and_a_draw_is_never_redrawn(
    monkeypatch,
) -> None:
    """Forwarded signatures with fewer genuine ones than a view needs: refused (a sample misses
    every forgery with probability below 2^-40: here it draws one). One damaged signature among
    enough genuine ones: a sample without it confirms; a sample with it stops the site (nothing
    revealed). A site draws once a round: the true signatures after forged ones are refused,
    and the same ones again are checked on the same draw."""
    rnd, everyone, request, signatures = _signed_round(120, honest=108)
    site = rnd.sites[everyone[3]]
    needed = site.trust.confirmations(120)
    size = sample_size(120, needed)
    assert size < 120 and rnd.graph is not None
    monkeypatch.setattr(views_module.secrets, "SystemRandom", _Draw)
    forged = dict(signatures)
    for s in everyone[needed - 1 :]:  # only needed - 1 genuine signatures remain
        forged[s] = rnd.sites[everyone[0]].advertised.signature  # valid, but of something else
    monkeypatch.setattr(_Draw, "first", [119])
    with pytest.raises(ConsistencyError, match=f"1 of the {size} signatures this site drew"):
        site.answer(request, signatures=forged, registered=rnd.registered)
    with pytest.raises(ConsistencyError, match="draws once per round"):
        site.answer(request, signatures=signatures, registered=rnd.registered)
    with pytest.raises(ConsistencyError, match=f"1 of the {size} signatures this site drew"):
        site.answer(request, signatures=forged, registered=rnd.registered)  # the same draw

    damaged = dict(signatures)
    damaged[everyone[7]] = bytes(70)
    monkeypatch.setattr(_Draw, "first", list(range(120 - size, 120)))  # everyone[7] not drawn
    response = rnd.sites[everyone[4]].answer(request, signatures=damaged, registered=rnd.registered)
    assert response.site_id == everyone[4]
    monkeypatch.setattr(_Draw, "first", [])  # the lowest places: everyone[7] among them
    with pytest.raises(ConsistencyError, match=f"1 of the {size} signatures this site drew"):
        rnd.sites[everyone[5]].answer(request, signatures=damaged, registered=rnd.registered)


def test_a_site_opens_only_the_signatures_it_drew_against_their_root() -> None:
    """The coordinator commits before the draw: signatures other than the drawn ones, or the
    drawn ones with a proof of another root, reveal nothing; the true opening does."""
    rnd, everyone, request, signatures = _signed_round(60, honest=54)
    site = rnd.sites[everyone[2]]
    book = SignatureBook(signatures)
    drawn = site.draw(request, signers=book.signers, root=book.root)
    assert len(drawn) == sample_size(60, site.trust.confirmations(60)) < 60
    opened, proof = book.open(drawn)
    undrawn = next(s for s in book.signers if s not in opened)
    other = {**{s: v for s, v in list(opened.items())[1:]}, undrawn: signatures[undrawn]}
    with pytest.raises(ConsistencyError, match="not the"):
        site.reveal(request, signatures=other, proof=proof, registered=rnd.registered)
    bent = (bytes(32), *proof[1:])
    with pytest.raises(ConsistencyError, match="do not match the root"):
        site.reveal(request, signatures=opened, proof=bent, registered=rnd.registered)
    with pytest.raises(ConsistencyError, match="do not match the root"):
        site.reveal(
            request, signatures=opened, proof=(*proof, bytes(32)), registered=rnd.registered
        )
    response = site.reveal(request, signatures=opened, proof=proof, registered=rnd.registered)
    assert set(response.seed_shares) == set(site.graph.neighbourhood(site.site_id))
    with pytest.raises(ConsistencyError, match="fewer than the threshold"):
        rnd.sites[everyone[3]].draw(request, signers=book.signers[:10], root=book.root)
    twice = [*book.signers, book.signers[0]]
    with pytest.raises(ConsistencyError, match="repeat a site"):
        rnd.sites[everyone[3]].draw(request, signers=twice, root=book.root)


def test_a_sites_draw_is_durable_and_an_older_state_keeps_it() -> None:
    """The durable record of a site's draw (``decisions``) makes an older copy of its round
    state, as a restart would bring back, draw the same again and refuse another draw."""
    rnd, everyone, request, signatures = _signed_round(30, honest=27)
    site = rnd.sites[everyone[2]]
    older = SiteRound.from_bytes(site.to_bytes())
    book = SignatureBook(signatures)
    drawn = site.draw(request, signers=book.signers, root=book.root)
    record = RoundDecisions.from_json(site.decisions().to_json())
    assert record.draw is not None and record.draw.drawn == drawn
    older.recall(record)
    assert older.draw(request, signers=book.signers, root=book.root) == drawn
    with pytest.raises(ConsistencyError, match="draws once per round"):
        older.draw(request, signers=book.signers, root=bytes(32))
    restored = SiteRound.from_bytes(site.to_bytes())
    assert restored.decisions() == site.decisions()
    signers = record.to_json()["draw"]["signers"]
    for bad in (
        {"drawn": [True]},
        {"drawn": [99]},
        {"drawn": []},
        {"drawn": [1, 0]},
        {"root": "zz"},
        {"root": "00"},
        {"signers": list(reversed(signers))},
    ):
        with pytest.raises(SecureSumError, match="not a secure-sum decision record"):
            RoundDecisions.from_json(
                {**record.to_json(), "draw": {**record.to_json()["draw"], **bad}}
            )


def test_a_sites_check_of_its_roster_covers_the_keys_it_uses_and_binds_the_rest() -> None:
    """A coordinator that substitutes a NEIGHBOUR's advertisement is refused before anything is
    shared; one that changes a non-neighbour's (here its noise share, to make the site add less)
    gives the site another transcript: its sealed shares open at no holder, so nothing it sealed
    or masks with is usable with the others'."""
    rnd = start(80, honest=72, dropouts=2)
    assert rnd.graph is not None
    site = "site-0005"
    true_seed = CommittedRoster(rnd.roster).seed(rnd.threshold, rnd.graph)
    true_graph = MaskingGraph.derive(rnd.roster, degree=rnd.graph[0], seed=true_seed)
    lowered = {}
    for other in sorted(rnd.roster):
        if other == site:
            continue
        roster = dict(rnd.roster)
        roster[other] = dataclasses.replace(rnd.roster[other], noise_share=0.5)
        seed = CommittedRoster(roster).seed(rnd.threshold, rnd.graph)
        graph = MaskingGraph.derive(roster, degree=rnd.graph[0], seed=seed)
        near = graph.neighbours(site)
        if other in near or near & true_graph.neighbours(site):  # a holder under both graphs
            lowered.setdefault(other in near, roster)
        if len(lowered) == 2:
            break
    with pytest.raises(KeyBindingError, match="do not verify against its registered identity"):
        rnd.sites[site].share(
            lowered[True], registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
        )
    sealed = rnd.sites[site].share(
        lowered[False], registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
    )
    others = sorted(set(rnd.sites) - {site})
    for s in others:
        rnd.sites[s].share(
            rnd.roster, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
        )
    assert rnd.sites[site].transcript != rnd.sites[others[0]].transcript
    true_holders = sorted(set(sealed) & rnd.sites[others[0]].graph.neighbours(site))
    assert true_holders  # holders under both graphs: the transcript alone refuses them
    for holder in true_holders:
        with pytest.raises(ShareError, match="fail authentication"):
            rnd.sites[holder].receive({site: sealed[holder]})
    for holder in sorted(set(sealed) - set(true_holders)):
        with pytest.raises(ShareError, match="not another holder"):
            rnd.sites[holder].receive({site: sealed[holder]})


def _replace(rnd: Round, site: str, *, noise_share: float, trust: RoundTrust) -> None:
    """Give ``site`` of ``rnd`` another noise share and H and D (a new round state, advertised)."""
    rnd.sites[site] = SiteRound(
        site_id=site,
        round_id=rnd.round_id,
        identity_key=_identity(site),
        bits=BITS,
        noise_share=noise_share,
        trust=trust,
    )
    rnd.roster[site] = rnd.sites[site].advertised


def test_a_site_adds_the_largest_share_of_its_roster_whatever_participants_it_is_told() -> None:
    """A coordinator that leaves the neediest site out of one site's participants does not
    lower what that site adds: the largest share of the roster, not of the participants."""
    rnd = start(30, honest=27, dropouts=2)
    needy = "site-0017"
    _replace(rnd, needy, noise_share=3.0, trust=RoundTrust(27, 2))
    share(rnd, rnd.sites)
    told = sorted(set(rnd.sites) - {needy})
    site = next(s for s in told if needy not in rnd.sites[s].graph.neighbours(s))
    rnd.sites[site].check_participants(told)
    assert rnd.sites[site].noise_share() == 3.0


def test_a_sampled_check_counts_on_its_neighbourhoods_weakest_h() -> None:
    """A site's sampled check guards its neighbourhood's secrets, so it needs the genuine
    signatures of the most colluders any site of its neighbourhood allows for: with one site
    counting on H = 90 of 120, its neighbours (counting on all 120) check for
    (120 + 30) // 2 + 1 = 76 genuine signatures (a larger sample), a site outside its
    neighbourhood for 61."""
    n = 120
    rnd = start(n, honest=n, dropouts=1)
    low = RoundTrust(n - 30, 1)
    weak = "site-0040"
    _replace(rnd, weak, noise_share=1.0, trust=low)
    trusts = [RoundTrust(n, 1)] * (n - 1) + [low]
    threshold, graph = least_common_threshold(trusts, n), common_graph(trusts, n)
    assert threshold is not None and graph is not None
    rnd.threshold, rnd.graph = threshold, graph
    everyone = share(rnd, rnd.sites)
    request, signatures = _mask_and_sign(rnd, everyone)
    near = rnd.sites[weak].graph.neighbours(weak)
    neighbour = min(near)
    stranger = min(set(rnd.sites) - near - {weak})
    assert rnd.sites[neighbour].trust.confirmations(n) == 61
    assert rnd.sites[neighbour].trust.confirmations(n, weakest=n - 30) == 76
    for site, needed in ((neighbour, 76), (stranger, 61)):
        checks: list[str] = []
        counting = {s: _CountingKey(k, checks) for s, k in rnd.registered.items()}
        rnd.sites[site].answer(request, signatures=signatures, registered=counting)  # type: ignore[arg-type]
        assert len(checks) == sample_size(n, needed)
    assert sample_size(n, 76) > sample_size(n, 61)


# the committed roster: a site's part of it ------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 31, 64, 100, 1000])
def test_a_multiproof_rebuilds_the_root_from_any_leaves_and_nothing_else(n: int) -> None:
    """Any set of leaves with its multiproof gives the tree's root; every leaf gives it with no
    proof; at most ceil(log2 n) nodes a leaf; a changed, missing or extra node is refused or
    gives another root."""
    rng = np.random.default_rng(n)  # which leaves: test data only
    leaves = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n)]
    root = root_of(n, dict(enumerate(leaves)), ())
    tree = MerkleTree(leaves)
    assert tree.proof(range(n)) == ()
    for size in sorted({1, min(n, 3), min(n, 19), n}):
        chosen = sorted(rng.choice(n, size=size, replace=False).tolist())
        proof = tree.proof(chosen)
        known = {p: leaves[p] for p in chosen}
        assert root_of(n, known, proof) == root
        assert len(proof) <= size * max(1, math.ceil(math.log2(n)))
        if not proof:
            continue
        bent = (bytes(32), *proof[1:])
        assert root_of(n, known, bent) != root
        with pytest.raises(KeyBindingError, match="too short"):
            root_of(n, known, proof[:-1])
        with pytest.raises(KeyBindingError, match="more nodes"):
            root_of(n, known, (*proof, bytes(32)))
    with pytest.raises(KeyBindingError, match="outside its tree"):
        root_of(n, {n: leaves[0]}, ())
    for bad in ([], [n], [-1]):
        with pytest.raises(ValueError, match="places in"):
            tree.proof(bad)


def test_sites_that_receive_only_their_neighbourhood_hold_the_whole_rosters_transcript() -> None:
    """Each site gets its neighbourhood's advertisements and their proof (k + 1 leaves, at most
    (k + 1) log2 n nodes), derives the coordinator's graph, holds the transcript of the whole
    roster, and the sum is exact."""
    rnd = start(100, honest=90, dropouts=10)
    assert rnd.graph is not None
    k = rnd.graph[0]
    committed = CommittedRoster(rnd.roster)
    graph = MaskingGraph.derive(
        committed.ids, degree=k, seed=committed.seed(rnd.threshold, rnd.graph)
    )
    sealed = {}
    for s, site in rnd.sites.items():
        part = committed.part(graph.neighbourhood(s))
        assert len(part.leaves) == k + 1
        assert len(part.proof) <= (k + 1) * math.ceil(math.log2(100))
        sealed[s] = site.share(
            part, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
        )
    whole = round_transcript(rnd.threshold, rnd.roster.values(), rnd.graph)
    assert {site.transcript for site in rnd.sites.values()} == {whole}
    assert {site.graph for site in rnd.sites.values()} == {graph}
    for receiver, site in rnd.sites.items():
        site.receive({s: box[receiver] for s, box in sealed.items() if receiver in box})
    participants = sorted(rnd.sites)
    survivors = participants[:-5]
    encoded, plain = inputs_for(participants, 32, seed=5)
    total = finish(rnd, encoded, participants, survivors)
    expected = np.sum([plain[s] for s in survivors], axis=0)
    np.testing.assert_array_equal(centre(total, bits=BITS), expected)


def test_a_part_missing_a_neighbour_or_bent_is_refused_before_anything_is_shared() -> None:
    rnd = start(60, honest=54, dropouts=3)
    assert rnd.graph is not None
    committed = CommittedRoster(rnd.roster)
    site = "site-0007"
    graph = MaskingGraph.derive(
        committed.ids, degree=rnd.graph[0], seed=committed.seed(rnd.threshold, rnd.graph)
    )
    near = graph.neighbourhood(site)
    part = committed.part(near)
    neighbour = next(s for s in near if s != site)

    def refused(bad: RosterPart, match: str) -> None:
        with pytest.raises(KeyBindingError, match=match):
            rnd.sites[site].share(
                bad, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph
            )

    short = {s: a for s, a in part.leaves.items() if s != neighbour}
    refused(RosterPart(part.ids, part.largest_share, short, committed.part(short).proof), "lacks")
    # a neighbour's leaf changed (its noise share): another root, so another graph or a
    # signature that fails; either way nothing is shared
    bent = dict(part.leaves)
    bent[neighbour] = dataclasses.replace(bent[neighbour], noise_share=0.25)
    refused(dataclasses.replace(part, leaves=bent), "lacks|do not verify")
    refused(dataclasses.replace(part, proof=(*part.proof, bytes(32))), "more nodes")
    refused(dataclasses.replace(part, ids=tuple(reversed(part.ids))), "sorted")
    moved = dict(part.leaves)
    moved[neighbour] = part.leaves[site]
    refused(dataclasses.replace(part, leaves=moved), "under")
    # an invented site outside the neighbourhood: no leaf of it reaches this site, but its id does
    outside = next(s for s in committed.ids if s not in near)
    invented = dict(rnd.roster)
    invented["site-9999"] = dataclasses.replace(rnd.roster[outside], site_id="site-9999")
    padded = CommittedRoster(invented).part(near)
    refused(padded, "no registered identity key")
    # the true part is accepted (a refusal changed nothing): nothing above was a false alarm
    rnd.sites[site].share(part, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph)


@pytest.mark.parametrize(("largest", "match"), [(0.5, "below this site's own"), (1e6, "whole")])
def test_a_stated_largest_share_below_a_sites_own_or_above_its_noise_is_refused(
    largest: float, match: str
) -> None:
    """L is the coordinator's statement: a site refuses one that would leave its own noise
    uncovered or drown the round, before anything is charged; L is in the transcript (sites
    told different L open no shares of each other's) and never in the graph's seed (the
    coordinator cannot draw orders by varying it)."""
    rnd = start(40, honest=36, dropouts=2)
    assert rnd.graph is not None
    committed = CommittedRoster(rnd.roster, largest_share=largest)
    site = rnd.sites["site-0003"]
    part = committed.part(committed.ids)
    site.share(part, registered=rnd.registered, threshold=rnd.threshold, graph=rnd.graph)
    with pytest.raises(NoiseShareError, match=match):
        site.noise_share()
    true = CommittedRoster(rnd.roster)
    assert site.transcript == committed.transcript(rnd.threshold, rnd.graph)
    assert site.transcript != true.transcript(rnd.threshold, rnd.graph)
    assert committed.seed(rnd.threshold, rnd.graph) == true.seed(rnd.threshold, rnd.graph)
