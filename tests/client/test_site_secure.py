"""A secure-aggregation site's noise (its share of the sum's Skellam noise, scaled for H - D honest
inputs, and its two sigmas), and the admission its rounds share with the plain round."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.sites import simulated_node, tiny_run_config

from client.policy import site_policy
from client.reply import RoundReply
from client.site import AdmittedRound, SecureNoise, Site
from prism_core.distributed import discrete_sensitivity
from prism_core.records import SKELLAM_MECHANISM, SkellamShare
from prism_core.skellam_accounting import skellam_sigma
from prism_runtime.exchange import to_arrays
from prism_runtime.protocol import STATUS_REFUSED, key
from prism_runtime.secure_sum import RoundTrust


@pytest.mark.parametrize(
    ("sigma", "honest", "dropouts", "dim"),
    [
        (0.8, 1, 0, 1000),
        (1.0, 4, 0, 150_000),
        (2.5, 8, 0, 64),
        (1.0, 4, 1, 150_000),
        (1.2, 5, 3, 64),
    ],
)
def test_the_share_is_the_sums_noise_over_h_minus_d_and_its_sigma_is_the_share_alone(
    sigma: float, honest: int, dropouts: int, dim: int
) -> None:
    noise = SecureNoise.for_sigma(sigma, trust=RoundTrust(honest, dropouts), dim=dim)
    l2, l1 = discrete_sensitivity(dim)
    # the charged sigma is the RDP-equivalent sigma of the SUM of H - D shares: Skellam(mu)
    assert skellam_sigma(mu=noise.mu, l1=l1, l2=l2) == pytest.approx(sigma, rel=1e-9)
    assert noise.mu_share * (honest - dropouts) == pytest.approx(noise.mu, rel=1e-12)
    assert noise.share_sigma == pytest.approx(
        skellam_sigma(mu=noise.mu_share, l1=l1, l2=l2), rel=1e-12
    )
    # a share alone carries 1/sqrt(H - D) of the noise std (the discreteness terms are ~1e-6)
    assert noise.share_sigma == pytest.approx(sigma / math.sqrt(honest - dropouts), rel=1e-3)
    assert noise.share_sigma <= sigma


# -- the admission a secure round shares with the plain round -----------------------------------


def _secure_site(tiny_bert, tmp_path, **run):
    values = {"secure-aggregation": True, "local-steps": 1, "min-honest-sites": 2, **run}
    config = simulated_node(tmp_path)
    return Site(tiny_run_config(tiny_bert, **values), config, site_policy(config))


def _ledger_lines(site):
    path = site.ledger.path
    return path.read_text().splitlines() if path.exists() else []


def test_a_secure_round_is_admitted_with_its_skellam_event_durable_before_its_ending(
    tiny_bert, tmp_path
):
    site = _secure_site(tiny_bert, tmp_path)
    with site.admit(1, to_arrays(site.loaded), secure=True) as admitted:
        assert isinstance(admitted, AdmittedRound)
        event = admitted.charged.entry.event
        assert (event.mechanism, event.steps) == (SKELLAM_MECHANISM, 1)
        assert event.noise_multiplier == site.secure.sigma
        assert event.secure == SkellamShare(honest_sites=2, share_sigma=site.secure.share_sigma)
        (line,) = _ledger_lines(site)  # on disk before the ending runs
        assert json.loads(line)["mechanism"] == SKELLAM_MECHANISM
    with site.admit(1, to_arrays(site.loaded), run_id="r", secure=True) as again:
        assert isinstance(again, AdmittedRound)  # never resent: a re-asked round is a new charge
    assert len(_ledger_lines(site)) == 2


def test_a_secure_round_refuses_a_bad_broadcast_before_anything_is_charged(tiny_bert, tmp_path):
    site = _secure_site(tiny_bert, tmp_path)
    arrays = to_arrays(site.loaded)
    name = key(site.loaded.handles[0].name, "A")
    with site.admit(1, {**arrays, name: torch.zeros_like(arrays[name])}, secure=True) as refused:
        assert isinstance(refused, RoundReply)
        assert (refused.accounting.status, refused.accounting.reason) == (
            STATUS_REFUSED,
            "bad-broadcast",
        )
    assert _ledger_lines(site) == []


def test_a_secure_round_of_a_plain_run_is_refused_as_off(tiny_bert, tmp_path):
    config = simulated_node(tmp_path)
    site = Site(tiny_run_config(tiny_bert), config, site_policy(config))
    assert site.admission_refusal(secure=True) == "secure-aggregation-off"
    assert site.admission_refusal(secure=False) is None
    with site.admit(1, to_arrays(site.loaded), secure=True) as refused:
        assert isinstance(refused, RoundReply)
        assert refused.accounting.reason == "secure-aggregation-off"
    assert _ledger_lines(site) == []
