"""A secure-aggregation round played by a coordinator that writes its own messages.

``Federation``: deployed sites, each answering through the real ClientApp (``client.app.app``)
with its own ``context.state`` kept between messages, its own state folder, data file and node
config (``min-honest-sites``, ``secure-max-dropouts``, the pinned ``secure-peers`` folder); and
``Colluder``s, sites whose identity keys are pinned like the others' but whose secrets the
coordinator holds (their ``SiteRound`` is the test's object: it can sign any view, and hands
over every share it received). The coordinator builds each message with the codec
(``prism_runtime.secure_sum.messages``) and may tell every site something else.

``Adversary.recover`` then TRIES to read one site's input from what the coordinator obtained:
the site's masked vector, every share revealed to it, and the colluders' secrets and held
shares; it rebuilds each secret it holds at least t shares of (checked against the owner's
signed commitment or public key) and returns the input only if it could remove every mask.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client.app import app as client_app
from client.secure import identity_key
from prism_core.distributed import FIELD_BITS, coordinate_dim, coordinate_shapes
from prism_runtime.config import RunConfig, parse_config
from prism_runtime.exchange import to_arrays
from prism_runtime.identity import IDENTITY_PUBLIC
from prism_runtime.lora import read_points
from prism_runtime.model import load_model, model_config_for
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    ROUND_NONCE,
    SECURE_ADVERTISE,
    SECURE_CONSISTENCY,
    SECURE_MASK,
    SECURE_SAMPLE,
    SECURE_SHARE,
    SECURE_UNMASK,
    SERVER_ROUND,
    message_type,
)
from prism_runtime.secure_sum import (
    AdvertisedKeys,
    RosterPart,
    RoundId,
    RoundTrust,
    RoundView,
    SecureSumAbortedError,
    SignatureBook,
    SiteRound,
    UnmaskRequest,
    UnmaskResponse,
    combine_secret,
    expand_mask,
    pairwise_key,
    pairwise_sign,
    seed_commitment,
    sign_view,
)
from prism_runtime.secure_sum.keys import KEY_BYTES, MASK_PURPOSE
from prism_runtime.secure_sum.messages import (
    AdvertiseRequest,
    ConsistencyRequest,
    MaskRequest,
    SampleRequest,
    ShareRequest,
    SignedUnmaskRequest,
    decode_advertise_reply,
    decode_consistency_reply,
    decode_mask_reply,
    decode_sample_reply,
    decode_share_reply,
    decode_unmask_reply,
    encode_advertise_request,
    encode_consistency_request,
    encode_mask_request,
    encode_sample_request,
    encode_share_request,
    encode_unmask_request,
)
from prism_runtime.secure_sum.wire import RECORD

RUN_ID = "lying-coordinator"
ROUND = RoundId(RUN_ID, 1)
FLOWER_RUN = 2
"""The Flower run id of the sites' context: a run of its own, so the process-wide sites of other
tests' runs (``client.site.get_site``) are not mixed with these."""
ROWS = 40
"""Rows per site: a delta of 1e-5 is below 1 / N and a batch of 8 within N."""


def run_config(tiny_bert: str, **extra: object) -> dict[str, object]:
    """A secure run on the tiny BERT: one clipped sum of an expected 8 rows, sigma fixed."""
    values: dict[str, object] = {
        "model": tiny_bert,
        "lora-rank": 4,
        "local-steps": 1,
        "batch-size": 8,
        "micro-batch-size": 8,
        "max-length": 24,
        "noise-multiplier": 1.0,
        "target-epsilon": 8.0,
        "secure-aggregation": True,
        "sites-per-round": 8,
        "min-honest-sites": 8,
    }
    values.update(extra)
    return values


