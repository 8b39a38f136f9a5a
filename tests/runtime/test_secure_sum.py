"""The secure sum end to end, sites and coordinator in one process (prism_runtime.secure_sum).

A round runs every step of the protocol: K sites advertise signed keys, verify the roster, seal
and exchange their Shamir shares, mask their inputs; the coordinator plans the unmasking, the
survivors sign their sets, answer with the signatures forwarded, and ``unmask_sum`` returns the
sum. Sums are compared exactly (integers, no
tolerance). The uniformity test is a chi-square test with significance 1e-6 whose power against
a 1%-unmasked input is computed (non-central chi-square) and asserted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from scipy import stats

from prism_runtime.secure_sum import (
    AdvertisedKeys,
    ConsistencyError,
    KeyBindingError,
    MasksUsedError,
    NoiseShareError,
    RoundDecisions,
    RoundId,
    RoundTrust,
    SecureSumAbortedError,
    ShareError,
    SiteRound,
    SumOverflowError,
    ThresholdError,
    UnmaskRequest,
    UnmaskResponse,
    centre,
    check_sum_fits,
    encode_signed,
    mask_input,
    plan_unmask,
    sign_keys,
    sign_view,
    sum_fits,
    unmask_sum,
)

Vector = npt.NDArray[np.uint64]


@dataclass
class Round:
    """One round's sites and the coordinator's view of them."""

    round_id: RoundId
    sites: dict[str, SiteRound]
    identities: dict[str, ec.EllipticCurvePrivateKey]
    registered: dict[str, ec.EllipticCurvePublicKey]
    roster: dict[str, AdvertisedKeys]
    threshold: int
    bits: int


def trust_for(k: int, threshold: int) -> RoundTrust:
    """H = K (every site honest) and the D that makes ``threshold`` the least t for K sites."""
    return RoundTrust(k, k - threshold)


def start_round(
    k: int,
    *,
    threshold: int,
    bits: int,
    server_round: int = 1,
    identities: dict[str, ec.EllipticCurvePrivateKey] | None = None,
) -> Round:
    """K sites ``s0 .. s{K-1}`` with registered P-256 identities (new ones unless given), each
    advertising fresh round keys; each counts on all K being honest and tolerates
    ``K - threshold`` missing."""
    round_id = RoundId("run-1", server_round)
    ids = [f"s{i}" for i in range(k)]
    if identities is None:
        identities = {s: ec.generate_private_key(ec.SECP256R1()) for s in ids}
    sites = {
        s: SiteRound(
            site_id=s,
            round_id=round_id,
            identity_key=identities[s],
            bits=bits,
            noise_share=12.5,
            trust=trust_for(k, threshold),
        )
        for s in ids
    }
    return Round(
        round_id=round_id,
        sites=sites,
        identities=identities,
        registered={s: key.public_key() for s, key in identities.items()},
        roster={s: site.advertised for s, site in sites.items()},
        threshold=threshold,
        bits=bits,
    )


def relay_shares(rnd: Round, sharing: Collection[str]) -> list[str]:
    """The sites in ``sharing`` split and seal their secrets; the coordinator relays the
    ciphertexts to every roster site that shared; returns the participants (``U2``)."""
    sealed = {
        s: rnd.sites[s].share(rnd.roster, registered=rnd.registered, threshold=rnd.threshold)
        for s in sorted(sharing)
    }
    for receiver in sharing:
        rnd.sites[receiver].receive(
            {s: box[receiver] for s, box in sealed.items() if s != receiver}
        )
    return sorted(sharing)


def finish_round(
    rnd: Round,
    inputs: dict[str, Vector],
    *,
    participants: Collection[str],
    masked_from: Collection[str],
    answering: Collection[str],
) -> Vector:
    """Sites in ``masked_from`` send masked inputs and sign their sets; those in ``answering``
    answer with the signatures forwarded; the sum."""
    masked = {s: rnd.sites[s].mask(inputs[s], participants=participants) for s in masked_from}
    request = plan_unmask(masked, participants=participants, threshold=rnd.threshold)
    signatures = sign_views(rnd, request)
    answers = [answer(rnd, s, request, signatures) for s in answering]
    return unmask_sum(
        masked,
        answers,
        roster=rnd.roster,
        participants=participants,
        threshold=rnd.threshold,
        bits=rnd.bits,
        round_id=rnd.round_id,
    )


def sign_views(rnd: Round, request: UnmaskRequest) -> dict[str, bytes]:
    """Every survivor's signature of its participants and ``request``'s survivors."""
    return {
        s: rnd.sites[s].sign_view(request.survivors, identity_key=rnd.identities[s])
        for s in request.survivors
    }


def answer(
    rnd: Round, site: str, request: UnmaskRequest, signatures: dict[str, bytes]
) -> UnmaskResponse:
    """``site``'s answer to ``request`` with ``signatures`` forwarded."""
    return rnd.sites[site].answer(request, signatures=signatures, registered=rnd.registered)


