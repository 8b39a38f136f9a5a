"""The coordinator's bounds on an honest site's round and the accept/reject edge of each check.

``UpdateChecker`` is driven directly, without Flower transport or a ledger: a broadcast point,
a reply's update and its facts. Each check is tested on both sides of its threshold (the bound
times the float32 allowance plus its absolute slack), with margins far smaller than either, so
a check that moved its threshold, dropped the allowance or compared the wrong difference fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from prism_core.bounds import FLOAT32_SLACK, adam_gain, dp_step_norm_bound, round_update_norm_bound
from prism_core.manifold import Point
from prism_runtime.config import HEAD_MOMENTUM
from prism_runtime.protocol import HEAD_PREFIX, key
from prism_runtime.train_config import ADAMW_BETAS, AdaptiveSettings, TrainConfig
from server.errors import ReplyError
from server.strategy.bounds import UpdateBound, UpdateChecker

M, N, R = 6, 4, 2  # one LoRA module: A (m, r), B (n, r)
HEAD = (3, 4)
FACTS = {"sigma": "1.3", "q": "0.1", "max-norm": "0.5"}


def test_the_sites_bound_is_the_train_config_they_run() -> None:
    """Every field of the bound comes from the sites' ``TrainConfig`` (non-default values),
    and the failure probability from the caller (default 1e-9)."""
    train = TrainConfig(
        noise_multiplier=1.0,
        lr=0.03,
        head_lr=0.2,
        head_optimizer="momentum",
        max_norm=0.7,
        batch_size=48,
        adaptive=AdaptiveSettings(beta1=0.8, beta2=0.99),
    )
    assert UpdateBound.for_sites(train, failure=1e-6) == UpdateBound(
        lr=0.03,
        optimizer="adaptive",
        beta1=0.8,
        beta2=0.99,
        bias_correction=True,  # PRISM's transform always corrects its moments
        head_lr=0.2,
        head_betas=ADAMW_BETAS,
        head_optimizer="momentum",
        max_norm=0.7,
        expected_batch_size=48.0,
        failure=1e-6,
    )
    assert UpdateBound.for_sites(TrainConfig(noise_multiplier=1.0)).failure == 1e-9


def _broadcast(scale: float = 1.0, head: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {
        key("m", "A"): scale * torch.randn(M, R, generator=g),
        key("m", "B"): scale * torch.randn(N, R, generator=g),
    }
    if head:
        out[HEAD_PREFIX + "weight"] = scale * torch.randn(*HEAD, generator=g)
    return out


def _checker(
    bound: UpdateBound | None,
    mode: str = "tangent",
    head: tuple[str, ...] = ("weight",),
    broadcast: dict[str, torch.Tensor] | None = None,
    server_round: int = 1,
) -> UpdateChecker:
    """A checker of one module (and ``head``) at tau = 3, begun on ``broadcast``'s round."""
    checker = UpdateChecker(
        modules=["m"],
        head=list(head),
        mode=mode,
        local_steps=3,
        update_bound=bound,  # type: ignore[arg-type]
    )
    checker.begin_round(
        server_round, _broadcast(head=bool(head)) if broadcast is None else broadcast
    )
    return checker


def _dp_step(dimension: int) -> float:
    """One DP step's bound at ``FACTS`` (clip 0.5, sigma 1.3, q 0.1), b = 16, failure 1e-9 / tau."""
    return dp_step_norm_bound(
        max_norm=0.5,
        noise_multiplier=1.3,
        expected_batch_size=16.0,
        sample_rate=0.1,
        dimension=dimension,
        failure=1e-9 / 3,
    )


def _sgd_bound(**kw) -> UpdateBound:
    return UpdateBound(lr=0.05, max_norm=0.8, expected_batch_size=16.0, **kw)


def test_no_sgd_head_means_no_head_bound() -> None:
    for bound, head in [(_sgd_bound(), ("weight",)), (_sgd_bound(head_optimizer="sgd"), ())]:
        assert _checker(bound, head=head).head_sgd_bound(FACTS) == 0.0
    assert _checker(None).head_sgd_bound(FACTS) == 0.0


