"""The cryptographic core of a secure sum (SecAgg+-style; Bonawitz et al. 2017, Bell et al. 2020).

Sites add integer vectors in Z_(2^b) so that the coordinator learns only their sum, even when
some sites drop out mid-round (docs/design.md §3.3). The pieces, pure functions and one small
per-round class over bytes and numpy uint64 vectors, with no network:

- ``keys``: per-round X25519 key pairs (one for masks, one for share encryption), pairwise keys
  by HKDF-SHA256 bound to run, round and both site ids, and advertisements signed with the
  site's ECDSA P-256 identity key so that a substituted public key is detected;
- ``masks``: masks expanded from a full 32-byte key with ChaCha20, a self mask per site and
  pairwise masks that cancel in the sum;
- ``shamir``: threshold sharing of each site's seed and mask private key (Flower's GF(2^128)
  Shamir, with the threshold, index and length checks it lacks); ``envelope``: the shares'
  ChaCha20-Poly1305 encryption bound to sender, receiver, run and round;
- ``site``: ``SiteRound``, a site's secrets and shares for one round, whose ``answer`` never
  reveals both secrets of one site; ``unmask``: the coordinator's request and the exact sum;
- ``field``: encoding signed integers, centring the sum, and the bound ``K M < 2^(b-1)`` under
  which the centred sum is exact.

A round (``U1`` sites advertise keys, ``U2`` relay shares, the survivors send masked inputs)::

    site = SiteRound(site_id=..., round_id=RoundId(run_id, rnd), identity_key=..., bits=32)
    sealed = site.share(roster, registered=identity_keys, threshold=t)   # after all advertised
    site.receive(sealed_for_this_site)
    y = site.mask(encode_signed(x, bits=32, bound=M), participants=u2)
    request = plan_unmask(masked.keys(), participants=u2, threshold=t)    # coordinator
    answers = [site.answer(request) for site in survivors]
    total = centre(unmask_sum(masked, answers, roster=roster, participants=u2, threshold=t,
                              bits=32, round_id=round_id), bits=32)

Threat model: inputs stay private against a coordinator that follows the protocol and against
two deviations: substituting a site's public keys (the signatures fail) and asking for both
secrets of one site (an honest site reveals one kind of share per site, so with ``t > n / 2``,
or ``t > (n + c) / 2`` against c colluding sites, no site's input is exposed). SecAgg's
consistency round (sites signing the survivor set) is not part of this core. The sum is correct
when the sites follow the protocol; a wrong share is detected against its owner's commitment,
not corrected.
"""

from __future__ import annotations

from prism_runtime.secure_sum.envelope import SharePair, open_shares, seal_shares
from prism_runtime.secure_sum.errors import (
    KeyBindingError,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    SumOverflowError,
    UnmaskRefusedError,
)
from prism_runtime.secure_sum.field import (
    MAX_BITS,
    centre,
    check_sum_fits,
    encode_signed,
    sum_fits,
)
from prism_runtime.secure_sum.keys import (
    AdvertisedKeys,
    RoundId,
    pairwise_key,
    seed_commitment,
    sign_keys,
    verify_keys,
)
from prism_runtime.secure_sum.masks import expand_mask, mask_input, pairwise_sign
from prism_runtime.secure_sum.shamir import check_threshold, combine_secret, split_secret
from prism_runtime.secure_sum.site import SiteRound
from prism_runtime.secure_sum.unmask import (
    ShareKind,
    UnmaskRequest,
    UnmaskResponse,
    plan_unmask,
    unmask_sum,
)

__all__ = [
    "MAX_BITS",
    "AdvertisedKeys",
    "KeyBindingError",
    "RoundId",
    "SecureSumAbortedError",
    "SecureSumError",
    "ShareError",
    "ShareKind",
    "SharePair",
    "SiteRound",
    "SumOverflowError",
    "UnmaskRefusedError",
    "UnmaskRequest",
    "UnmaskResponse",
    "centre",
    "check_sum_fits",
    "check_threshold",
    "combine_secret",
    "encode_signed",
    "expand_mask",
    "mask_input",
    "open_shares",
    "pairwise_key",
    "pairwise_sign",
    "plan_unmask",
    "seal_shares",
    "seed_commitment",
    "sign_keys",
    "split_secret",
    "sum_fits",
    "unmask_sum",
    "verify_keys",
]
