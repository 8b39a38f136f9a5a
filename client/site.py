"""One federated site: its data, model, durable privacy ledger and the work of one round.

A round (DESIGN.md §3): take the broadcast global factors, check the site's OWN cap, charge the
round's steps to the site-local ledger, run ``tau`` private steps, and reply with the tangent
update at the broadcast point (``prism_core.manifold.tangent_displacement``) plus accounting
facts. Nothing computed from un-noised data is sent unless the run opts in (labelled).

Crashes and re-asked rounds: the charge is fsync'ed BEFORE training, so a site that dies
mid-round still has those steps on its books. Every released reply is stored atomically in the
state folder (``last-round.pt``, with the optimizer state it leaves behind); when a restarted
coordinator asks again for a round the site already answered (same coordinator run id, same
round, same broadcast point by SHA-256), the site resends that stored reply instead of training
again: it is already DP output, so resending is post-processing and spends nothing. Sampling,
dropout and noise of a round are seeded from ``(seed, site-id, round)``, never from the process
history, so a round that must be re-run (the site died before storing its reply) draws exactly
what it drew the first time; it is charged again (conservatively). With ``secure-rng`` the
randomness comes from the OS and an exact replay is impossible by design.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from client.config import RunConfig, SiteConfig, resolve_model, site_method
from client.data import TokenizedDataset, dirichlet_partition, iid_partition, load_examples
from client.durable import atomic_write, locked
from client.errors import ConfigError
from client.exchange import head_named, load_arrays
from client.lora import read_points
from client.model import LoadedModel, ModelConfig, load_model
from client.protocol import HEAD_PREFIX, STATUS_OK, STATUS_REFUSED, key
from client.site_ledger import SiteLedger, SiteLedgerEntry
from client.synthetic import synthetic_examples
from client.testhooks import pause_point
from client.trainer import MECHANISMS, PrivateTrainer, TrainConfig
from prism_core.accounting import PrivacyEvent, calibrate_noise_multiplier, epsilon
from prism_core.adaptive import AdaptiveState, realign_state
from prism_core.manifold import Point, tangent_displacement
from prism_core.mechanism import ADJACENCY

__all__ = [
    "RoundReply",
    "Site",
    "broadcast_digest",
    "get_site",
    "model_config",
    "site_examples",
]

log = logging.getLogger(__name__)


def model_config(run: RunConfig) -> ModelConfig:
    """The ``ModelConfig`` every participant derives from the run config."""
    return ModelConfig(
        model=resolve_model(run.model),
        task=run.task,
        num_labels=run.num_labels,
        rank=run.lora_rank,
        alpha=run.lora_alpha,
        target_modules=run.targets,
        init=run.init,  # type: ignore[arg-type]
        head=run.lora_head,
        pooling=run.pooling,
        pair_encoding=run.pair_encoding,
        text_pairs=run.text_pairs,
        head_init=run.head_init,
        label_texts=run.label_texts,  # type: ignore[arg-type]  # 'a|b': ModelConfig splits it
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


def _check_text_pairs(run: RunConfig, rows: list[dict[str, Any]]) -> None:
    """The site's rows are pairs exactly when the run says so (``text-pairs`` sizes the head)."""
    if run.task != "seq-cls" or not rows:
        return
    pairs = "text_a" in rows[0]
    if pairs and not run.text_pairs and run.pair_encoding != "joint":
        log.warning(
            "this site's data are text pairs but the run has text-pairs=false: each pair is "
            "encoded as one joint sequence; set text-pairs=true for siamese encoding"
        )
    if run.text_pairs and not pairs:
        raise ConfigError(
            "the run has text-pairs=true but this site's data are single texts ('text'): give "
            "text_a/text_b pairs, or run with text-pairs=false"
        )


