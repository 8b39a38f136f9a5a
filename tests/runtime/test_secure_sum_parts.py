"""The secure sum's parts one at a time: the mask stream, key agreement, Shamir sharing, the
share envelope and the ring Z_(2^b) (prism_runtime.secure_sum). Every comparison is exact."""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from prism_runtime.errors import ConfigError
from prism_runtime.secure_sum import (
    MAX_BITS,
    AdvertisedKeys,
    RoundId,
    RoundTrust,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    SharePair,
    ThresholdError,
    centre,
    check_threshold,
    combine_secret,
    encode_signed,
    expand_mask,
    least_common_threshold,
    mask_input,
    open_shares,
    pairwise_key,
    round_transcript,
    seal_shares,
    sign_keys,
    split_secret,
    sum_fits,
)
from prism_runtime.secure_sum._encoding import frame, unframe
from prism_runtime.secure_sum.shamir import FIELD_PRIME, share_length
from prism_runtime.secure_sum.wire import SHARE_BYTES

RFC8439_ZERO_KEY_BLOCK = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
"""ChaCha20 keystream block of the all-zero key, nonce and counter (RFC 8439, A.1 #1)."""


def test_expand_mask_is_the_chacha20_stream_of_the_full_32_byte_key() -> None:
    words = np.frombuffer(RFC8439_ZERO_KEY_BLOCK, dtype="<u8").astype(np.uint64)
    np.testing.assert_array_equal(expand_mask(bytes(32), 8, bits=MAX_BITS), words & (2**62 - 1))
    np.testing.assert_array_equal(expand_mask(bytes(32), 8, bits=16), words & 0xFFFF)

    key = os.urandom(32)
    mask = expand_mask(key, 1000, bits=62)
    np.testing.assert_array_equal(expand_mask(key, 1000, bits=62), mask)  # deterministic
    for byte in range(32):  # every key byte changes the whole stream: no fold of the key
        other = bytearray(key)
        other[byte] ^= 0x80
        changed = expand_mask(bytes(other), 1000, bits=62)
        assert int((changed == mask).sum()) == 0, byte  # a chance match has probability 2^-52
    with pytest.raises(ConfigError, match="full 32-byte key"):
        expand_mask(key[:16], 10, bits=32)


def test_pairwise_masks_cancel_and_only_the_self_masks_remain() -> None:
    bits, n = 32, 500
    ids = ["a", "b", "c"]
    keys = {frozenset(p): os.urandom(32) for p in itertools.combinations(ids, 2)}
    seeds = {s: os.urandom(32) for s in ids}
    zero = np.zeros(n, dtype=np.uint64)
    total = zero.copy()
    for s in ids:
        pairwise = {p: keys[frozenset((s, p))] for p in ids if p != s}
        total += mask_input(zero, site=s, self_seed=seeds[s], pairwise_keys=pairwise, bits=bits)
    self_masks = zero.copy()
    for s in ids:
        self_masks += expand_mask(seeds[s], n, bits=bits)
    np.testing.assert_array_equal(total & np.uint64(2**bits - 1), self_masks & np.uint64(2**32 - 1))


def test_pairwise_keys_agree_at_both_ends_and_bind_purpose_run_round_and_pair() -> None:
    a, b, c = (X25519PrivateKey.generate() for _ in range(3))
    pub = {
        name: k.public_key().public_bytes_raw() for name, k in zip("abc", (a, b, c), strict=True)
    }
    rid = RoundId("run-1", 4)
    ab = pairwise_key(a, pub["b"], purpose="pairwise-mask", round_id=rid, site="a", peer="b")
    ba = pairwise_key(b, pub["a"], purpose="pairwise-mask", round_id=rid, site="b", peer="a")
    assert ab == ba and len(ab) == 32
    variants = [
        pairwise_key(a, pub["b"], purpose="share-encryption", round_id=rid, site="a", peer="b"),
        pairwise_key(
            a, pub["b"], purpose="pairwise-mask", round_id=RoundId("run-1", 5), site="a", peer="b"
        ),
        pairwise_key(
            a, pub["b"], purpose="pairwise-mask", round_id=RoundId("run-2", 4), site="a", peer="b"
        ),
        pairwise_key(a, pub["b"], purpose="pairwise-mask", round_id=rid, site="a", peer="c"),
        pairwise_key(a, pub["c"], purpose="pairwise-mask", round_id=rid, site="a", peer="b"),
    ]
    assert len({ab, *variants}) == 1 + len(variants)