@pytest.mark.parametrize(
    ("head_optimizer", "head_lr", "velocity"),
    [("sgd", 0.2, 1.0), ("momentum", 0.2, 1 / (1 - HEAD_MOMENTUM)), ("sgd", None, 1.0)],
)
def test_an_sgd_heads_bound_is_tau_dp_steps_of_the_replys_sigma_and_q(
    head_optimizer: str, head_lr: float | None, velocity: float
) -> None:
    """``head_lr tau G / (1 - beta)``: G the DP step bound over the head's 12 coordinates at the
    reply's sigma and q, the reply's clip (0.5, below the run's 0.8) and failure / tau per step;
    the sites' lr when no head lr is set."""
    bound = _sgd_bound(head_optimizer=head_optimizer, head_lr=head_lr)
    expected = (0.05 if head_lr is None else head_lr) * 3 * _dp_step(12) * velocity
    got = _checker(bound).head_sgd_bound(FACTS)
    assert got == pytest.approx(expected, rel=1e-12)


def test_a_plain_dp_sgd_sites_bound_counts_the_tangent_and_head_dimensions() -> None:
    """``2 lr tau G``, G over r (m + n - r) = 16 tangent and 12 head coordinates, failure / tau."""
    step = _dp_step(R * (M + N - R) + HEAD[0] * HEAD[1])
    got = _checker(_sgd_bound(optimizer="sgd")).sgd_bound(FACTS)
    assert got == pytest.approx(2 * 0.05 * 3 * step, rel=1e-12)


def _record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v.numpy())) for k, v in tensors.items()})


def _one_entry(shape: tuple[int, ...], value: float) -> torch.Tensor:
    """Zeros with ``value`` (exactly representable in float32) in the first entry."""
    t = torch.zeros(shape)
    t.view(-1)[0] = value
    return t


def _just(threshold: float, side: int, within: float = 1e-6) -> float:
    """The float32 value two steps inside (side -1) or outside (+1) ``threshold``: a single
    entry of it has exactly that norm, closer than ``within`` to the threshold (the check's
    absolute slack: any shift of the threshold by it changes the verdict)."""
    x = np.float32(threshold)
    toward = np.float32(np.inf if side > 0 else -np.inf)
    while (float(x) - threshold) * side <= 0:
        x = np.nextafter(x, toward)
    x = np.nextafter(x, toward)
    assert 0 < (float(x) - threshold) * side < within, (threshold, float(x))
    return float(x)


def test_a_factor_average_update_is_checked_against_its_own_move() -> None:
    """Each tensor's move from the broadcast (new - old), not its size: an honest small move of
    a large broadcast passes; a move 1e-7 relative past ``bound (1 + slack) + 1e-6`` fails,
    naming the tensor, its move and the bound; 1e-7 inside passes."""
    bound = UpdateBound(lr=0.05)
    broadcast = _broadcast(scale=100.0, head=False)
    checker = _checker(bound, mode="factor-average", head=(), broadcast=broadcast)
    name = key("m", "A")
    limit = checker.factor_bounds[name] * (1 + FLOAT32_SLACK) + 1e-6
    small = {
        k: v + 0.01 * checker.factor_bounds[k] / math.sqrt(v.numel()) for k, v in broadcast.items()
    }
    checker.check_norm(small, {})
    zero = {k: torch.zeros_like(v) for k, v in broadcast.items()}
    checker.begin_round(1, zero)  # moves from 0: a move is the entry itself
    for side in (-1, 1):
        update = {**zero, name: _one_entry((M, R), _just(limit, side))}
        if side < 0:
            checker.check_norm(update, {})
            continue
        with pytest.raises(ReplyError, match=rf"{name} moved by .* more than the .* 3 AdamW steps"):
            checker.check_norm(update, {})


def test_an_sgd_heads_update_is_checked_at_the_edge_of_its_own_bound() -> None:
    bound = _sgd_bound(head_optimizer="sgd")
    checker = _checker(bound)
    limit = checker.head_sgd_bound(FACTS) * (1 + FLOAT32_SLACK) + 1e-6
    zero = {key("m", "dA"): torch.zeros(M, R), key("m", "dB"): torch.zeros(N, R)}
    for side in (-1, 1):
        update = {**zero, HEAD_PREFIX + "weight": _one_entry(HEAD, _just(limit, side))}
        if side < 0:
            checker.check_norm(update, FACTS)
            continue
        with pytest.raises(ReplyError, match=r"head update norm .* exceeds the bound .* 3 SGD"):
            checker.check_norm(update, FACTS)