@dataclass
class Colluder:
    """A pinned site whose secrets the coordinator holds."""

    site_id: str
    identity: ec.EllipticCurvePrivateKey
    round: SiteRound | None = None

    def start(self, *, noise_share: float, trust: RoundTrust) -> AdvertisedKeys:
        self.round = SiteRound(
            site_id=self.site_id,
            round_id=ROUND,
            identity_key=self.identity,
            bits=FIELD_BITS,
            noise_share=noise_share,
            trust=trust,
        )
        return self.round.advertised

    def sign(self, participants: Iterable[str], survivors: Iterable[str]) -> bytes:
        """A signature of any view: a colluder signs whatever the coordinator asks."""
        assert self.round is not None
        view = RoundView(frozenset(participants), frozenset(survivors), self.round.transcript)
        return sign_view(view, round_id=ROUND, site_id=self.site_id, identity_key=self.identity)

    def answer(
        self,
        request: UnmaskRequest,
        signatures: Mapping[str, bytes],
        registered: Mapping[str, ec.EllipticCurvePublicKey],
    ) -> UnmaskResponse:
        """Its shares for ``request`` (it signs that view first, as the coordinator wishes)."""
        assert self.round is not None
        self.round.sign_view(request.survivors, identity_key=self.identity)
        return self.round.answer(request, signatures=signatures, registered=registered)

    def secrets(self) -> dict[str, Any]:
        """Everything its round holds (its keys, seed and the shares it received)."""
        assert self.round is not None
        state: dict[str, Any] = json.loads(self.round.to_bytes())
        return state


@dataclass
class Reply:
    """A site's answer to one message: its content, or its error code."""

    message: Message

    @property
    def code(self) -> int | None:
        return int(self.message.error.code) if self.message.has_error() else None

    @property
    def part(self) -> RecordDict:
        record = self.message.content[RECORD]
        return RecordDict({RECORD: record})

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.message.content[ACCOUNTING])


