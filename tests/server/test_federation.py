"""The coordinator's whole run (``server.federation.run_federation``) on a scripted grid.

Two sites answer one round with known tangent updates and known public facts; Flower's
transport and the sites' training are left out, everything from the run config to the exported
adapter is the real code. The expected adapter is computed here, independently of
``prism_core``: the weighted mean of the updates in closed form, the retraction as the best
rank-r approximation (truncated dense SVD) of ``Z_0 + mean dZ`` (eq. 22, Prop. 3.2, server lr 1).
"""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from helpers.grids import LoopbackSites
from reply_facts import honest_facts
from safetensors.torch import load_file

from prism_runtime.config import RunConfig, parse_config
from prism_runtime.export import ADAPTER_WEIGHTS, CLASSIFIER_WEIGHTS
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    HEAD_PREFIX,
    UPDATE,
)
from server.federation import run_federation
from server.ledger import Ledger

pytestmark = pytest.mark.usefixtures("flower_identity")

C, BATCH, EXAMPLES = 1.0, 16, 64
SITES = {  # node -> (sigma, shard size, seed of its update)
    11: (1.0, 100, 1),
    12: (3.0, 300, 2),
}
AGGREGATIONS = ("inverse-noise", "uniform", "examples")
SCALE = 2e-3  # entry size of the scripted updates: well inside the honest-update bound


def _weights(aggregation: str) -> dict[int, float]:
    """Closed-form weights (docs/design.md §3): (b / (sigma C))^2, 1, or N_k, normalised."""
    raw = {
        node: {"inverse-noise": (BATCH / (sigma * C)) ** 2, "uniform": 1.0, "examples": float(n)}[
            aggregation
        ]
        for node, (sigma, n, _) in SITES.items()
    }
    total = sum(raw.values())
    return {node: w / total for node, w in raw.items()}


