"""The cryptographic core of a secure sum (SecAgg+-style; Bonawitz et al. 2017, Bell et al. 2020).

Sites add integer vectors in Z_(2^b) so that the coordinator learns only their sum, even when
some sites drop out mid-round (docs/design.md §3.3). The pieces, pure functions and one small
per-round class over bytes and numpy uint64 vectors, with no network:

- ``keys``: per-round X25519 key pairs (one for masks, one for share encryption), pairwise keys
  by HKDF-SHA256 bound to run, round and both site ids, and advertisements signed with the
  site's ECDSA P-256 identity key so that a substituted public key is detected;
- ``masks``: masks expanded from a full 32-byte key with ChaCha20, a self mask per site and
  pairwise masks that cancel in the sum;
- ``shamir``: threshold sharing of each site's seed and mask private key over GF(2^521 - 1),
  with threshold, index, length and field checks on every share; ``envelope``: the shares'
  ChaCha20-Poly1305 encryption bound to sender, receiver, run, round, threshold and roster;
- ``site``: ``SiteRound``, a site's secrets and shares for one round, whose ``answer`` reveals
  shares only for the one view it signed, never both secrets of one site; ``unmask``: the
  coordinator's request and the exact sum, added up as the masked inputs arrive (``MaskedSum``);
- ``roster``: the roster committed by a Merkle root over its advertisements, with its sorted
  ids and the largest noise share stated for it: a site receives its neighbourhood's
  advertisements and a proof of their places (``RosterPart``), not the whole roster;
- ``graph``: the masking graph (complete, or SecAgg+'s sparse Harary graph over a
  transcript-seeded order: each site masks with k neighbours and shares among its neighbourhood),
  its failure bound and ``sparse_parameters``;
- ``trust``: a site's H and D (``RoundTrust``) and the threshold condition they give;
  ``views``: the consistency check, each survivor's signature of its participant and survivor
  sets;
- ``field``: encoding signed integers, centring the sum, and the bound ``K M < 2^(b-1)`` under
  which the centred sum is exact.

A round (``U1`` sites advertise keys, ``U2`` relay shares, the survivors ``U3`` send masked
inputs and sign their sets)::

    site = SiteRound(site_id=..., round_id=RoundId(run_id, rnd), identity_key=..., bits=32,
                     noise_share=mu / (h - d), trust=RoundTrust(h, d))
    t = least_common_threshold([a.trust for a in roster.values()], len(roster))  # coordinator
    sealed = site.share(roster, registered=identity_keys, threshold=t)   # after all advertised
    site.receive(sealed_for_this_site)
    y = site.mask(encode_signed(x, bits=32, bound=M), participants=u2)
    signature = site.sign_view(u3, identity_key=...)                      # every survivor
    request = plan_unmask(masked.keys(), participants=u2, threshold=t)    # coordinator
    answers = [site.answer(request, signatures=signatures, registered=identity_keys)
               for site in survivors]
    total = centre(unmask_sum(masked, answers, roster=roster, participants=u2, threshold=t,
                              bits=32, round_id=round_id), bits=32)

Threat model: inputs stay private against a coordinator that deviates from the protocol (it
routes every message, may substitute keys, tell each site different participant, survivor or
dropped sets, re-send requests) and colludes with up to ``n - H`` of the ``n`` roster sites,
for every site whose threshold condition (``trust``) the round met: no site's input is ever
isolated from a sum holding fewer than ``H - D`` honest inputs. A site must keep its one-shot
decisions (``SiteRound.decisions``) durably before each reply leaves. The sum is correct when
the sites follow the protocol; a wrong share is detected against its owner's commitment, not
corrected.
"""

from __future__ import annotations

from prism_runtime.secure_sum.envelope import SharePair, open_shares, seal_shares
from prism_runtime.secure_sum.errors import (
    ConsistencyError,
    KeyBindingError,
    MasksUsedError,
    NoiseShareError,
    SecureSumAbortedError,
    SecureSumError,
    ShareError,
    SumOverflowError,
    ThresholdError,
)
from prism_runtime.secure_sum.field import (
    MAX_BITS,
    centre,
    check_sum_fits,
    encode_signed,
    sum_fits,
)
from prism_runtime.secure_sum.graph import MaskingGraph, sparse_parameters
from prism_runtime.secure_sum.keys import (
    AdvertisedKeys,
    RoundId,
    pairwise_key,
    seed_commitment,
    sign_keys,
    verify_keys,
)
from prism_runtime.secure_sum.masks import expand_mask, mask_input, pairwise_sign
from prism_runtime.secure_sum.roster import CommittedRoster, RosterPart
from prism_runtime.secure_sum.shamir import check_threshold, combine_secret, split_secret
from prism_runtime.secure_sum.site import RoundDecisions, SignatureDraw, SiteRound
from prism_runtime.secure_sum.trust import RoundTrust, common_graph, least_common_threshold
from prism_runtime.secure_sum.unmask import (
    MaskedSum,
    ShareKind,
    UnmaskRequest,
    UnmaskResponse,
    plan_unmask,
    unmask_sum,
)
from prism_runtime.secure_sum.views import (
    RoundView,
    SignatureBook,
    check_signatures,
    draw_signatures,
    round_transcript,
    sample_size,
    sign_view,
)

__all__ = [
    "MAX_BITS",
    "AdvertisedKeys",
    "CommittedRoster",
    "ConsistencyError",
    "KeyBindingError",
    "MaskedSum",
    "MaskingGraph",
    "MasksUsedError",
    "NoiseShareError",
    "RosterPart",
    "RoundDecisions",
    "RoundId",
    "RoundTrust",
    "RoundView",
    "SecureSumAbortedError",
    "SecureSumError",
    "ShareError",
    "ShareKind",
    "SharePair",
    "SignatureBook",
    "SignatureDraw",
    "SiteRound",
    "SumOverflowError",
    "ThresholdError",
    "UnmaskRequest",
    "UnmaskResponse",
    "centre",
    "check_signatures",
    "check_sum_fits",
    "check_threshold",
    "combine_secret",
    "common_graph",
    "draw_signatures",
    "encode_signed",
    "expand_mask",
    "least_common_threshold",
    "mask_input",
    "open_shares",
    "pairwise_key",
    "pairwise_sign",
    "plan_unmask",
    "round_transcript",
    "sample_size",
    "seal_shares",
    "seed_commitment",
    "sign_keys",
    "sign_view",
    "sparse_parameters",
    "split_secret",
    "sum_fits",
    "unmask_sum",
    "verify_keys",
]