def test_any_threshold_shares_recover_the_secret_and_fewer_abort() -> None:
    holders = ["s0", "s1", "s2", "s3", "s4"]
    secret = os.urandom(32)
    shares = split_secret(secret, threshold=3, holders=holders)
    for subset in itertools.combinations(holders, 3):
        got = combine_secret(
            {h: shares[h] for h in subset},
            threshold=3,
            holders=holders,
            secret_bytes=32,
            what="the test secret",
        )
        assert got == secret, subset
    with pytest.raises(SecureSumAbortedError, match=r"2 shares of the test secret .* 3 are needed"):
        combine_secret(
            {h: shares[h] for h in holders[:2]},
            threshold=3,
            holders=holders,
            secret_bytes=32,
            what="the test secret",
        )
    swapped = {"s0": shares["s1"], "s1": shares["s0"], "s2": shares["s2"]}
    with pytest.raises(ShareError, match=r"returned by site 's0' is malformed .* index 2"):
        combine_secret(swapped, threshold=3, holders=holders, secret_bytes=32, what="the secret")


def test_fewer_than_threshold_shares_are_consistent_with_every_secret() -> None:
    """Perfect secrecy, checked on the field: for t - 1 shares of one secret and ANY other
    secret s', the t - 1 points and (0, s') lie on one polynomial of degree below t, whose
    value at a t-th holder's point, used as that holder's share, makes the shares combine to
    s'. So t - 1 shares rule out no secret."""
    holders = ["s0", "s1", "s2", "s3", "s4"]
    secret, other = os.urandom(32), os.urandom(32)
    shares = split_secret(secret, threshold=3, holders=holders)
    known = [(1, shares["s0"]), (2, shares["s1"])]
    xs, ys = [0, 1, 2], [int.from_bytes(other, "big")]
    ys += [int.from_bytes(share[4:], "big") for _, share in known]
    x = 5  # s4's point: the value there of the polynomial through (0, s'), s0's and s1's points
    value = 0
    for j, (xj, yj) in enumerate(zip(xs, ys, strict=True)):
        term = yj
        for m, xm in enumerate(xs):
            if m != j:
                term = term * (x - xm) * pow(xj - xm, -1, FIELD_PRIME) % FIELD_PRIME
        value = (value + term) % FIELD_PRIME
    forged = (5).to_bytes(4, "little") + value.to_bytes(66, "big")
    combined = combine_secret(
        {"s0": shares["s0"], "s1": shares["s1"], "s4": forged},
        threshold=3,
        holders=holders,
        secret_bytes=32,
        what="the test secret",
    )
    assert combined == other != secret


def test_every_share_is_one_field_element_and_the_coefficients_are_fresh() -> None:
    holders = [f"s{i}" for i in range(7)]
    secret = bytes(32)  # the zero secret: the shares are the random coefficients' work alone
    first = split_secret(secret, threshold=4, holders=holders)
    second = split_secret(secret, threshold=4, holders=holders)
    assert {len(share) for share in [*first.values(), *second.values()]} == {SHARE_BYTES}
    assert SHARE_BYTES == share_length(32) == 4 + 66
    for q, holder in enumerate(holders):
        assert int.from_bytes(first[holder][:4], "little") == q + 1
        assert int.from_bytes(first[holder][4:], "big") < FIELD_PRIME
        assert first[holder] != second[holder]  # equal with probability 2^-521


def test_a_share_outside_the_field_or_a_wrong_one_is_refused() -> None:
    """A value that is no field element is malformed; a random wrong value combines to a
    field element beyond 32 bytes (a change d to holder j's share moves the secret by d times
    j's Lagrange coefficient at 0; where that is small, as for consecutive holders, the result
    is a wrong 32-byte secret, left to the owner's commitment: ``test_secure_sum``)."""
    holders = ["s0", "s1", "s2", "s3"]
    secret = os.urandom(32)
    shares = split_secret(secret, threshold=3, holders=holders)
    kwargs: dict[str, Any] = {"threshold": 3, "holders": holders, "secret_bytes": 32}
    outside = (2).to_bytes(4, "little") + (FIELD_PRIME + 1).to_bytes(66, "big")
    with pytest.raises(ShareError, match=r"site 's1' is malformed: its value is not an element"):
        combine_secret({**shares, "s1": outside}, what="the secret", **kwargs)
    wrong = shares["s1"][:4] + secrets.randbelow(FIELD_PRIME).to_bytes(66, "big")
    with pytest.raises(ShareError, match=r"do not combine to a 32-byte secret"):
        combine_secret({**shares, "s1": wrong}, what="the secret", **kwargs)  # but for 2^-265
    with pytest.raises(ConfigError, match=r"a secret of 65 bytes"):
        split_secret(bytes(65), threshold=3, holders=holders)