class _ScriptedGrid(LoopbackSites):
    """Two sites replying with fixed updates and honest facts; keeps what was broadcast."""

    def __init__(self) -> None:
        self.broadcast: dict[str, torch.Tensor] = {}
        self.updates: dict[int, dict[str, torch.Tensor]] = {}

    def get_node_ids(self) -> list[int]:
        return list(SITES)

    def _update(self, node: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(SITES[node][2])
        out = {}
        for name, value in sorted(self.broadcast.items()):
            if name.startswith(HEAD_PREFIX):
                out[name] = SCALE * torch.randn(value.shape, generator=g)
            else:  # <module>/A -> <module>/dA
                module, part = name.rsplit("/", 1)
                out[f"{module}/d{part}"] = SCALE * torch.randn(value.shape, generator=g)
        return out

    def answer(self, msg):
        node = msg.metadata.dst_node_id
        self.broadcast = msg.content[ARRAYS].to_torch_state_dict()
        self.updates[node] = self._update(node)
        sigma, n, _ = SITES[node]
        facts = honest_facts(
            f"site-{node}", msg.content[CONFIG], sigma=sigma, q=BATCH / n, max_norm=C,
            expected_batch_size=float(BATCH), epsilon_cap=8.0, num_examples=n,
        )  # fmt: skip
        content = RecordDict(
            {UPDATE: ArrayRecord(self.updates[node]), ACCOUNTING: ConfigRecord(facts)}
        )
        return Message(content=content, reply_to=msg)


def _run_dir(tiny_bert: str, tmp_path, aggregation: str, **overrides):
    """The run folder of one round on the scripted grid (run config ``values`` + overrides)."""
    values = {
        "model": tiny_bert,
        "lora-rank": 4,
        "lora-init": "spectral-residual",
        "num-rounds": 1,
        "sites-per-round": 2,
        "local-steps": 1,
        "batch-size": BATCH,
        "max-norm": C,
        "synthetic-examples": EXAMPLES,
        "max-length": 24,
        "aggregation": aggregation,
        "step-at": "site",  # the scripted replies are displacements
        "run-dir": str(tmp_path / aggregation),
        **overrides,
    }
    run = parse_config(RunConfig, values, what="run config")
    grid = _ScriptedGrid()
    return grid, run_federation(grid, run)  # type: ignore[arg-type]


def _run(tiny_bert: str, tmp_path, aggregation: str) -> tuple[_ScriptedGrid, dict, dict]:
    grid, run_dir = _run_dir(tiny_bert, tmp_path, aggregation)
    summary = (run_dir / "summary.json").read_text()
    assert '"applied": true' in summary, summary
    adapter = load_file(str(run_dir / "adapter" / ADAPTER_WEIGHTS))
    head = load_file(str(run_dir / "adapter" / CLASSIFIER_WEIGHTS))
    return grid, adapter, head


def _best_rank_r(Y: torch.Tensor, r: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(Y)
    return (U[:, :r] * S[:r]) @ Vh[:r]


def _expected(grid: _ScriptedGrid, aggregation: str) -> dict[str, torch.Tensor]:
    """Per module ``Z_1 - Z_0`` (what the exported rank-2r adapter adds to the ORIGINAL base,
    see ``prism_runtime.export``) and per head tensor its new value, in float64."""
    w = _weights(aggregation)
    out = {}
    for name, value in grid.broadcast.items():
        if name.startswith(HEAD_PREFIX):
            mean = sum(w[k] * grid.updates[k][name].double() for k in SITES)
            out[name] = value.double() + mean
        elif name.endswith("/A"):
            module = name[: -len("/A")]
            A, B = value.double(), grid.broadcast[f"{module}/B"].double()
            dA = sum(w[k] * grid.updates[k][f"{module}/dA"].double() for k in SITES)
            dB = sum(w[k] * grid.updates[k][f"{module}/dB"].double() for k in SITES)
            Z0 = A @ B.T
            out[module] = _best_rank_r(Z0 + dA @ B.T + A @ dB.T, A.shape[1]) - Z0
    return out


def _exported(adapter: dict, module: str) -> torch.Tensor:
    """``lora_B @ lora_A`` of one module in the exported peft adapter (float64)."""
    (a_key,) = [k for k in adapter if k.endswith(f"{module}.lora_A.weight")]
    b_key = a_key.replace("lora_A", "lora_B")
    return adapter[b_key].double() @ adapter[a_key].double()


def _check_export(grid, adapter, head, aggregation) -> None:
    expected = _expected(grid, aggregation)
    others = [_expected(grid, a) for a in AGGREGATIONS if a != aggregation]
    modules = [k for k in expected if not k.startswith(HEAD_PREFIX)]
    assert len(modules) == 4  # query and value of 2 layers
    for module in modules:
        got, want = _exported(adapter, module), expected[module]
        tol = 1e-3 * float(want.norm())  # float32 round-off of Z_1 - Z_0 is ~1e-5 of it
        assert float(want.norm()) > 1e-3  # the round moved Z: an untrained export is far off
        assert float((got - want).norm()) <= tol, module
        for other in others:  # another weighting would be visibly different
            assert float((got - other[module]).norm()) > 20 * tol, module
    for name in ("weight", "bias"):
        want = expected[f"{HEAD_PREFIX}head.{name}"]
        torch.testing.assert_close(head[name].double(), want, rtol=0, atol=1e-6)
        for other in others:
            assert float((head[name].double() - other[f"{HEAD_PREFIX}head.{name}"]).abs().max()) > (
                1e-4
            )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_the_exported_adapter_is_the_aggregated_round_with_the_configured_weights(
    tiny_bert, tmp_path, aggregation
):
    """The adapter folder holds the TRAINED global adapter: the broadcast point moved by the
    closed-form ``aggregation`` weights of the replies (and by no other mode's weights), not
    the initial point."""
    grid, adapter, head = _run(tiny_bert, tmp_path, aggregation)
    _check_export(grid, adapter, head, aggregation)


def test_a_fixed_noise_multiplier_rejects_a_site_stating_another(tiny_bert, tmp_path):
    """``noise-multiplier = 1.0`` in the run config: every DP reply must state sigma 1.0.
    Site 12 states 3.0 and is rejected (``facts-mismatch``); site 11's round is applied and only
    its charge is confirmed."""
    _, run_dir = _run_dir(tiny_bert, tmp_path, "uniform", **{"noise-multiplier": 1.0})
    (round_1,) = json.loads((run_dir / "summary.json").read_text())["rounds"]
    assert round_1["accepted"] == ["site-11"] and round_1["applied"] is True
    assert round_1["rejected"] == [
        ["site-12", "fact sigma 3.0 is not the run's noise-multiplier 1.0"]
    ]
    assert round_1["rejected_by_reason"] == {"facts-mismatch": 1}
    with Ledger.open(run_dir / "ledger.sqlite", create=False, read_only=True) as ledger:
        confirmed = [(e.site_id, e.sigma) for e in ledger.events() if e.confirmed]
    assert confirmed == [("site-11", 1.0)]
