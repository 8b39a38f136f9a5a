"""Test helper: hostile and broken replies for the strategy's fuzz
(``tests/server/test_strategy.py``): the kinds of reply a site or an intruder can send,
each built from an honest one (``malform``), and what the coordinator must do with them
(``oracle``: which replies are aggregated and what each asked site is charged;
``expected_adapter``: what the honest updates alone give)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import strategies as st
from reply_facts import honest_facts
from strategy_helpers import strategy_for

from prism_runtime.protocol import (
    ACCOUNTING,
    CONFIG,
    REFUSAL_REASONS,
    ROUND_NONCE,
    SERVER_ROUND,
    UPDATE,
    key,
)
from server.ledger import Ledger
from server.strategy import PrismStrategy, UpdateBound

MODULES = ["m.0", "m.1"]
SHAPE = (8, 6, 2)  # m, n, r
HEAD = ["classifier.weight"]
HEAD_SHAPE = (2, 6)
NODES = [11, 12, 13]
TAU = 2
SIGMA = 2.0
SECRET = "patient-4711-hba1c-9.3"  # what a careless site might put in Error.reason

# kinds of one node's reply, by what the coordinator must do with its accounting facts
VALID = ("valid", "valid-denormal")
CHARGED = (  # facts fine, update bad: rejected, but the spent steps are recorded (confirmed)
    "missing-key",
    "extra-key",
    "empty-update",
    "wrong-shape",
    "wrong-dtype",
    "nan",
    "inf",
    "huge-norm",
    "huge-entry",
    "no-update",
    "update-not-arrays",
    "garbled-payload",
)
MISMATCH = (  # facts of this round from this site, not what was configured: unconfirmed charge
    "wrong-steps",
    "wrong-mechanism",
    "wrong-sampling",
    "wrong-adjacency",
    "wrong-rng",
    "no-rng",
    "zero-sigma",
    "delta-above-run",
    "refusal-unknown-reason",
    "refusal-with-steps",
)
UNANSWERED = (  # facts unusable or not of this round: the reply is not the site's answer
    "facts-missing",
    "facts-type",
    "facts-range",
    "facts-unknown-key",
    "no-facts",
    "facts-not-config",
    "stale-round",
    "bad-nonce",
    "no-nonce",
    "impersonate",
    "intruder",
    "error",
)
KINDS = VALID + CHARGED + MISMATCH + UNANSWERED + ("refused",)
NOT_OF_THIS_ROUND = ("replay", "not-asked")  # extra replies: never charged, never aggregated
ERROR_CODES = [4001, 4002, 4003, 2, 8, 1234]  # the site's own, Flower's own, an unknown one
REJECTION_CODE = {  # the code a rejected reply of each kind gets (the unconfirmed charge's code)
    **dict.fromkeys(
        ("facts-missing", "facts-type", "facts-range", "facts-unknown-key", "no-facts"), "facts"
    ),
    "facts-not-config": "facts",
    "stale-round": "stale-round",
    "replay": "stale-round",
    "bad-nonce": "replay",
    "no-nonce": "replay",
    "impersonate": "site-binding",
    "intruder": "site-binding",
    **dict.fromkeys(MISMATCH, "facts-mismatch"),
    "refusal-unknown-reason": "refusal-reason",
}
REQUIRED = ("site-id", "status", "sigma", "q", "steps")
BAD_TYPES = [
    ("sigma", "1.0"),
    ("q", True),
    ("steps", 2.0),
    ("steps", "2"),
    ("site-id", 5),
    ("status", b"ok"),
    ("delta", "1e-5"),
    ("server-round", 2.0),
    ("round-nonce", 7),
    ("epsilon-cap", [1.0, 2.0]),
]
BAD_RANGES = [
    ("q", 0.0),
    ("q", 1.5),
    ("q", float("nan")),
    ("sigma", -1.0),
    ("sigma", float("nan")),
    ("sigma", float("inf")),
    ("steps", -1),
    ("steps", 10**9),
    ("delta", 2.0),
    ("delta", 0.0),
    ("status", "maybe"),
    ("site-id", ""),
    ("site-id", "x" * 300),
    ("site-id", "line\nbreak"),
    ("epsilon-cap", float("inf")),
    ("num-examples", 0),
    ("server-round", -2),
]


class Grid:
    def get_node_ids(self):
        return list(NODES)


def site_of(node: int) -> str:
    return f"site-{node}"


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m, n, r = SHAPE
    arrays = {}
    for module in MODULES:
        arrays[key(module, "A")] = torch.randn(m, r, generator=g)
        arrays[key(module, "B")] = torch.randn(n, r, generator=g)
    for name in HEAD:
        arrays["head/" + name] = torch.randn(*HEAD_SHAPE, generator=g)
    return arrays


def honest_update(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m, n, r = SHAPE
    update = {}
    for module in MODULES:
        update[key(module, "dA")] = 1e-3 * torch.randn(m, r, generator=g)
        update[key(module, "dB")] = 1e-3 * torch.randn(n, r, generator=g)
    for name in HEAD:
        update["head/" + name] = 1e-3 * torch.randn(*HEAD_SHAPE, generator=g)
    return update


def site_facts(node: int, request: Message) -> dict:
    return honest_facts(
        site_of(node), request.content[CONFIG], sigma=SIGMA, steps=TAU, epsilon_cap=1e3
    )


@dataclass
class Spec:
    """One reply to send and what the coordinator must do with it."""

    node: int
    kind: str
    message: Message
    update: dict[str, torch.Tensor] | None = None  # what a valid reply contributes
    charged_steps: int = TAU


def malform(kind, node, request, data, bound) -> Spec:
    """Build a reply of the given kind from node ``node`` to ``request``."""
    update = honest_update(data.draw(st.integers(0, 2**16), label="update seed"))
    facts = site_facts(node, request)
    update_record: object = None
    charged = TAU
    error_code = data.draw(st.sampled_from(ERROR_CODES), label="error code")
    pick = data.draw(st.sampled_from(sorted(update)), label="tensor")
    if kind == "valid-denormal":
        update[pick] = update[pick].clone()
        update[pick].view(-1)[0] = 1e-45
    elif kind == "missing-key":
        del update[pick]
    elif kind == "extra-key":
        update["m.0/C"] = torch.zeros(3)
    elif kind == "empty-update":
        update = {}
    elif kind == "wrong-shape":
        update[pick] = torch.zeros(update[pick].shape[0] + 1, update[pick].shape[1])
    elif kind == "wrong-dtype":
        dtype = data.draw(st.sampled_from([torch.float64, torch.float16, torch.int32]))
        update[pick] = update[pick].to(dtype)
    elif kind in ("nan", "inf"):
        value = float("nan") if kind == "nan" else data.draw(st.sampled_from([1, -1])) * 1e999
        update[pick] = update[pick].clone()
        index = data.draw(st.integers(0, update[pick].numel() - 1), label="index")
        update[pick].view(-1)[index] = value
    elif kind == "huge-norm":  # a consistent update, far beyond what tau steps can move
        norm = sum(float(v.double().square().sum()) for v in update.values()) ** 0.5
        factor = data.draw(st.floats(3.0, 1e3)) * bound / norm
        update = {k: v * factor for k, v in update.items()}
    elif kind == "huge-entry":
        update[pick] = update[pick].clone()
        update[pick].view(-1)[0] = data.draw(st.sampled_from([1e30, -3e38, 1e9]))
    elif kind == "update-not-arrays":
        update_record = ConfigRecord({"x": 1})
    elif kind == "wrong-steps":
        facts["steps"] = data.draw(st.sampled_from([0, 1, 3, 50]))
        charged = max(facts["steps"], TAU)
    elif kind == "wrong-mechanism":
        facts["mechanism"] = data.draw(st.sampled_from(["factor-gaussian", "none", ""]))
    elif kind == "wrong-sampling":
        facts["sampling"] = data.draw(st.sampled_from(["shuffle", "fixed-size"]))
    elif kind == "wrong-adjacency":
        facts["adjacency"] = "replace-one"
    elif kind == "wrong-rng":
        facts["rng"] = data.draw(st.sampled_from(["seeded", "os-csprng ", "OS-CSPRNG"]))
    elif kind == "no-rng":
        del facts["rng"]
    elif kind == "zero-sigma":
        facts["sigma"] = 0.0
    elif kind == "delta-above-run":
        facts["delta"] = 1e-3
    elif kind == "refusal-unknown-reason":
        facts.update(
            status="refused",
            steps=0,
            reason=data.draw(st.sampled_from(["cap reached", SECRET, ""])),
        )
        update = {}
    elif kind == "refusal-with-steps":
        facts.update(status="refused", steps=TAU, reason="cap-exhausted")
        update = {}
    elif kind == "facts-missing":
        del facts[data.draw(st.sampled_from(REQUIRED))]
    elif kind == "facts-type":
        name, value = data.draw(st.sampled_from(BAD_TYPES))
        facts[name] = value
    elif kind == "facts-range":
        name, value = data.draw(st.sampled_from(BAD_RANGES))
        facts[name] = value
    elif kind == "facts-unknown-key":
        facts["train-loss"] = 0.31
    elif kind == "stale-round":
        facts[SERVER_ROUND] = data.draw(st.sampled_from([0, 1, 3, 10**6]))
    elif kind == "bad-nonce":
        facts[ROUND_NONCE] = secrets.token_hex(16)
    elif kind == "no-nonce":
        del facts[ROUND_NONCE]
    elif kind == "impersonate":
        facts["site-id"] = site_of(data.draw(st.sampled_from([n for n in NODES if n != node])))
    elif kind == "intruder":
        facts["site-id"] = "intruder"
    elif kind == "refused":
        reason = data.draw(st.sampled_from(sorted(REFUSAL_REASONS)), label="reason")
        facts.update(status="refused", steps=0, reason=reason)
        update = {}
    if kind == "error":
        message = Message(Error(code=error_code, reason=f"crashed on {SECRET}"), reply_to=request)
        return Spec(node, kind, message)
    content = RecordDict()
    if kind == "no-update":
        pass
    elif update_record is not None:
        content[UPDATE] = update_record
    else:
        arrays = {k: Array(v.contiguous().numpy()) for k, v in update.items()}
        if kind == "garbled-payload":  # declared float32 and the right shape, bytes are not
            shape = tuple(update[pick].shape)
            payload = data.draw(
                st.sampled_from(
                    [
                        b"garbage",
                        Array(torch.zeros(2, 2).numpy()).data,  # a valid array of another shape
                        bytes(data.draw(st.binary(min_size=0, max_size=300), label="bytes")),
                    ]
                )
            )
            arrays[pick] = Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=payload)
        content[UPDATE] = ArrayRecord(arrays)
    if kind == "facts-not-config":
        content[ACCOUNTING] = MetricRecord({"sigma": 1.0})
    elif kind != "no-facts":
        content[ACCOUNTING] = ConfigRecord(facts)
    valid = update if kind in VALID else None
    return Spec(node, kind, Message(content=content, reply_to=request), valid, charged)


def new_strategy(folder: Path) -> PrismStrategy:
    return strategy_for(
        modules=MODULES,
        ledger=Ledger.open(folder / "ledger.sqlite"),
        head=HEAD,
        run_id="fuzz",
        sites_per_round=len(NODES),
        local_steps=TAU,
        update_bound=UpdateBound(lr=0.05),
    )


def expected_adapter(broadcast, updates):
    """What the honest updates alone give, per module ``Z = A B.T`` and per head tensor its
    value: the exact tangent mean, retracted (server lr 1). The retraction is computed without
    ``prism_core``: the best rank-r approximation (truncated dense SVD) of ``Z_0 + mean dZ``."""
    if not updates:
        return None
    mean = {k: sum(u[k].double() for u in updates) / len(updates) for k in updates[0]}
    new = {}
    for module in MODULES:
        A, B = broadcast[key(module, "A")].double(), broadcast[key(module, "B")].double()
        dA, dB = mean[key(module, "dA")], mean[key(module, "dB")]
        U, S, Vh = torch.linalg.svd(A @ B.T + dA @ B.T + A @ dB.T)
        r = A.shape[1]
        new[module] = (U[:, :r] * S[:r]) @ Vh[:r]
    for name in HEAD:
        new["head/" + name] = broadcast["head/" + name] + mean["head/" + name].float()
    return new


def oracle(specs):
    """Which replies are accepted and what is charged, from the kinds alone.

    Every asked node's site is charged once: by the first reply that is its answer of this round
    (origin checks passed), confirmed when its facts match the configuration, nothing for a
    valid refusal, unconfirmed otherwise; a site with no such reply is charged unconfirmed.
    """
    accepted, events = [], []
    for node in NODES:
        site = site_of(node)
        mine = [s for s in specs if s.node == node]
        answer = next((s for s in mine if s.kind not in UNANSWERED + NOT_OF_THIS_ROUND), None)
        if answer is None:  # named by its first rejected reply (each node sends at least one)
            events.append((site, TAU, False, code_of(mine[0])))
        elif answer.kind == "refused":
            continue  # no steps ran
        elif answer.kind in MISMATCH:  # so every reply before it was rejected too
            events.append((site, answer.charged_steps, False, code_of(mine[0])))
        else:
            events.append((site, answer.charged_steps, True, ""))
            if answer.kind in VALID:
                accepted.append(answer.update)
    return accepted, events


def code_of(spec: Spec) -> str:
    if spec.kind == "error":
        return f"error-reply-{spec.message.error.code}"
    return REJECTION_CODE[spec.kind]