@dataclass
class Federation:
    """Deployed sites answering through the real ClientApp, and colluders (module docstring).

    Args:
        folder: where the sites' state, data and the pinned peers folder live.
        run: the run config (``run_config``).
        honest: site id -> its own node config keys (``min-honest-sites``, ...).
        colluders: the colluding sites' ids (their identity keys are pinned too).
    """

    folder: Path
    run: dict[str, object]
    honest: dict[str, dict[str, object]]
    colluders: dict[str, Colluder] = field(default_factory=dict)
    states: dict[str, RecordDict] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    registered: dict[str, ec.EllipticCurvePublicKey] = field(default_factory=dict)
    roster_of: dict[str, list[str]] = field(default_factory=dict)
    """Site id -> the roster's sorted ids it was last sent (its sets' bitmaps are over them)."""

    @classmethod
    def build(
        cls,
        folder: Path,
        run: dict[str, object],
        honest: Mapping[str, Mapping[str, object]],
        colluders: Iterable[str] = (),
    ) -> Federation:
        peers = folder / "peers"
        peers.mkdir(parents=True)
        peers.chmod(0o755)
        fed = cls(folder, run, {s: dict(v) for s, v in honest.items()})
        for i, site in enumerate(sorted(fed.honest)):
            state = folder / "state" / site
            key = identity_key(state)
            shutil.copy(state / IDENTITY_PUBLIC, peers / f"{site}.pem")
            (peers / f"{site}.pem").chmod(0o644)
            fed.registered[site] = key.public_key()
            fed.states[site], fed.nodes[site] = RecordDict(), 100 + i
            data = folder / f"{site}.jsonl"
            words = ("dull", "grim", "bad", "good", "fine", "great")
            data.write_text(
                "".join(
                    json.dumps({"text": f"a {words[j % 6]} film {j}", "label": int(j % 6 >= 3)})
                    + "\n"
                    for j in range(ROWS)
                )
            )
            fed.honest[site] = {
                "site-id": site,
                "data-path": str(data),
                "state-dir": str(state),
                "epsilon-cap": 8.0,
                "delta": 1e-5,
                "secure-aggregation": "require",
                "secure-peers": str(peers),
                **fed.honest[site],
            }
        for site in colluders:
            colluder = Colluder(site, ec.generate_private_key(ec.SECP256R1()))
            (peers / f"{site}.pem").write_bytes(public_pem(colluder.identity))
            (peers / f"{site}.pem").chmod(0o644)
            fed.registered[site] = colluder.identity.public_key()
            fed.colluders[site] = colluder
        return fed

    # -- the model the sites train, as the coordinator knows it -----------------------------

    def broadcast(self) -> tuple[dict[str, Any], int]:
        """The broadcast arrays (the sites' public start) and the coordinate vector's length."""
        config = parse_config(RunConfig, self.run, what="run config")
        loaded = load_model(model_config_for(config), method="prism")
        dim = coordinate_dim(coordinate_shapes(read_points(loaded.handles), loaded.head_params))
        return to_arrays(loaded), dim

    # -- one message to one real site ---------------------------------------------------------

    def call(self, site: str, action: str, secure: RecordDict, arrays: Any = None) -> Reply:
        config = ConfigRecord({SERVER_ROUND: ROUND.server_round, ROUND_NONCE: "n-1"})
        config["run-id"] = RUN_ID
        content = RecordDict({CONFIG: config, RECORD: secure[RECORD]})
        if arrays is not None:
            content[ARRAYS] = ArrayRecord(arrays)
        node = self.nodes[site]
        msg = Message(content=content, dst_node_id=node, message_type=message_type(action))
        context = Context(
            run_id=FLOWER_RUN,
            node_id=node,
            node_config=dict(self.honest[site]),  # type: ignore[arg-type]
            state=self.states[site],
            run_config=dict(self.run),  # type: ignore[arg-type]
        )
        TaskIdentity.node_id = node
        try:
            return Reply(client_app(msg, context))
        finally:
            TaskIdentity.node_id = 0

    def advertise(self, site: str, length: int) -> Reply:
        ask = AdvertiseRequest(bits=FIELD_BITS, length=length)
        return self.call(
            site, SECURE_ADVERTISE, encode_advertise_request(ask, round_id=ROUND, site_id=site)
        )

    def share(
        self,
        site: str,
        roster: Mapping[str, AdvertisedKeys],
        threshold: int,
        graph: tuple[int, int] = (0, 0),
    ) -> Reply:
        part = RosterPart.whole(roster)
        self.roster_of[site] = list(part.ids)
        ask = ShareRequest(
            roster=part, threshold=threshold, graph_degree=graph[0], graph_threshold=graph[1]
        )
        return self.call(
            site, SECURE_SHARE, encode_share_request(ask, round_id=ROUND, site_id=site)
        )

    def mask(
        self,
        site: str,
        sealed: Mapping[str, Mapping[str, bytes]],
        participants: Iterable[str],
        arrays: Any,
        near: Iterable[str] | None = None,
    ) -> Reply:
        everyone = frozenset(participants)
        for_site = {s: sealed[s][site] for s in everyone if s != site and site in sealed[s]}
        ask = MaskRequest(sealed=for_site, participants=everyone)
        content = encode_mask_request(
            ask, round_id=ROUND, site_id=site, roster=self.roster_of[site], near=near
        )
        return self.call(site, SECURE_MASK, content, arrays)

    def consistency(self, site: str, survivors: Iterable[str]) -> Reply:
        ask = ConsistencyRequest(survivors=frozenset(survivors))
        content = encode_consistency_request(
            ask, round_id=ROUND, site_id=site, roster=self.roster_of[site]
        )
        return self.call(site, SECURE_CONSISTENCY, content)

    def unmask(
        self,
        site: str,
        survivors: Iterable[str],
        dropped: Iterable[str],
        signatures: Mapping[str, bytes],
    ) -> Reply:
        """The sample exchange (the signatures committed, the site's draw), then the unmask
        exchange with the drawn signatures opened; the first reply that is an error."""
        request = UnmaskRequest(frozenset(survivors), frozenset(dropped))
        book = SignatureBook(signatures)
        roster = self.roster_of[site]
        ask = SampleRequest(request=request, signers=frozenset(book.signers), root=book.root)
        content = encode_sample_request(ask, round_id=ROUND, site_id=site, roster=roster)
        sampled = self.call(site, SECURE_SAMPLE, content)
        if sampled.code is not None:
            return sampled
        drawn = decode_sample_reply(
            sampled.part, round_id=ROUND, site_id=site, forwarded=len(book.signers)
        )
        opened, proof = book.open(drawn)
        signed = SignedUnmaskRequest(request=request, signatures=opened, proof=proof)
        content = encode_unmask_request(
            signed, round_id=ROUND, site_id=site, roster=roster, drawn=opened
        )
        return self.call(site, SECURE_UNMASK, content)

    # -- decoding the sites' replies ------------------------------------------------------------

    @staticmethod
    def keys_of(reply: Reply, site: str) -> AdvertisedKeys:
        return decode_advertise_reply(reply.part, round_id=ROUND, site_id=site)

    @staticmethod
    def sealed_of(reply: Reply, site: str, roster: Iterable[str]) -> dict[str, bytes]:
        return decode_share_reply(reply.part, round_id=ROUND, site_id=site, roster=list(roster))

    @staticmethod
    def masked_of(reply: Reply, site: str, length: int) -> np.ndarray:
        return decode_mask_reply(
            reply.part, round_id=ROUND, site_id=site, length=length, bits=FIELD_BITS
        )

    @staticmethod
    def signature_of(reply: Reply, site: str) -> bytes:
        return decode_consistency_reply(reply.part, round_id=ROUND, site_id=site)

    @staticmethod
    def shares_of(reply: Reply, site: str, request: UnmaskRequest) -> UnmaskResponse:
        return decode_unmask_reply(reply.part, round_id=ROUND, site_id=site, request=request)

    def ledger_lines(self, site: str) -> list[dict[str, Any]]:
        """The site's own privacy ledger, one dict per charge."""
        path = Path(str(self.honest[site]["state-dir"])) / "privacy-ledger.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@dataclass
