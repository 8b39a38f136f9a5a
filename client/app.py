"""Flower ClientApp of a prism-fl site (thin: validate config, delegate to ``client.site``).

Every failure becomes a Flower error reply with a code of
``prism_runtime.protocol.SITE_ERROR_CODES`` and that code's FIXED text: 4001 configuration (the node
or run config, or a privacy parameter the site cannot meet), 4002 data (the site's data cannot be
used), 4003 anything else. The exception itself, which may quote the site's data, goes only to the
site's own log, with its traceback. A refusal (``client.policy``) is not an error: it is a normal
reply.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from numpy.typing import NDArray

from client import secure
from client.policy import RNG_SECRET_ENV, SitePolicy, site_policy
from client.reply import refuse
from client.request import valid_round
from client.site import Site, get_site
from prism_core.distributed import FIELD_BITS, coordinate_bound
from prism_core.errors import PrivacyParameterError
from prism_runtime.cache import CACHE_DIR_ENV
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError, DataError
from prism_runtime.faults import faults_from_env
from prism_runtime.logs import setup_logging
from prism_runtime.protocol import (
    ACCOUNTING,
    ARRAYS,
    CONFIG,
    NONPRIVATE,
    ROUND_NONCE,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    UPDATE,
)
from prism_runtime.secure_sum import RoundId, check_sum_fits, encode_signed
from prism_runtime.secure_sum.messages import encode_mask_reply
from prism_runtime.secure_sum.wire import RECORD

__all__ = ["CONFIG_ERROR", "DATA_ERROR", "INTERNAL_ERROR", "app", "error_code"]

log = logging.getLogger(__name__)

CONFIG_ERROR, DATA_ERROR, INTERNAL_ERROR = 4001, 4002, 4003

app = ClientApp()


def error_code(exc: BaseException) -> int:
    """The ``SITE_ERROR_CODES`` code of a failure (data before config: ``DataError`` first)."""
    if isinstance(exc, DataError):
        return DATA_ERROR
    if isinstance(exc, ConfigError | PrivacyParameterError):
        return CONFIG_ERROR
    return INTERNAL_ERROR


def _answer(
    msg: Message, context: Context, handler: Callable[[Message, Context], Message]
) -> Message:
    """``handler``'s reply; any failure is a coded error reply, never its text."""
    setup_logging()
    try:
        return handler(msg, context)
    except Exception as exc:  # every failure: logged here in full, sent as a code only
        code = error_code(exc)
        log.error(
            "site round failed; replying with error %d (%s)",
            code,
            SITE_ERROR_CODES[code],
            exc_info=True,
        )
        return Message(Error(code=code, reason=SITE_ERROR_CODES[code]), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One federated round on this site; any failure is a coded error reply, never its text."""
    return _answer(msg, context, _train)


@app.train("secure_advertise")
def secure_advertise(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 1: the round's signed keys, or a refusal (``client.secure``)."""
    return _answer(msg, context, _secure_advertise)


@app.train("secure_share")
def secure_share(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 2: the sealed shares of the site's secrets."""
    return _answer(msg, context, _secure_share)


@app.train("secure_mask")
def secure_mask(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 3: the charged round, answered with its masked vector."""
    return _answer(msg, context, _secure_mask)


@app.train("secure_unmask")
def secure_unmask(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 4: the shares that unmask the sum of the survivors."""
    return _answer(msg, context, _secure_unmask)


def _site(context: Context) -> tuple[RunConfig, SiteConfig, SitePolicy]:
    run = parse_config(RunConfig, context.run_config, what="run config")
    node = parse_config(SiteConfig, context.node_config, what="node config")
    # The state folder comes from the site's node config, or in simulation from the RUN
    # config the simulated sites share; never from the message.
    policy = site_policy(
        node,
        run_dir=run.run_dir,
        run_id=context.run_id,
        env_secret=os.environ.get(RNG_SECRET_ENV, ""),
        env_cache_dir=os.environ.get(CACHE_DIR_ENV, ""),
    )
    return run, node, policy


def _secure_context(msg: Message, context: Context) -> tuple[Site, int, str]:
    """The site, the message's checked round number and its nonce (a secure stage)."""
    run, node, policy = _site(context)
    config = cast(ConfigRecord, msg.content[CONFIG])
    server_round = config.get(SERVER_ROUND)
    if not valid_round(server_round):
        raise ConfigError("the secure-aggregation message carries no valid round number")
    site = get_site(run, node, policy, faults=faults_from_env(), run_id=context.run_id)
    return site, server_round, str(config.get(ROUND_NONCE, ""))


def _facts_reply(msg: Message, accounting: dict[str, object], nonce: str) -> Message:
    record = ConfigRecord(accounting)  # type: ignore[arg-type]  # the facts are config values
    record[ROUND_NONCE] = nonce
    return Message(content=RecordDict({ACCOUNTING: record}), reply_to=msg)


def _secure_advertise(msg: Message, context: Context) -> Message:
    site, server_round, nonce = _secure_context(msg, context)
    if site.refusal is not None or site.secure is None:
        code = site.refusal or "secure-aggregation-off"
        refused = refuse(site.facts, site.ledger, server_round, code)
        return _facts_reply(msg, refused.accounting, nonce)
    content = secure.advertise(
        site.policy,
        msg.content,
        context,
        server_round=server_round,
        length=site.secure.dim,
        noise_share=site.secure.mu_share,
    )
    return Message(content=content, reply_to=msg)


def _honest(site: Site) -> int:
    if site.secure is None:
        raise ConfigError("this site takes no part in secure aggregation for this run")
    return site.secure.honest


def _secure_share(msg: Message, context: Context) -> Message:
    site, server_round, _ = _secure_context(msg, context)
    content = secure.share(
        site.policy, msg.content, context, server_round=server_round, honest=_honest(site)
    )
    return Message(content=content, reply_to=msg)


def _secure_mask(msg: Message, context: Context) -> Message:
    site, server_round, nonce = _secure_context(msg, context)
    site_round, participants = secure.receive_shares(
        site.policy, msg.content, context, server_round=server_round, honest=_honest(site)
    )
    bound = coordinate_bound()
    # checked before the charge: the sum of every participant's share cannot wrap
    check_sum_fits(sites=len(participants), bound=bound, bits=FIELD_BITS)

    def mask(shares: NDArray[np.int64]) -> NDArray[np.uint64]:
        encoded = encode_signed(shares, bits=FIELD_BITS, bound=bound)
        return site_round.mask(encoded, participants=participants)

    arrays = cast(ArrayRecord, msg.content[ARRAYS]).to_torch_state_dict()
    # every honest site adds the largest share a participant signed for: each participant's
    # own share mu_j / H_j is then covered by each of its H_j honest sites
    mu_share = site_round.noise_share(participants)
    reply = site.secure_round(server_round, arrays, mask=mask, mu_share=mu_share)
    secure.keep_round(context, site_round)
    answer = _facts_reply(msg, reply.accounting, nonce)
    if reply.masked is not None:
        round_id = RoundId(site_round.round_id.run_id, server_round)
        sent = encode_mask_reply(
            reply.masked, round_id=round_id, site_id=site.site_id, bits=FIELD_BITS
        )
        answer.content[RECORD] = sent[RECORD]
    return answer


def _secure_unmask(msg: Message, context: Context) -> Message:
    site, server_round, _ = _secure_context(msg, context)
    content = secure.unmask(
        site.policy, msg.content, context, server_round=server_round, honest=_honest(site)
    )
    return Message(content=content, reply_to=msg)


def _train(msg: Message, context: Context) -> Message:
    run, node, policy = _site(context)
    # Flower types a record lookup as any record type, and a config value as any config
    # value; the coordinator's train message (``prism_runtime.protocol``) has the arrays in an
    # ArrayRecord and the round number (an int) in a ConfigRecord.
    config = cast(ConfigRecord, msg.content[CONFIG])
    arrays = cast(ArrayRecord, msg.content[ARRAYS]).to_torch_state_dict()
    # the one place the site builds its crash-test fault object (a no-op unless a test set it)
    site = get_site(run, node, policy, faults=faults_from_env(), run_id=context.run_id)
    server_round = config.get(SERVER_ROUND)  # checked by the site before anything else
    start = time.perf_counter()
    reply = site.train_round(server_round, arrays, run_id=str(config.get("run-id", "")))
    log.info("round %.40r answered in %.3f s", server_round, time.perf_counter() - start)
    accounting = ConfigRecord(reply.accounting)
    content = RecordDict({UPDATE: ArrayRecord(reply.arrays), ACCOUNTING: accounting})
    if reply.nonprivate:  # run asked AND site allowed; labelled non-private in key and record
        content[NONPRIVATE] = MetricRecord({**reply.nonprivate})
    # Freshness: echo this round's nonce (also on a stored reply the site resends), so the
    # coordinator can tell this answer from a replay of an earlier round's.
    accounting[ROUND_NONCE] = str(config.get(ROUND_NONCE, ""))
    return Message(content=content, reply_to=msg)