def test_a_tangent_update_is_checked_at_the_edge_of_the_mechanisms_bound() -> None:
    """``bound (1 + slack) + 1e-6 x |broadcast|``, with a broadcast of norm ~100 so that the
    absolute slack scales with the adapter (1e-4 here, not 1e-6 or 1e-8); lr 5e-4 keeps the
    bound small enough (about 6) for float32 to place an entry within that slack of it."""
    checker = _checker(UpdateBound(lr=0.0005), broadcast=_broadcast(scale=25.0))
    scale = math.sqrt(sum(float(v.double().square().sum()) for v in checker.broadcast.values()))
    assert scale > 50
    assert checker.norm_bound is not None
    limit = checker.norm_bound * (1 + FLOAT32_SLACK) + 1e-6 * scale
    zero = {key("m", "dA"): torch.zeros(M, R), key("m", "dB"): torch.zeros(N, R)}
    for side in (-1, 1):
        entry = _just(limit, side, within=1e-6 * scale)
        update = {**zero, HEAD_PREFIX + "weight": _one_entry(HEAD, entry)}
        if side < 0:
            checker.validate(_record(update), {})
            continue
        with pytest.raises(
            ReplyError, match=r"update norm .* exceeds the bound .* \(3 steps at lr"
        ):
            checker.validate(_record(update), {})


def _honest(checker: UpdateChecker) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape) for k, shape in checker.expected_update_keys().items()}


def _bad_payload() -> Array:
    """Declared float32 of the right shape, but 3 bytes of data."""
    return Array(dtype="float32", shape=(M, R), stype="numpy.ndarray", data=b"abc")


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        pytest.param(lambda u: dict(u), "keys", "update is a dict, not an ArrayRecord", id="dict"),
        pytest.param(
            lambda u: _record({f"x{i}": torch.zeros(1) for i in range(4)}),
            "keys",
            "wrong update keys (missing ['head/weight', 'm/dA', 'm/dB'], unexpected "
            "['x0', 'x1', 'x2'])",
            id="keys",
        ),
        pytest.param(
            lambda u: _record({**u, "m/dA": torch.zeros(M, R, dtype=torch.float64)}),
            "dtype",
            "m/dA: dtype float64, expected float32",
            id="dtype",
        ),
        pytest.param(
            lambda u: _record({**u, "m/dA": torch.zeros(R, M)}),
            "shape",
            f"m/dA: shape ({R}, {M}), expected ({M}, {R})",
            id="shape",
        ),
        pytest.param(
            lambda u: ArrayRecord({**_record(u), "m/dA": _bad_payload()}),
            "dtype",
            "m/dA: cannot decode the array",
            id="garbled",
        ),
        pytest.param(
            lambda u: _record({**u, "m/dA": _one_entry((M, R), math.nan)}),
            "non-finite",
            "m/dA: contains NaN or Inf",
            id="nan",
        ),
        pytest.param(
            lambda u: _record({**u, "m/dA": _one_entry((M, R), -2e8)}),
            "magnitude",
            "m/dA: an entry of size 2e+08 > 1e+08",
            id="magnitude",
        ),
    ],
)
def test_each_malformed_update_is_refused_with_its_code_and_what_was_found(
    change, code: str, message: str
) -> None:
    """The reply's reason code (counted per round in the summary) and a message naming the
    tensor and the value found (at most 3 names of a key list)."""
    checker = _checker(UpdateBound(lr=0.05))
    with pytest.raises(ReplyError) as info:
        checker.validate(change(_honest(checker)), {})
    assert info.value.code == code
    assert message in str(info.value)


def test_an_entry_of_exactly_the_magnitude_limit_is_accepted() -> None:
    """``|x| > 1e8`` is refused, ``|x| = 1e8`` (exact in float32) is not (no norm bound here)."""
    checker = _checker(None)
    update = {**_honest(checker), "m/dA": _one_entry((M, R), 1e8)}
    assert float(checker.validate(_record(update), {})["m/dA"].abs().max()) == 1e8