def signed_inputs(k: int, length: int, *, bits: int, seed: int) -> tuple[int, np.ndarray]:
    """The largest bound M with K M < 2^(b-1) and K x length signed integers in [-M, M]."""
    bound = ((1 << (bits - 1)) - 1) // k
    rng = np.random.default_rng(seed)  # test data only; the masks never use numpy's generators
    return bound, rng.integers(-bound, bound, size=(k, length), endpoint=True, dtype=np.int64)


@pytest.mark.parametrize(
    ("k", "bits", "length"),
    [(2, 16, 1), (3, 32, 1000), (4, 62, 64), (5, 16, 333), (6, 62, 2048), (8, 32, 4096)],
)
def test_sum_of_masked_inputs_equals_the_plain_sum_exactly(k: int, bits: int, length: int) -> None:
    rnd = start_round(k, threshold=k // 2 + 1, bits=bits)
    bound, plain = signed_inputs(k, length, bits=bits, seed=k * 1000 + bits)
    inputs = {f"s{i}": encode_signed(plain[i], bits=bits, bound=bound) for i in range(k)}
    participants = relay_shares(rnd, rnd.sites)

    total = finish_round(
        rnd, inputs, participants=participants, masked_from=participants, answering=participants
    )

    modular = sum((v.astype(object) for v in inputs.values()), start=np.zeros(length, object))
    assert total.dtype == np.uint64
    assert [int(v) for v in total] == [int(v) % (1 << bits) for v in modular]
    np.testing.assert_array_equal(centre(total, bits=bits), plain.sum(axis=0))


def _chi_square_top_bits(values: Vector, *, bits: int) -> float:
    """Pearson's statistic of the top 8 bits of ``values`` against 256 equal buckets."""
    counts = np.bincount((values >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    expected = values.size / 256
    return float(((counts - expected) ** 2 / expected).sum())


ALPHA = 1e-6
"""Significance of the uniformity test: a correct mask fails it with probability 1e-6."""
UNIFORM_N = 20_000
"""Coordinates tested (about 78 per bucket)."""
LEAK = 0.01
"""The alternative: 1% of the coordinates left unmasked (they keep the plain value)."""


def _critical_value_and_power() -> tuple[float, float]:
    """The chi-square(255) critical value at ``ALPHA`` and the test's power against ``LEAK``.

    Under the alternative the counts follow a multinomial with p1 = (1 - LEAK) / 256 in every
    bucket plus LEAK in the plain value's bucket; Pearson's statistic is then approximately
    non-central chi-square with 255 degrees of freedom and non-centrality
    n sum (p1 - p0)^2 / p0 (about 510 here).
    """
    p0 = np.full(256, 1 / 256)
    p1 = (1 - LEAK) * p0
    p1[0] += LEAK  # the plain value 0 or 1 lies in the lowest bucket of the top 8 bits
    noncentrality = UNIFORM_N * float(((p1 - p0) ** 2 / p0).sum())
    critical = float(stats.chi2.isf(ALPHA, 255))
    return critical, float(stats.ncx2.sf(critical, 255, noncentrality))


@pytest.mark.parametrize("plain_value", [0, 1])
def test_one_sites_masked_input_is_indistinguishable_from_uniform(plain_value: int) -> None:
    """Chi-square over the 256 top-8-bit buckets of 20,000 coordinates at b = 32, alpha 1e-6.

    Power against a mask that leaves 1% of coordinates unmasked is above 1 - 1e-12 (computed;
    and an actual such leak is rejected below). Two views are tested: the masked input a site
    sends, and what is left once its pairwise keys are known (x plus the self mask only, the
    coordinator's view of a site it wrongly declared dropped).
    """
    bits = 32
    critical, power = _critical_value_and_power()
    assert power > 1 - 1e-12
    rnd = start_round(3, threshold=2, bits=bits)
    participants = relay_shares(rnd, rnd.sites)
    plain = np.full(UNIFORM_N, plain_value, dtype=np.uint64)
    sent = rnd.sites["s1"].mask(plain, participants=participants)
    self_masked_only = mask_input(
        plain, site="s1", self_seed=os.urandom(32), pairwise_keys={}, bits=bits
    )

    assert _chi_square_top_bits(sent, bits=bits) < critical
    assert _chi_square_top_bits(self_masked_only, bits=bits) < critical
    leaky = sent.copy()
    leaky[: int(LEAK * UNIFORM_N)] = plain_value
    assert _chi_square_top_bits(leaky, bits=bits) > critical


def test_a_site_that_drops_after_sending_its_masked_input_is_recovered() -> None:
    """s2 sends its masked input, then never answers: its self mask is removed with the seed
    shares the others return, and the sum includes its input."""
    k, bits = 5, 32
    rnd = start_round(k, threshold=3, bits=bits)
    bound, plain = signed_inputs(k, 100, bits=bits, seed=1)
    inputs = {f"s{i}": encode_signed(plain[i], bits=bits, bound=bound) for i in range(k)}
    participants = relay_shares(rnd, rnd.sites)

    total = finish_round(
        rnd,
        inputs,
        participants=participants,
        masked_from=participants,
        answering=["s0", "s1", "s3", "s4"],
    )

    np.testing.assert_array_equal(centre(total, bits=bits), plain.sum(axis=0))


def test_a_site_that_drops_before_sending_its_masked_input_is_recovered() -> None:
    """s1 shares its secrets but sends no masked input: the others' pairwise masks with s1 are
    removed with its mask-key shares, and the sum is that of the other sites. s4 advertised keys
    and then dropped before sharing (it is a holder but no participant); s3 also drops after
    masking, so both kinds of recovery run in one round."""
    k, bits = 6, 62
    rnd = start_round(k, threshold=4, bits=bits)
    bound, plain = signed_inputs(k, 257, bits=bits, seed=2)
    inputs = {f"s{i}": encode_signed(plain[i], bits=bits, bound=bound) for i in range(k)}
    participants = relay_shares(rnd, ["s0", "s1", "s2", "s3", "s5"])
    survivors = ["s0", "s2", "s3", "s5"]

    total = finish_round(
        rnd,
        inputs,
        participants=participants,
        masked_from=survivors,
        answering=["s0", "s2", "s5", "s3"],
    )

    expected = plain[[0, 2, 3, 5]].sum(axis=0)
    np.testing.assert_array_equal(centre(total, bits=bits), expected)


def test_fewer_than_threshold_survivors_abort_before_anything_is_unmasked() -> None:
    k, bits = 5, 16
    rnd = start_round(k, threshold=3, bits=bits)
    bound, plain = signed_inputs(k, 10, bits=bits, seed=3)
    inputs = {f"s{i}": encode_signed(plain[i], bits=bits, bound=bound) for i in range(k)}
    participants = relay_shares(rnd, rnd.sites)
    masked = {s: rnd.sites[s].mask(inputs[s], participants=participants) for s in ["s0", "s1"]}

    with pytest.raises(SecureSumAbortedError, match=r"2 masked inputs arrived .* needs 3"):
        plan_unmask(masked, participants=participants, threshold=3)
    with pytest.raises(SecureSumAbortedError, match=r"2 masked inputs arrived .* needs 3"):
        unmask_sum(
            masked,
            [],
            roster=rnd.roster,
            participants=participants,
            threshold=3,
            bits=bits,
            round_id=rnd.round_id,
        )
    # a site asked to sign 2 survivors refuses (3 of its 5 roster sites missing, it tolerates
    # 2) and signs nothing: it then signs a view of enough survivors
    with pytest.raises(SecureSumAbortedError, match=r"2 survivors of 5 roster sites"):
        rnd.sites["s0"].sign_view({"s0", "s1"}, identity_key=rnd.identities["s0"])
    assert rnd.sites["s0"].sign_view({"s0", "s1", "s2"}, identity_key=rnd.identities["s0"])


def test_too_few_answers_or_shares_abort_with_the_counts() -> None:
    k, bits = 5, 32
    rnd = start_round(k, threshold=3, bits=bits)
    participants = relay_shares(rnd, rnd.sites)
    x = np.zeros(8, dtype=np.uint64)
    masked = {s: rnd.sites[s].mask(x, participants=participants) for s in participants}
    request = plan_unmask(masked, participants=participants, threshold=3)
    signatures = sign_views(rnd, request)
    answers = [answer(rnd, s, request, signatures) for s in participants]

    def unmask(responses: list[UnmaskResponse]) -> Vector:
        return unmask_sum(
            masked,
            responses,
            roster=rnd.roster,
            participants=participants,
            threshold=3,
            bits=bits,
            round_id=rnd.round_id,
        )

    with pytest.raises(SecureSumAbortedError, match=r"2 survivors answered .* needs 3"):
        unmask(answers[:2])
    thinned = [
        UnmaskResponse(a.site_id, {u: v for u, v in a.seed_shares.items() if u != "s4"}, {})
        for a in answers[:3]
    ] + answers[3:4]
    with pytest.raises(
        SecureSumAbortedError,
        match=r"too few shares .*\(1 for the self-mask seed of 's4'\) .* needs 3",
    ):
        unmask(thinned)
    np.testing.assert_array_equal(unmask(answers), x)


def test_a_wrong_returned_share_is_caught_against_the_owners_commitment() -> None:
    """A well-formed share with altered content rebuilds a wrong secret: the seed fails its
    signed commitment, the mask private key its signed public key; the error names the owner."""
    rnd = start_round(5, threshold=3, bits=32)
    participants = relay_shares(rnd, rnd.sites)
    x = np.zeros(8, dtype=np.uint64)
    survivors = ["s0", "s1", "s2", "s3"]
    masked = {s: rnd.sites[s].mask(x, participants=participants) for s in survivors}
    request = plan_unmask(masked, participants=participants, threshold=3)
    signatures = sign_views(rnd, request)
    answers = [answer(rnd, s, request, signatures) for s in survivors]

    def corrupt(share: bytes) -> bytes:
        # the value's lowest bit; index kept: the shares used are the first three holders'
        # (x = 1, 2, 3), whose Lagrange coefficients at 0 are 3, -3 and 1: the secret moves by
        # a few units and stays 32 bytes
        return share[:-1] + bytes([share[-1] ^ 0x01])

    first = answers[0]
    bad_seed = UnmaskResponse(
        first.site_id,
        {**first.seed_shares, "s2": corrupt(first.seed_shares["s2"])},
        first.key_shares,
    )
    bad_key = UnmaskResponse(
        first.site_id,
        first.seed_shares,
        {**first.key_shares, "s4": corrupt(first.key_shares["s4"])},
    )
    for response, message in [
        (bad_seed, "self-mask seed of site 's2' rebuilt from shares does not match"),
        (bad_key, "mask private key of site 's4' rebuilt from shares does not match"),
    ]:
        with pytest.raises(ShareError, match=message):
            unmask_sum(
                masked,
                [response, *answers[1:]],
                roster=rnd.roster,
                participants=participants,
                threshold=3,
                bits=32,
                round_id=rnd.round_id,
            )


def test_a_substituted_public_key_is_detected_and_names_the_site() -> None:
    rnd = start_round(4, threshold=3, bits=32)
    honest = rnd.roster["s2"]
    coordinator = SiteRound(
        site_id="s2",
        round_id=rnd.round_id,
        identity_key=rnd.identities["s0"],
        bits=32,
        noise_share=12.5,
        trust=trust_for(4, 3),
    ).advertised  # the coordinator's own X25519 keys, signed with a key that is not s2's
    substitutes = {
        "mask key swapped in": dataclasses.replace(honest, mask_public=coordinator.mask_public),
        "re-signed by another identity": coordinator,
        "replayed from another round": start_round(4, threshold=3, bits=32, server_round=2)
        .sites["s2"]
        .advertised,
        # the noise share s2 needs every honest site to add, understated by the coordinator
        "noise share lowered": dataclasses.replace(honest, noise_share=honest.noise_share / 2),
        # the H and D the coordinator picks the threshold from, changed by the coordinator
        "honest sites raised": dataclasses.replace(honest, honest_sites=honest.honest_sites + 1),
        "dropouts lowered": dataclasses.replace(honest, max_dropouts=0),
    }
    for what, forged in substitutes.items():
        roster = {**rnd.roster, "s2": forged}
        with pytest.raises(KeyBindingError, match="site 's2'") as caught:
            rnd.sites["s0"].share(roster, registered=rnd.registered, threshold=3)
        assert "do not verify against its registered identity key" in str(caught.value), what

    stranger = ec.generate_private_key(ec.SECP256R1())
    unregistered = sign_keys(
        round_id=rnd.round_id,
        site_id="s9",
        mask_public=honest.mask_public,
        share_public=honest.share_public,
        commitment=honest.seed_commitment,
        identity_key=stranger,
        noise_share=12.5,
        trust=trust_for(4, 3),
    )
    with pytest.raises(KeyBindingError, match=r"site 's9' .* no registered identity key"):
        rnd.sites["s0"].share(  # a roster of 5: threshold 4 meets s0's condition
            {**rnd.roster, "s9": unregistered}, registered=rnd.registered, threshold=4
        )
    own_swapped = {**rnd.roster, "s0": coordinator}
    with pytest.raises(KeyBindingError, match="does not carry the keys site 's0' advertised"):
        rnd.sites["s0"].share(own_swapped, registered=rnd.registered, threshold=3)
    assert rnd.sites["s0"].share(rnd.roster, registered=rnd.registered, threshold=3)


def test_a_tampered_or_misdirected_encrypted_share_is_refused() -> None:
    rnd = start_round(4, threshold=3, bits=32)
    sealed = {
        s: site.share(rnd.roster, registered=rnd.registered, threshold=3)
        for s, site in rnd.sites.items()
    }
    for_s0 = {s: box["s0"] for s, box in sealed.items() if s != "s0"}
    tampered = bytearray(for_s0["s2"])
    tampered[-1] ^= 0x01
    with pytest.raises(ShareError, match="from site 's2' to site 's0' fail authentication"):
        rnd.sites["s0"].receive({**for_s0, "s2": bytes(tampered)})
    with pytest.raises(ShareError, match="from site 's2' to site 's0' fail authentication"):
        rnd.sites["s0"].receive({**for_s0, "s2": sealed["s2"]["s1"]})  # sealed for s1
    with pytest.raises(ShareError, match="from site 's3' to site 's0' fail authentication"):
        rnd.sites["s0"].receive({**for_s0, "s3": sealed["s1"]["s0"]})  # s1's, claimed as s3's
    rnd.sites["s0"].receive(for_s0)  # the untouched ciphertexts open


def test_shares_sealed_for_another_threshold_or_roster_do_not_open() -> None:
    """A coordinator that tells sites different thresholds or rosters gets sites whose shares
    do not open at each other: every holder of a site's shares holds them for the one t and
    roster that site checked."""
    rnd = start_round(4, threshold=3, bits=32)
    higher = rnd.sites["s1"].share(rnd.roster, registered=rnd.registered, threshold=4)
    rnd.sites["s0"].share(rnd.roster, registered=rnd.registered, threshold=3)
    with pytest.raises(ShareError, match=r"from site 's1' to site 's0' .* another threshold"):
        rnd.sites["s0"].receive({"s1": higher["s0"]})

    # s1 told a roster without s3: its roster of 3 cannot hold the 4 honest sites s0 counts on
    # here, and the envelope's associated data binds the roster too (test_secure_sum_parts)


def _masked_round(k: int, threshold: int) -> tuple[Round, list[str]]:
    rnd = start_round(k, threshold=threshold, bits=32)
    participants = relay_shares(rnd, rnd.sites)
    for s in participants:
        rnd.sites[s].mask(np.zeros(4, dtype=np.uint64), participants=participants)
    return rnd, participants


def test_a_site_signs_one_view_and_reveals_shares_for_it_only() -> None:
    """The consistency check at one site: it signs its participants and one survivor set (the
    same again, never another), and answers only a request naming exactly that view, with t
    valid signatures of it from survivors: never both secrets of one site."""
    rnd, _ = _masked_round(5, 3)
    site, key = rnd.sites["s0"], rnd.identities["s0"]
    view = plan_unmask(["s0", "s1", "s2", "s3"], participants=rnd.sites, threshold=3)
    signatures = sign_views(rnd, view)
    assert site.sign_view(view.survivors, identity_key=key)  # the same view again
    with pytest.raises(ConsistencyError, match="signed another survivor set"):
        site.sign_view({"s0", "s1", "s2"}, identity_key=key)

    answered = answer(rnd, "s0", view, signatures)
    assert set(answered.seed_shares) == {"s0", "s1", "s2", "s3"}
    assert set(answered.key_shares) == {"s4"}
    flipped = UnmaskRequest(frozenset({"s0", "s1", "s2"}), frozenset({"s3", "s4"}))
    both = UnmaskRequest(frozenset({"s0", "s1", "s2", "s3"}), frozenset({"s3", "s4"}))
    for other in (flipped, both):
        with pytest.raises(ConsistencyError, match="not the 4 and 1 site 's0' signed"):
            answer(rnd, "s0", other, signatures)


def test_signatures_that_do_not_confirm_the_view_reveal_nothing() -> None:
    """Fewer than t valid signatures on exactly the site's sets: signatures of another view,
    of another round, of a non-survivor, of an unpinned signer or altered bytes do not count."""
    rnd, participants = _masked_round(5, 3)
    view = plan_unmask(["s0", "s1", "s2", "s3"], participants=participants, threshold=3)
    good = sign_views(rnd, view)
    other_view = rnd.sites["s1"].view({"s1", "s2", "s3", "s4"})
    stranger = ec.generate_private_key(ec.SECP256R1())
    forged = {
        "another view": sign_view(
            other_view, round_id=rnd.round_id, site_id="s1", identity_key=rnd.identities["s1"]
        ),
        "another round": sign_view(
            rnd.sites["s1"].view(view.survivors),
            round_id=RoundId("run-1", 2),
            site_id="s1",
            identity_key=rnd.identities["s1"],
        ),
        "an unpinned key": sign_view(
            rnd.sites["s1"].view(view.survivors),
            round_id=rnd.round_id,
            site_id="s1",
            identity_key=stranger,
        ),
        "altered bytes": good["s1"][:-1] + bytes([good["s1"][-1] ^ 1]),
    }
    for what, bad in forged.items():
        two_good = {"s0": good["s0"], "s2": good["s2"], "s1": bad}
        with pytest.raises(ConsistencyError, match="2 of 3 forwarded signatures verify"):
            answer(rnd, "s0", view, two_good)
        assert what
    dropped_signer = sign_view(
        rnd.sites["s4"].view(view.survivors),
        round_id=rnd.round_id,
        site_id="s4",
        identity_key=rnd.identities["s4"],
    )
    with pytest.raises(ConsistencyError, match="fewer than the threshold 3"):  # s4 not forwarded
        answer(rnd, "s0", view, {"s0": good["s0"], "s2": good["s2"], "s4": dropped_signer})
    assert answer(rnd, "s0", view, {s: good[s] for s in ("s0", "s1", "s2")}).seed_shares


def test_signatures_from_an_earlier_run_of_the_round_confirm_nothing() -> None:
    """A coordinator that runs one round id twice, gathering signatures of a view in the first
    run, cannot use them in the second (same sites, same sets, fresh round keys): the signed
    transcript names the run, so none of them verifies and nothing is revealed."""
    first, participants = _masked_round(5, 3)
    view = plan_unmask(["s0", "s1", "s2", "s3"], participants=participants, threshold=3)
    earlier = sign_views(first, view)
    second = start_round(5, threshold=3, bits=32, identities=first.identities)
    assert second.round_id == first.round_id
    for s in relay_shares(second, second.sites):
        second.sites[s].mask(np.zeros(4, dtype=np.uint64), participants=participants)
    own = sign_views(second, view)
    with pytest.raises(ConsistencyError, match="0 of 4 forwarded signatures verify"):
        answer(second, "s0", view, earlier)
    with pytest.raises(ConsistencyError, match="2 of 4 forwarded signatures verify"):
        answer(second, "s0", view, {**earlier, "s0": own["s0"], "s1": own["s1"]})
    assert answer(second, "s0", view, own).seed_shares.keys() == view.survivors


def test_a_site_masks_one_input_per_round() -> None:
    """Two masked inputs of one round would give the coordinator their difference."""
    rnd = start_round(3, threshold=2, bits=32)
    participants = relay_shares(rnd, rnd.sites)
    rnd.sites["s0"].mask(np.zeros(4, dtype=np.uint64), participants=participants)
    with pytest.raises(MasksUsedError, match="'s0' already masked its input this round"):
        rnd.sites["s0"].mask(np.ones(4, dtype=np.uint64), participants=participants)


def test_decisions_recalled_into_an_older_state_stay_decided() -> None:
    """A state saved before a stage's reply left (a lost save of the node's memory) takes in
    the durable record: it neither masks again nor signs another view; a state of other masks
    is refused as stale."""
    rnd = start_round(3, threshold=2, bits=32)
    site = rnd.sites["s0"]
    before_share = SiteRound.from_bytes(site.to_bytes())
    assert before_share.decisions() == RoundDecisions(site.masks_id, None, None, None)
    participants = relay_shares(rnd, rnd.sites)
    before_mask = SiteRound.from_bytes(site.to_bytes())
    site.mask(np.zeros(4, dtype=np.uint64), participants=participants)
    site.sign_view(set(participants), identity_key=rnd.identities["s0"])
    record = RoundDecisions.from_json(site.decisions().to_json())
    assert record.participants == frozenset(participants) and record.threshold == 2
    before_mask.recall(record)
    with pytest.raises(MasksUsedError, match="already masked"):
        before_mask.mask(np.ones(4, dtype=np.uint64), participants=participants)
    with pytest.raises(ConsistencyError, match="signed another survivor set"):
        before_mask.sign_view({"s0", "s1"}, identity_key=rnd.identities["s0"])
    with pytest.raises(MasksUsedError, match="shared its secrets this round already"):
        before_share.recall(record)
    with pytest.raises(MasksUsedError, match="not the one of its durable record"):
        rnd.sites["s1"].recall(record)


def test_what_mask_refuses_is_refused_before_the_input_exists() -> None:
    """A site checks the participants before it spends anything on its input: the same
    refusals as ``mask``, and nothing recorded, so a valid list still masks afterwards."""
    rnd = start_round(4, threshold=3, bits=32)
    participants = relay_shares(rnd, rnd.sites)
    site = rnd.sites["s0"]
    with pytest.raises(SecureSumAbortedError, match="2 participants of 4 roster sites"):
        site.check_participants({"s0", "s1"})
    with pytest.raises(ConsistencyError, match="holds no shares from"):
        site.check_participants({*participants, "s9"})
    assert site.check_participants(participants) == frozenset(participants)
    site.mask(np.zeros(4, dtype=np.uint64), participants=participants)
    with pytest.raises(MasksUsedError, match="already masked its input this round"):
        site.check_participants(participants)


def test_a_roster_or_threshold_below_the_sites_condition_is_refused_before_sharing() -> None:
    """t >= n - D and t > n - H + D (``RoundTrust``): a site refuses a smaller threshold, a
    roster smaller than its H, and shares nothing."""
    rnd = start_round(5, threshold=4, bits=32)  # H = 5, D = 1: least t = 4
    site = rnd.sites["s0"]
    with pytest.raises(ThresholdError, match=r"threshold 3 for 5 roster sites: .* 4\.\.5"):
        site.share(rnd.roster, registered=rnd.registered, threshold=3)
    four = {s: rnd.roster[s] for s in ("s0", "s1", "s2", "s3")}
    with pytest.raises(ThresholdError, match="roster of 4 sites cannot hold the 5 honest"):
        site.share(four, registered=rnd.registered, threshold=4)
    assert site.share(rnd.roster, registered=rnd.registered, threshold=4)


@pytest.mark.parametrize(("share", "accepted"), [(25.0, True), (2.0**50, False)])
def test_a_noise_share_above_the_sites_whole_noise_is_refused(share: float, accepted: bool) -> None:
    """Each site adds the largest share a roster site signed, up to its own whole noise
    ``(H - D) x`` its share (here 2 x 12.5): a roster site signing more (the codec's largest,
    2^50, would drown every round) is refused before anything is charged."""
    rnd = start_round(3, threshold=2, bits=32)  # H = 3, D = 1
    rnd.sites["s2"] = SiteRound(
        site_id="s2",
        round_id=rnd.round_id,
        identity_key=rnd.identities["s2"],
        bits=32,
        noise_share=share,
        trust=trust_for(3, 2),
    )
    rnd.roster["s2"] = rnd.sites["s2"].advertised
    relay_shares(rnd, rnd.sites)
    if accepted:
        assert rnd.sites["s0"].noise_share() == share
    else:
        with pytest.raises(NoiseShareError, match="more than this site's whole noise 25"):
            rnd.sites["s0"].noise_share()


def test_overflow_bound_just_inside_is_exact_and_just_outside_is_refused() -> None:
    """K = 4 sites at b = 16: M = 8191 gives K M = 32764 < 2^15; M = 8192 gives 2^15."""
    k, bits = 4, 16
    inside, outside = 8191, 8192
    assert sum_fits(sites=k, bound=inside, bits=bits)
    assert not sum_fits(sites=k, bound=outside, bits=bits)
    check_sum_fits(sites=k, bound=inside, bits=bits)
    with pytest.raises(SumOverflowError, match="4 sites x bound 8192 = 32768 >= 2\\^15"):
        check_sum_fits(sites=k, bound=outside, bits=bits)

    rnd = start_round(k, threshold=3, bits=bits)
    participants = relay_shares(rnd, rnd.sites)
    column = np.array([inside, -inside, 0], dtype=np.int64)
    plain = np.stack([column, column, column, column])  # all sites at +M, at -M, at 0
    plain = np.concatenate([plain, np.array([[inside], [-inside], [inside], [-inside]])], axis=1)
    inputs = {f"s{i}": encode_signed(plain[i], bits=bits, bound=inside) for i in range(k)}
    total = finish_round(
        rnd, inputs, participants=participants, masked_from=participants, answering=participants
    )
    np.testing.assert_array_equal(centre(total, bits=bits), plain.sum(axis=0))
    assert centre(total, bits=bits)[0] == k * inside == 32764
    assert centre(total, bits=bits)[1] == -k * inside

    # one past the bound: K sites at +8192 sum to 2^15, which centres to -2^15 (wrong)
    wrapped = np.array([(k * outside) % (1 << bits)], dtype=np.uint64)
    assert centre(wrapped, bits=bits)[0] == -(1 << 15) != k * outside
    with pytest.raises(SumOverflowError, match="\\|x\\| = 8192 > bound 8191"):
        encode_signed(np.array([outside]), bits=bits, bound=inside)