@dataclass
class RoundReply:
    """A site's answer to one round: arrays to send and accounting facts."""

    arrays: dict[str, Tensor]
    accounting: dict[str, Any]
    nonprivate: dict[str, float] = field(default_factory=dict)


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def broadcast_digest(arrays: dict[str, Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the broadcast arrays (sorted)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        t = arrays[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Site:
    """A site's long-lived state within one process (model, data, trainer, ledgers)."""

    def __init__(self, run: RunConfig, site: SiteConfig, state_dir: Path) -> None:
        self.run, self.site, self.site_id = run, site, site.name()
        self.epsilon_cap, self.delta = site.cap(run)
        self.method = site_method(run.method)
        self.loaded: LoadedModel = load_model(model_config(run), method=self.method)
        rows = site_examples(run, site)
        _check_text_pairs(run, rows)
        self.num_examples = len(rows)
        dataset = TokenizedDataset(
            rows,
            self.loaded.tokenizer,
            run.task,
            max_length=run.max_length,
            pair_encoding=self.loaded.pair_encoding,
        )
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
            head_lr=run.head_learning_rate,
            head_optimizer=run.head_optimizer,
            head_max_norm=run.head_clip,
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

    def _round_path(self) -> Path:
        return self.state_dir / "last-round.pt"

    def _last_round(self) -> dict[str, Any] | None:
        path = self._round_path()
        if not path.exists():
            return None
        try:
            saved: dict[str, Any] = torch.load(path, weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"{path}: unreadable site round state ({exc}); it holds the last released reply "
                "and optimizer state. Restore it from backup, or move it away to start the "
                "optimizer state afresh (the privacy ledger is separate and kept)."
            ) from exc
        return saved

    def _restore_adaptive(self, start: list[Point]) -> None:
        saved = self._last_round()
        legacy = self.state_dir / "adaptive-state.pt"  # written by earlier releases
        if saved is None and legacy.exists():
            saved = {"adaptive": torch.load(legacy, weights_only=True)}
        if self.method != "prism" or saved is None or saved.get("adaptive") is None:
            return
        adaptive = saved["adaptive"]
        states = [AdaptiveState(**s) for s in adaptive["states"]]
        ends = [Point(*p) for p in adaptive["points"]]
        self.trainer.states = [
            realign_state(s, e, p) for s, e, p in zip(states, ends, start, strict=True)
        ]

    def _store_round(
        self, run_id: str, server_round: int, digest: str, reply: RoundReply, end: list[Point]
    ) -> None:
        """Store the released reply and the optimizer state it leaves, in one atomic write."""
        adaptive = None
        if self.method == "prism":
            adaptive = {
                "states": [vars(s) for s in self.trainer.states],
                "points": [(p.A, p.B) for p in end],
            }
        payload = {
            "run-id": run_id,
            "round": server_round,
            "broadcast": digest,
            "arrays": reply.arrays,
            "accounting": reply.accounting,
            "nonprivate": reply.nonprivate,
            "adaptive": adaptive,
        }
        atomic_write(self._round_path(), lambda f: torch.save(payload, f))

    def _stored_reply(self, run_id: str, server_round: int, digest: str) -> RoundReply | None:
        saved = self._last_round()
        if not run_id or saved is None:
            return None
        if (saved["run-id"], saved["round"], saved["broadcast"]) != (run_id, server_round, digest):
            return None
        return RoundReply(dict(saved["arrays"]), dict(saved["accounting"]), saved["nonprivate"])

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

    def train_round(
        self, server_round: int, arrays: dict[str, Tensor], *, run_id: str = ""
    ) -> RoundReply:
        """Run one round from the broadcast ``arrays``; refuse if it would pass the site's cap.

        With a ``run_id`` (the coordinator's run), a round this site already answered from the
        same broadcast point is answered again with the stored reply, spending nothing.
        """
        with locked(self.state_dir / ".round.lock"):
            digest = broadcast_digest(arrays)
            stored = self._stored_reply(run_id, server_round, digest)
            if stored is not None:
                log.info(
                    "site %s: round %d of run %s already answered; resending the stored reply",
                    self.site_id,
                    server_round,
                    run_id,
                )
                return stored
            return self._train_round(run_id, server_round, digest, arrays)

    def _train_round(
        self, run_id: str, server_round: int, digest: str, arrays: dict[str, Tensor]
    ) -> RoundReply:
        self.ledger.reload()  # another process may have charged this site since
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
        pause_point("site-training", server_round)
        start = load_arrays(self.loaded, arrays)
        self._restore_adaptive(start)
        self.trainer.begin_round(history, tau)
        self.trainer.reseed(_seed(self.run.seed, self.site_id, server_round))
        results = self.trainer.train(tau)
        end = read_points(self.loaded.handles)
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
        self._store_round(run_id, server_round, digest, reply, end)
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
