"""Noise-aware aggregation weights and the projection transport (float64, explicit tolerances)."""

from __future__ import annotations

import math

import pytest
import torch

from prism_core.aggregation import aggregate_noise_std, aggregation_weights, site_noise_std
from prism_core.manifold import project_dense, tangent_to_dense, transport


def test_inverse_noise_weights_equal_the_closed_form_and_sum_to_one() -> None:
    sigmas, clips, batches = [0.8, 1.4, 17.0, 2.5], [0.1, 0.1, 0.2, 0.05], [256, 256, 64, 512]
    stds = [
        site_noise_std(noise_multiplier=s, max_norm=c, expected_batch_size=b)
        for s, c, b in zip(sigmas, clips, batches, strict=True)
    ]
    weights = aggregation_weights("inverse-noise", noise_stds=stds)
    closed = [(b / (s * c)) ** 2 for s, c, b in zip(sigmas, clips, batches, strict=True)]
    total = sum(closed)
    for w, c in zip(weights, closed, strict=True):
        assert w == pytest.approx(c / total, rel=1e-12)
    assert math.fsum(weights) == pytest.approx(1.0, abs=1e-12)


def test_inverse_noise_weights_minimise_the_aggregate_noise() -> None:
    stds = [0.001, 0.004, 0.03]
    best = aggregate_noise_std(aggregation_weights("inverse-noise", noise_stds=stds), stds)
    assert best == pytest.approx(math.fsum(s**-2 for s in stds) ** -0.5, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        w = torch.rand(3, generator=g, dtype=torch.float64)
        w = (w / w.sum()).tolist()
        assert aggregate_noise_std(w, stds) >= best * (1 - 1e-12)
    uniform = aggregate_noise_std(aggregation_weights("uniform", noise_stds=stds), stds)
    assert uniform > 2 * best  # a tenfold noisier site dominates a uniform average


def test_uniform_examples_and_non_dp_fallback() -> None:
    assert aggregation_weights("uniform", noise_stds=[1.0, 2.0]) == [0.5, 0.5]
    assert aggregation_weights("examples", noise_stds=[1, 1], num_examples=[100, 300]) == [
        0.25,
        0.75,
    ]
    assert aggregation_weights("inverse-noise", noise_stds=[0.0, 0.0, 0.0]) == [1 / 3] * 3


@pytest.mark.parametrize(
    ("mode", "kwargs", "match"),
    [
        ("inverse-noise", {"noise_stds": [0.0, 1.0]}, "mixes private and non-private"),
        ("inverse-noise", {"noise_stds": [float("nan")]}, "finite"),
        ("examples", {"noise_stds": [1.0, 1.0]}, "num-examples"),
        ("uniform", {"noise_stds": []}, "no site updates"),
        ("median", {"noise_stds": [1.0]}, "use one of"),
    ],
)
def test_bad_weight_inputs_are_refused(mode: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregation_weights(mode, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transport_is_the_projection_onto_the_new_tangent_space(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m, n, r = 9, 7, 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    A, B, dA, dB = rand(m, r), rand(n, r), rand(m, r), rand(n, r)
    A1, B1 = A + 0.3 * rand(m, r), B + 0.3 * rand(n, r)
    moved = transport(A, B, A1, B1, dA, dB)
    dense = tangent_to_dense(A1, B1, moved.dA, moved.dB)
    expected = project_dense(A1, B1, tangent_to_dense(A, B, dA, dB))
    assert torch.allclose(dense, expected, atol=1e-10)
    same = transport(A, B, A, B, dA, dB)  # at the same point: the same tangent vector
    assert torch.allclose(
        tangent_to_dense(A, B, same.dA, same.dB), tangent_to_dense(A, B, dA, dB), atol=1e-10
    )


# Boundaries of the inputs: every rule of the docstrings holds at its edge, and a refusal
# names the value it refused.


@pytest.mark.parametrize(
    ("sigma", "C", "b"),
    [(-0.1, 1.0, 8.0), (1.0, 0.0, 8.0), (1.0, -1.0, 8.0), (1.0, 1.0, 0.0), (1.0, 1.0, -4.0)],
)
def test_site_noise_std_refuses_a_negative_sigma_or_a_non_positive_clip_or_batch(
    sigma: float, C: float, b: float
) -> None:
    with pytest.raises(ValueError, match=rf"sigma={sigma}, C={C}, b={b}"):
        site_noise_std(noise_multiplier=sigma, max_norm=C, expected_batch_size=b)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_site_noise_std_refuses_non_finite_parameters_and_names_them(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"finite, got \(1\.0, {bad}, 8\.0\)"):
        site_noise_std(noise_multiplier=1.0, max_norm=bad, expected_batch_size=8.0)


def test_site_noise_std_at_the_edges_of_its_domain() -> None:
    # sigma = 0 (no noise) is allowed; a fractional expected batch b < 1 is a valid q N
    assert site_noise_std(noise_multiplier=0.0, max_norm=2.0, expected_batch_size=4.0) == 0.0
    assert site_noise_std(
        noise_multiplier=1.5, max_norm=2.0, expected_batch_size=0.5
    ) == pytest.approx(6.0, rel=1e-15)


@pytest.mark.parametrize("bad", [float("inf"), -1e-9])
def test_a_non_finite_or_negative_noise_std_is_refused(bad: float) -> None:
    for mode in ("inverse-noise", "uniform", "examples"):
        with pytest.raises(ValueError, match=rf"finite and >= 0, got \[0\.5, {bad}\]"):
            aggregation_weights(mode, noise_stds=[0.5, bad], num_examples=[1, 1])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, float("inf"), float("nan")])
def test_examples_weights_refuse_a_count_that_is_not_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"positive, got \[10, {bad}\]"):
        aggregation_weights("examples", noise_stds=[1.0, 1.0], num_examples=[10, bad])


def test_examples_weights_accept_a_site_with_one_example() -> None:
    weights = aggregation_weights("examples", noise_stds=[1.0, 1.0], num_examples=[1, 3])
    assert weights == pytest.approx([0.25, 0.75], abs=1e-15)


def test_aggregate_noise_std_refuses_mismatched_lengths_and_names_them() -> None:
    with pytest.raises(ValueError, match="2 weights but 3 noise stds"):
        aggregate_noise_std([0.5, 0.5], [1.0, 1.0, 1.0])