@pytest.mark.parametrize(("threshold", "sites"), [(2, 4), (1, 3), (6, 5), (0, 1)])
def test_a_threshold_outside_half_to_all_sites_is_refused(threshold: int, sites: int) -> None:
    with pytest.raises(ConfigError, match=f"threshold {threshold} with {sites} sites"):
        check_threshold(threshold, sites)


def _advertisement(site: str, **change: object) -> AdvertisedKeys:
    keys = {
        "mask_public": bytes(32),
        "share_public": bytes([1]) * 32,
        "commitment": bytes([2]) * 32,
        "noise_share": 0.5,
        "trust": RoundTrust(3, 1),
    }
    keys.update(change)
    return sign_keys(
        round_id=RoundId("run-1", 2),
        site_id=site,
        identity_key=ec.generate_private_key(ec.SECP256R1()),
        **keys,  # type: ignore[arg-type]
    )


def test_the_transcript_names_the_threshold_graph_and_every_advertised_field() -> None:
    roster = [_advertisement(s) for s in "abcd"]
    base = round_transcript(3, roster)
    assert round_transcript(3, list(reversed(roster))) == base  # framed in id order
    others = [
        round_transcript(4, roster),
        round_transcript(3, roster, (2, 2)),
        round_transcript(3, roster[:3]),
        round_transcript(3, [*roster[:3], _advertisement("e")]),
    ]
    for change in (
        {"mask_public": bytes([9]) * 32},
        {"share_public": bytes([9]) * 32},
        {"commitment": bytes([9]) * 32},
        {"noise_share": 0.25},
        {"trust": RoundTrust(4, 1)},
        {"trust": RoundTrust(3, 0)},
    ):
        others.append(round_transcript(3, [*roster[:3], _advertisement("d", **change)]))
    assert len({base, *others}) == len(others) + 1


