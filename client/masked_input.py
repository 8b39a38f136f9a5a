"""The secure-aggregation round's ending at a site: its masked input (docs/design.md §3.3).

A round the site admitted (``client.site.Site.admit``, charged at the noise the sum carries with
H honest sites) ends here, in this order: ONE clipped sum at the broadcast point
(``PrismTrainer.secure_clipped_sum``) written in the public tangent coordinates
(``prism_core.distributed.tangent_coordinates``), rounded randomly at scale ``gamma = C / 2^20``
with this site's Skellam share of the noise (``encode_share``), encoded in the field
(``encode_signed``) and masked (``SiteRound.mask``). Nothing moves at the site: the adaptive
transform, the head's optimizer and the retraction run at the coordinator on the unmasked sum
(post-processing of the central mechanism). The reply states the charged event and the clip C
and expected batch b the sum ran with, never anything a coordinator could read alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from client.site import AdmittedRound, Site
from prism_core.distributed import (
    FIELD_BITS,
    coordinate_bound,
    encode_share,
    flatten,
    tangent_coordinates,
)
from prism_runtime.errors import ConfigError
from prism_runtime.exchange import load_arrays
from prism_runtime.facts import ReplyFacts
from prism_runtime.secure_sum import SiteRound, encode_signed
from prism_runtime.trainer import PrismTrainer

__all__ = ["MaskedInput", "masked_input"]


@dataclass(frozen=True)
class MaskedInput:
    """A secure-aggregation round's answer: its accounting facts and its masked vector."""

    accounting: ReplyFacts
    masked: NDArray[np.uint64]


def masked_input(
    site: Site,
    admitted: AdmittedRound,
    *,
    site_round: SiteRound,
    participants: frozenset[str],
    mu_share: float,
) -> MaskedInput:
    """The masked input of an admitted secure round, with the facts of its charge.

    Args:
        site: the site (its trainer holds the model the broadcast is written into).
        admitted: the round, admitted and charged for one clipped sum.
        site_round: the round's secrets, the peers' shares received.
        participants: the sites whose masks the input carries (U2).
        mu_share: the Skellam share this site adds (``client.secure.mask``: the largest a
            roster site signed, never less than its own).

    Raises:
        ConfigError: the site's trainer is not PRISM's (``RunConfig`` allows PRISM only).
    """
    trainer = site.trainer
    if not isinstance(trainer, PrismTrainer):  # RunConfig allows PRISM only
        raise ConfigError("secure aggregation runs PRISM only")
    request, charged = admitted.request, admitted.charged
    load_arrays(site.loaded, request.arrays)
    trainer.begin_round(charged.history, 1)
    trainer.reseed(site.policy.round_seed(request.server_round, charged.attempt))
    clipped, frames = trainer.secure_clipped_sum()
    vector = flatten(tangent_coordinates(frames, clipped.sums), clipped.euclidean)
    shares = encode_share(
        vector,
        max_norm=trainer.config.max_norm,
        mu_share=mu_share,
        source=trainer.noise,
    )
    del clipped, vector  # private: nothing of them outlives the masked vector
    encoded = encode_signed(shares, bits=FIELD_BITS, bound=coordinate_bound())
    masked = site_round.mask(encoded, participants=participants)
    facts = site.facts.released(
        request.server_round,
        charged.entry.event,
        spent=site.ledger.epsilon(site.delta),
        scales=(float(trainer.config.max_norm), float(trainer.expected_batch_size)),
    )
    return MaskedInput(facts, masked)
