"""The audit's block decomposition of a tangent space and its chi-square variance test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.points import SEEDS, random_point

from prism_core.manifold import project_dense, tangent_norm_sq, tangent_to_dense
from prism_core.mechanism import tangent_noise
from server.audit.blocks import (
    BLOCKS,
    POWER,
    tangent_block_energies,
    variance_test,
)

Z = 5.0  # z-score bound of the statistical checks: two-sided p ~ 6e-7 under the null


def _block_dimensions(m: int, n: int, r: int) -> dict[str, int]:
    """Coordinates of each block for an (m x r, n x r) module: ``r^2, (m - r) r, r (n - r)``."""
    return dict(zip(BLOCKS, (r * r, (m - r) * r, r * (n - r)), strict=True))


def _dense_blocks(A, B, dZ):
    """The three blocks from complete QRs and a dense dZ: an independent computation."""
    r = A.shape[1]
    Qm = torch.linalg.qr(A, mode="complete")[0]
    Qn = torch.linalg.qr(B, mode="complete")[0]
    c = Qm.T @ dZ @ Qn
    return {
        "core": float(c[:r, :r].square().sum()),
        "A-perp": float(c[r:, :r].square().sum()),
        "B-perp": float(c[:r, r:].square().sum()),
        "normal": float(c[r:, r:].square().sum()),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_block_energies_match_a_dense_decomposition_and_add_up_to_the_norm(seed):
    m, n, r = 11, 9, 3
    A, B = random_point(m, n, r, seed)
    g = torch.Generator().manual_seed(seed)
    dA = torch.randn(m, r, generator=g, dtype=torch.float64)
    dB = torch.randn(n, r, generator=g, dtype=torch.float64)
    got = tangent_block_energies(A, B, dA, dB)
    dense = _dense_blocks(A, B, tangent_to_dense(A, B, dA, dB))
    assert dense["normal"] < 1e-20 * sum(dense.values())  # a tangent vector has no normal part
    for name in BLOCKS:
        assert got[name] == pytest.approx(dense[name], rel=1e-10)
    assert sum(got.values()) == pytest.approx(float(tangent_norm_sq(A, B, dA, dB)), rel=1e-10)
    # a dense G projected onto the tangent space: the A-perp block is (I - Pi_A) G Pi_B
    G = torch.randn(m, n, generator=g, dtype=torch.float64)
    QA, QB = torch.linalg.qr(A)[0], torch.linalg.qr(B)[0]
    a_perp = (G - QA @ (QA.T @ G)) @ QB @ QB.T
    assert _dense_blocks(A, B, project_dense(A, B, G))["A-perp"] == pytest.approx(
        float(a_perp.square().sum()), rel=1e-10
    )


def test_tangent_noise_puts_unit_variance_on_every_coordinate_of_every_block():
    m, n, r, K = 12, 10, 3, 2000
    A, B = random_point(m, n, r, 4)
    g = torch.Generator().manual_seed(4)
    As, Bs = A.expand(K, m, r), B.expand(K, n, r)  # K independent draws in one stacked call
    energy = tangent_block_energies(As, Bs, *tangent_noise(As, Bs, g))  # summed over the K
    for name, dof in _block_dimensions(m, n, r).items():
        d = K * dof  # chi-square with d degrees of freedom: mean d, std sqrt(2 d)
        assert abs(energy[name] - d) < Z * math.sqrt(2 * d), name


@pytest.mark.parametrize("dof", [64, 1000, 6144])
def test_the_variance_test_has_its_size_and_its_stated_power(dof):
    """Simulated chi-square draws: a correct std is rejected at about the significance level;
    a std of ``detectable`` times the claim is caught with probability about POWER."""
    significance, draws = 0.02, 40_000
    rng = np.random.default_rng(dof)
    t = variance_test("x", float(dof), dof, significance=significance)
    null = rng.chisquare(dof, draws)
    rejected = np.mean((np.sqrt(null / dof) < t.lo) | (np.sqrt(null / dof) > t.hi))
    assert abs(rejected - significance) < Z * math.sqrt(significance / draws)
    short = t.detectable**2 * rng.chisquare(dof, draws)
    caught = np.mean(np.sqrt(short / dof) < t.lo)
    assert abs(caught - POWER) < Z * math.sqrt(POWER * (1 - POWER) / draws)
    assert 0 < t.detectable < t.lo < 1 < t.hi
    # more coordinates detect a smaller shortfall
    assert variance_test("y", 4.0 * dof, 4 * dof, significance=significance).detectable > (
        t.detectable
    )


def test_the_variance_test_verdicts():
    ok = variance_test("x", 1000.0, 1000, significance=1e-6)
    assert ok.passed and ok.measured == pytest.approx(1.0)
    assert not variance_test("x", 250.0, 1000, significance=1e-6).passed  # half the std
    assert not variance_test("x", 0.0, 1000, significance=1e-6).passed  # no noise
    assert not variance_test("x", 2000.0, 1000, significance=1e-6).passed  # too much
    with pytest.raises(ValueError, match="dof >= 1"):
        variance_test("x", 1.0, 0, significance=0.1)
