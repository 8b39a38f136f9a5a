"""The sparse masking graph of the secure sum (prism_runtime.secure_sum.graph), end to end in one
process: every site derives the same graph, the sum is exact under the dropouts its
neighbourhoods tolerate, a pattern below a neighbourhood's threshold aborts with nothing
revealed, a site told another graph is caught before anything is revealed, and a site's mask
work is (k + 1) d words whatever n (counted, not timed)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    ConsistencyError,
    MaskedSum,
    MaskingGraph,
    RoundId,
    RoundTrust,
    RoundView,
    SecureSumAbortedError,
    ShareError,
    SiteRound,
    ThresholdError,
    centre,
    common_graph,
    confirming_signers,
    encode_signed,
    least_common_threshold,
    plan_unmask,
    round_transcript,
    sparse_parameters,
    unmask_sum,
)
from prism_runtime.secure_sum import masks as masks_module
from prism_runtime.secure_sum.graph import graph_abort, graph_failure

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
    transcript = round_transcript(rnd.threshold, rnd.roster.values(), rnd.graph)
    assert graph == MaskingGraph.derive(rnd.roster, degree=k, transcript=transcript)
    for s in rnd.sites:
        near = graph.neighbours(s)
        assert len(near) == k and s not in near
        assert all(s in graph.neighbours(p) for p in near)
    assert graph.edges() == 100 * k // 2
    other = MaskingGraph.derive(rnd.roster, degree=k, transcript=b"another run")
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
    graph = MaskingGraph.derive(rnd.roster, degree=5, transcript=b"ignored")
    assert graph.complete and graph.order == tuple(sorted(rnd.roster))
    alone = MaskingGraph.derive(["site-0000"], degree=0, transcript=b"")  # a one-site roster
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
    with pytest.raises(ConsistencyError, match="0 of 49 forwarded signatures verify"):
        confirming_signers(
            view,
            signatures,
            round_id=rnd.round_id,
            registered=rnd.registered,
            threshold=rnd.threshold,
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