# b1^2 < b2 (torch's default), b1^2 > b2 > b1^3, b1^2 = b2 exactly (0.5^2 = 0.25 in binary)
@pytest.mark.parametrize("betas", [ADAMW_BETAS, (0.9, 0.5), (0.9, 0.75), (0.5, 0.25)])
@pytest.mark.parametrize("server_round", [1, 4])
def test_the_rounds_bounds_use_the_head_lr_and_the_gain_at_the_rounds_horizon(
    betas: tuple[float, float], server_round: int
) -> None:
    """Head terms at ``head_lr`` (not the sites' lr) and AdamW's gain over all steps when
    ``b1^2 < b2`` (finite supremum), else at the ``round x tau`` steps a site can have taken;
    the head's 12 coordinates counted in the tangent bound and bounded per tensor in
    factor-average mode."""
    b1, b2 = betas
    horizon = None if b1**2 < b2 else server_round * 3
    head_gain = adam_gain(beta1=b1, beta2=b2, max_step=horizon)
    bound = UpdateBound(lr=0.05, head_lr=0.2, head_betas=betas)
    tangent = _checker(bound, server_round=server_round)
    points = [Point(tangent.broadcast["m/A"], tangent.broadcast["m/B"])]
    expected = round_update_norm_bound(
        points,
        lr=0.05,
        local_steps=3,
        gain=adam_gain(beta1=0.9, beta2=0.999, max_step=None),
        head_size=12,
        head_lr=0.2,
        head_gain=head_gain,
    )
    assert tangent.norm_bound == pytest.approx(expected, rel=1e-12)
    factor = _checker(bound, mode="factor-average", server_round=server_round)
    assert factor.factor_bounds[HEAD_PREFIX + "weight"] == pytest.approx(
        0.2 * 3 * head_gain * math.sqrt(12), rel=1e-12
    )
    assert factor.factor_bounds["m/A"] == pytest.approx(
        0.05 * 3 * head_gain * math.sqrt(M * R), rel=1e-12
    )
    assert factor.factor_bounds["m/B"] == pytest.approx(
        0.05 * 3 * head_gain * math.sqrt(N * R), rel=1e-12
    )


@pytest.mark.parametrize(
    ("beta2", "bias_correction", "head_optimizer"),
    [(0.999, True, "adamw"), (0.5, False, "adamw"), (0.5, True, "adamw"), (0.999, True, "sgd")],
)
def test_the_tangent_bound_uses_the_sites_adaptive_gain_and_no_sgd_head(
    beta2: float, bias_correction: bool, head_optimizer: str
) -> None:
    """PRISM's transform's gain at the sites' betas and bias correction, over all steps when
    ``b1^2 < b2`` and over the ``round x tau`` = 6 steps otherwise (where bias correction
    changes it: 1.57 with, 0.74 without at b2 = 0.5; over all steps it does not); an SGD head
    is left out (its own bound needs the reply's sigma and q)."""
    bound = _sgd_bound(beta2=beta2, bias_correction=bias_correction, head_optimizer=head_optimizer)
    checker = _checker(bound, server_round=2)
    gain = adam_gain(
        beta1=0.9,
        beta2=beta2,
        bias_correction=bias_correction,
        max_step=None if beta2 > 0.9**2 else 2 * 3,
    )
    expected = round_update_norm_bound(
        [Point(checker.broadcast["m/A"], checker.broadcast["m/B"])],
        lr=0.05,
        local_steps=3,
        gain=gain,
        head_size=0 if head_optimizer == "sgd" else 12,
        head_lr=0.05,
        head_gain=adam_gain(beta1=ADAMW_BETAS[0], beta2=ADAMW_BETAS[1], max_step=None),
    )
    assert checker.norm_bound == pytest.approx(expected, rel=1e-12)


def test_a_key_list_names_at_most_three_missing_keys() -> None:
    broadcast = {**_broadcast(), HEAD_PREFIX + "bias": torch.zeros(3)}
    checker = _checker(None, head=("weight", "bias"), broadcast=broadcast)
    assert len(checker.expected_update_keys()) == 4
    with pytest.raises(ReplyError, match=r"missing \['head/bias', 'head/weight', 'm/dA'\],"):
        checker.validate(_record({}), {})