def test_sealed_shares_open_only_for_their_pair_direction_run_round_and_transcript() -> None:
    key, rid = os.urandom(32), RoundId("run-1", 2)
    pair = SharePair(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    transcript = round_transcript(3, [_advertisement(s) for s in "abcd"])
    sealed = seal_shares(key, pair, sender="a", receiver="b", round_id=rid, transcript=transcript)
    opened = open_shares(key, sealed, sender="a", receiver="b", round_id=rid, transcript=transcript)
    assert opened == pair
    same = {"transcript": transcript}
    wrong = [
        dict(key=key, sender="b", receiver="a", round_id=rid, **same),
        dict(key=key, sender="a", receiver="c", round_id=rid, **same),
        dict(key=key, sender="a", receiver="b", round_id=RoundId("run-1", 3), **same),
        dict(key=key, sender="a", receiver="b", round_id=RoundId("run-9", 2), **same),
        dict(key=os.urandom(32), sender="a", receiver="b", round_id=rid, **same),
        dict(key=key, sender="a", receiver="b", round_id=rid, transcript=os.urandom(32)),
    ]
    for kwargs in wrong:
        with pytest.raises(ShareError, match="fail authentication"):
            open_shares(kwargs.pop("key"), sealed, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ShareError, match="fail authentication"):
        open_shares(key, sealed[:10], sender="a", receiver="b", round_id=rid, transcript=transcript)


@pytest.mark.parametrize(
    ("honest", "dropouts", "sites", "least"),
    [
        (1, 0, 5, 5),  # a site counting on itself alone: every roster site must stay
        (2, 0, 5, 5),
        (2, 1, 5, 5),  # D = 1 but H - 1 - D = 0: no dropout can be tolerated
        (3, 1, 5, 4),
        (5, 2, 5, 3),  # every site honest: the majority of Bonawitz et al. (t > n / 2)
        (5, 1, 5, 4),
        (7, 3, 9, 6),
        (7, 2, 9, 7),
        (10, 4, 10, 6),
    ],
)
def test_the_least_threshold_is_the_condition_and_no_lower_t_meets_it(
    honest: int, dropouts: int, sites: int, least: int
) -> None:
    """``least_threshold`` is the least t with t >= n - D and t > (n - H) + D (checked by
    enumeration), and it implies 2 t > n + c with c = n - H (Bonawitz et al.'s active bound)."""
    trust = RoundTrust(honest, dropouts)
    c = sites - honest
    meets = [t for t in range(1, sites + 1) if t >= sites - dropouts and t > c + dropouts]
    assert trust.least_threshold(sites) == least == min(meets)
    assert 2 * least > sites + c
    trust.check_threshold(least, sites)
    with pytest.raises(ThresholdError, match=f"threshold {least - 1} for {sites} roster sites"):
        trust.check_threshold(least - 1, sites)
    with pytest.raises(ThresholdError, match=f"threshold {sites + 1}"):
        trust.check_threshold(sites + 1, sites)
    assert trust.share_divisor == honest - dropouts


def test_a_site_refuses_a_roster_smaller_than_its_honest_sites_or_more_missing_than_d() -> None:
    trust = RoundTrust(4, 1)
    with pytest.raises(ThresholdError, match="roster of 3 sites cannot hold the 4 honest"):
        trust.check_threshold(3, 3)
    trust.check_present(5, 6, "participants")
    with pytest.raises(SecureSumAbortedError, match="4 participants of 6 roster sites"):
        trust.check_present(4, 6, "participants")
    for honest, dropouts in [(2, 2), (1, 1), (0, 0), (3, -1)]:
        with pytest.raises(ConfigError):
            RoundTrust(honest, dropouts)


def test_the_coordinators_threshold_is_the_least_every_site_accepts() -> None:
    trusts = [RoundTrust(5, 2), RoundTrust(3, 1), RoundTrust(5, 0)]
    assert least_common_threshold(trusts, 5) == 5  # D = 0 at the third: no dropout
    assert least_common_threshold(trusts[:2], 5) == 4
    assert least_common_threshold(trusts[:1], 5) == 3
    assert least_common_threshold([RoundTrust(6, 0), *trusts], 5) is None  # H = 6 > 5 sites
    for trust in trusts:
        trust.check_threshold(5, 5)


def test_encode_and_centre_round_trip_signed_integers_at_every_width() -> None:
    for bits in (1, 2, 16, 32, 62):
        bound = (1 << (bits - 1)) - 1 if bits > 1 else 0
        values = np.array([0, bound, -bound, bound // 3, -(bound // 7)], dtype=np.int64)
        encoded = encode_signed(torch.from_numpy(values), bits=bits, bound=bound)
        assert encoded.dtype == np.uint64 and int(encoded.max()) < 1 << bits
        np.testing.assert_array_equal(centre(encoded, bits=bits), values)
    assert centre(np.array([1 << 61], dtype=np.uint64), bits=62)[0] == -(1 << 61)
    assert sum_fits(sites=2, bound=(1 << 60) - 1, bits=62)
    assert not sum_fits(sites=2, bound=1 << 60, bits=62)


def test_field_boundaries_refuse_bad_vectors_and_widths() -> None:
    with pytest.raises(ConfigError, match="bits is 63"):
        encode_signed(np.zeros(2, dtype=np.int64), bits=63, bound=1)
    with pytest.raises(ConfigError, match="bits is 0"):
        centre(np.zeros(2, dtype=np.uint64), bits=0)
    with pytest.raises(SecureSumError, match="dtype float32"):
        encode_signed(np.zeros(2, dtype=np.float32), bits=32, bound=1)
    with pytest.raises(SecureSumError, match="has a value >= 2\\^16"):
        centre(np.array([1 << 16], dtype=np.uint64), bits=16)
    with pytest.raises(SecureSumError, match="1-D numpy uint64"):
        mask_input(
            np.zeros(3, dtype=np.int64),
            site="a",
            self_seed=os.urandom(32),
            pairwise_keys={},
            bits=32,
        )


def test_framing_tags_and_length_prefixes_every_field() -> None:
    """Each field is its 4-byte big-endian length, a type tag and the value (ints as 8-byte
    signed big-endian), whatever the field's exact type; bools are refused; bytes fields frame
    back with ``unframe``."""
    framed = frame(b"ab", "c", 5, -1, bytearray(b"x"))
    assert framed == (
        b"\x00\x00\x00\x03bab"
        + b"\x00\x00\x00\x02sc"
        + b"\x00\x00\x00\x09i"
        + (5).to_bytes(8, "big")
        + b"\x00\x00\x00\x09i"
        + (-1).to_bytes(8, "big", signed=True)
        + b"\x00\x00\x00\x02bx"
    )
    assert frame("a", "b") != frame("ab") and frame(1, 2) != frame(12)
    with pytest.raises(TypeError, match="not bool"):
        frame(b"a", True)
    assert unframe(frame(b"", b"one", bytes(40))) == [b"", b"one", bytes(40)]
