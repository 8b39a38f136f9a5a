"""The server optimizer: exact steps, and its state survives a checkpoint bit for bit."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from prism_core.manifold import Point, Tangent
from server.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from server.optimizer import ServerOptimizer, ServerOptimizerConfig, scheduled_lr

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


def _run(opt: ServerOptimizer, rounds: range, seed: int) -> tuple[dict[str, Point], dict]:
    g = torch.Generator().manual_seed(seed)
    points = _start(g)
    head: dict = {}
    for t in range(rounds.stop):
        updates, head_values, head_deltas = _round(g, points)
        if t in rounds:
            points, head = opt.step(points, updates, head_values, head_deltas, noise_std=0.01)
    return points, head


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adaptive"])
def test_state_survives_a_checkpoint_bit_for_bit(kind: str, tmp_path: Path) -> None:
    config = ServerOptimizerConfig(kind=kind, lr=0.7)  # type: ignore[arg-type]
    straight = ServerOptimizer(config, MODULES, HEAD)
    g = torch.Generator().manual_seed(3)
    points = _start(g)
    rounds = [_round(g, points) for _ in range(4)]
    cut = ServerOptimizer(config, MODULES, HEAD)
    p_straight, p_cut = dict(points), dict(points)
    for t, (updates, hv, hd) in enumerate(rounds):
        p_straight, h_straight = straight.step(p_straight, updates, hv, hd, noise_std=0.01)
        if t == 1:  # checkpoint through the real file, then a fresh optimizer resumes
            tensors, meta = cut.state_dict()
            save_checkpoint(
                tmp_path,
                Checkpoint(1, {**tensors, "x": torch.zeros(1)}, {}, {}, {"optimizer": meta}),
            )
            ckpt = load_checkpoint(tmp_path)
            assert ckpt is not None
            cut = ServerOptimizer(config, MODULES, HEAD)
            cut.load_state_dict(ckpt.arrays, ckpt.round_state["optimizer"])
        p_cut, h_cut = cut.step(p_cut, updates, hv, hd, noise_std=0.01)
    for m in MODULES:
        assert torch.equal(p_straight[m].A, p_cut[m].A)
        assert torch.equal(p_straight[m].B, p_cut[m].B)
    assert torch.equal(h_straight["classifier.weight"], h_cut["classifier.weight"])


def test_sgd_is_the_plain_retraction_and_momentum_zero_equals_sgd() -> None:
    g = torch.Generator().manual_seed(0)
    points = _start(g)
    updates, hv, hd = _round(g, points)
    sgd = ServerOptimizer(ServerOptimizerConfig(kind="sgd", lr=0.5), MODULES, HEAD)
    new, head = sgd.step(points, updates, hv, hd, noise_std=0.0)
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
    flat = ServerOptimizer(
        ServerOptimizerConfig(kind="momentum", lr=0.5, momentum=0.0), MODULES, HEAD
    )
    p1, _ = flat.step(points, updates, hv, hd, noise_std=0.0)
    updates2, hv2, hd2 = _round(g, p1)
    p2, _ = flat.step(p1, updates2, hv2, hd2, noise_std=0.0)
    q2, _ = sgd.step(p1, updates2, hv2, hd2, noise_std=0.0)
    for m in MODULES:  # beta = 0: the same Z as plain SGD from the same point
        assert torch.allclose(p2[m].A @ p2[m].B.T, q2[m].A @ q2[m].B.T, atol=1e-5)


def test_momentum_accumulates_a_constant_update() -> None:
    """With a repeated update the heavy-ball step grows towards lr / (1 - beta) times it."""
    g = torch.Generator().manual_seed(1)
    A, B = (
        torch.linalg.qr(torch.randn(8, 3, generator=g))[0].double(),
        torch.linalg.qr(torch.randn(6, 3, generator=g))[0].double(),
    )
    points = {"l0.q": Point(A, B), "l0.v": Point(A.clone(), B.clone())}
    dA = 1e-4 * torch.randn(8, 3, generator=g).double()
    dB = torch.zeros(6, 3, dtype=torch.float64)
    opt = ServerOptimizer(ServerOptimizerConfig(kind="momentum", lr=1.0, momentum=0.5), MODULES, [])
    steps = []
    for _ in range(12):
        before = points["l0.q"]
        z0 = before.A @ before.B.T
        updates = {m: Tangent(dA, dB) for m in MODULES}
        points, _ = opt.step(points, updates, {}, {}, noise_std=0.0)
        steps.append(float((points["l0.q"].A @ points["l0.q"].B.T - z0).norm()))
    single = float((dA @ B.T).norm())
    assert steps[0] == pytest.approx(single, rel=1e-3)
    assert steps[-1] == pytest.approx(2.0 * single, rel=2e-2)  # 1 / (1 - 0.5)


def test_a_checkpoint_of_another_kind_is_refused() -> None:
    sgd = ServerOptimizer(ServerOptimizerConfig(kind="sgd"), MODULES, HEAD)
    tensors, meta = sgd.state_dict()
    other = ServerOptimizer(ServerOptimizerConfig(kind="adaptive"), MODULES, HEAD)
    with pytest.raises(ValueError, match="resume with the stored configuration"):
        other.load_state_dict(tensors, meta)


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