class Adversary:
    """What the coordinator holds after a round (module docstring): the roster, the threshold,
    the shares revealed to it and its colluders' secrets."""

    roster: Mapping[str, AdvertisedKeys]
    threshold: int
    colluders: Mapping[str, Colluder]
    revealed: list[UnmaskResponse] = field(default_factory=list)

    def _shares(self, owner: str, kind: str) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for response in self.revealed:
            book = response.seed_shares if kind == "seed" else response.key_shares
            if owner in book:
                found[response.site_id] = book[owner]
        for site, colluder in self.colluders.items():
            held = colluder.secrets()["held"].get(owner)
            if held is not None:
                found[site] = bytes.fromhex(held[0] if kind == "seed" else held[1])
        return found

    def secret(self, owner: str, kind: str) -> bytes | None:
        """``owner``'s seed (``kind = "seed"``) or mask private key, if the coordinator holds it:
        a colluder's own, or rebuilt from at least t shares and matching what ``owner`` signed."""
        if owner in self.colluders:
            state = self.colluders[owner].secrets()
            return bytes.fromhex(state["seed" if kind == "seed" else "mask-key"])
        shares = self._shares(owner, kind)
        try:
            secret = combine_secret(
                shares,
                threshold=self.threshold,
                holders=sorted(self.roster),
                secret_bytes=KEY_BYTES,
                what=f"the {kind} of {owner}",
            )
        except SecureSumAbortedError:
            return None
        if kind == "seed":
            ok = seed_commitment(secret) == self.roster[owner].seed_commitment
        else:
            public = X25519PrivateKey.from_private_bytes(secret).public_key()
            ok = public.public_bytes_raw() == self.roster[owner].mask_public
        assert ok, f"a rebuilt {kind} of {owner} does not match what it signed"
        return secret

    def recover(
        self, target: str, masked: np.ndarray, participants: Iterable[str]
    ) -> np.ndarray | None:
        """``target``'s input, if the coordinator can remove its self mask and every pairwise
        mask it added for ``participants``; None otherwise."""
        seed = self.secret(target, "seed")
        if seed is None:
            return None
        length = masked.shape[0]
        total = (masked - expand_mask(seed, length, bits=FIELD_BITS)) & np.uint64(
            (1 << FIELD_BITS) - 1
        )
        target_key = self.secret(target, "key")
        for peer in sorted(set(participants) - {target}):
            peer_key = self.secret(peer, "key")
            if peer_key is not None:
                own, public, site, other = peer_key, self.roster[target].mask_public, peer, target
            elif target_key is not None:
                own, public, site, other = target_key, self.roster[peer].mask_public, target, peer
            else:
                return None
            key = pairwise_key(
                X25519PrivateKey.from_private_bytes(own),
                public,
                purpose=MASK_PURPOSE,
                round_id=ROUND,
                site=site,
                peer=other,
            )
            stream = expand_mask(key, length, bits=FIELD_BITS)
            total = total - stream if pairwise_sign(target, peer) > 0 else total + stream
            total &= np.uint64((1 << FIELD_BITS) - 1)
        return total
