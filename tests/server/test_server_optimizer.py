"""The server step: the exact retraction of the aggregate, and the server lr schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from prism_core.manifold import Point, Tangent
from server.optimizer import scheduled_lr, server_step

MODULES, HEAD = ["l0.q", "l0.v"], ["classifier.weight"]


def _round(g: torch.Generator, points: dict[str, Point]) -> tuple[dict, dict, dict]:
    updates = {
        name: Tangent(
            0.05 * torch.randn(p.A.shape, generator=g), 0.05 * torch.randn(p.B.shape, generator=g)
        )
        for name, p in points.items()
    }
    head_values = {"classifier.weight": torch.randn(2, 6, generator=g)}
    head_deltas = {"classifier.weight": 0.1 * torch.randn(2, 6, generator=g)}
    return updates, head_values, head_deltas


def _start(g: torch.Generator) -> dict[str, Point]:
    return {
        m: Point(torch.randn(8, 3, generator=g), torch.randn(6, 3, generator=g)) for m in MODULES
    }


def test_the_server_step_is_the_plain_retraction_and_an_sgd_step_of_the_head() -> None:
    g = torch.Generator().manual_seed(0)
    points = _start(g)
    updates, hv, hd = _round(g, points)
    new, head = server_step(points, updates, hv, hd, lr=0.5)
    for m in MODULES:  # the retraction of Z + lr dZ: its best rank-r approximation (dense SVD)
        A, B = points[m].A.double(), points[m].B.double()
        dA, dB = updates[m].dA.double(), updates[m].dB.double()
        U, S, Vh = torch.linalg.svd(A @ B.T + 0.5 * (dA @ B.T + A @ dB.T))
        expected = (U[:, :3] * S[:3]) @ Vh[:3]
        got = new[m].A.double() @ new[m].B.double().T
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(
        head["classifier.weight"], hv["classifier.weight"] + 0.5 * hd["classifier.weight"]
    )


def test_the_cosine_schedule_has_its_closed_form_values():
    """eta_t = eta (1 + cos(pi (t - 1) / T)) / 2: eta in round 1, eta / 2 at t = T / 2 + 1,
    decreasing, > 0 in round T, and held at that value past T; constant is eta every round."""
    T, eta = 30, 0.8
    values = [scheduled_lr(eta, "cosine", t, T) for t in range(1, T + 3)]
    assert values[0] == pytest.approx(eta, abs=1e-15)
    assert values[15] == pytest.approx(eta / 2, abs=1e-12)  # t = 16: cos(pi / 2) = 0
    assert values[T - 1] == pytest.approx(eta * (1 + math.cos(math.pi * 29 / 30)) / 2, abs=1e-15)
    assert 0 < values[T - 1] < 0.01 * eta
    assert all(a > b for a, b in itertools.pairwise(values[:T]))
    assert values[T] == values[T + 1] == values[T - 1]
    assert {scheduled_lr(eta, "constant", t, T) for t in range(1, T + 1)} == {eta}
    with pytest.raises(ValueError, match="num_rounds"):
        scheduled_lr(eta, "cosine", 1, 0)
