"""Flower ClientApp of a prism-fl site (thin: read config, call ``client.site``, ``client.secure``).

Every failure becomes a Flower error reply with a code of
``prism_runtime.protocol.SITE_ERROR_CODES`` and that code's FIXED text: 4001 configuration (the node
or run config, or a privacy parameter the site cannot meet), 4002 data (the site's data cannot be
used), 4003 anything else. The exception itself, which may quote the site's data, goes only to the
site's own log, with its traceback. A refusal (``client.policy``) is not an error: it is a normal
reply.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import cast

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

from client import secure
from client.policy import RNG_SECRET_ENV, SitePolicy, site_policy
from client.reply import facts_record
from client.site import Site, get_site
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
    SECURE_ADVERTISE,
    SECURE_CONSISTENCY,
    SECURE_MASK,
    SECURE_SAMPLE,
    SECURE_SHARE,
    SECURE_UNMASK,
    SERVER_ROUND,
    SITE_ERROR_CODES,
    UPDATE,
)
from prism_runtime.secure_sum import SecureSumError

__all__ = ["CONFIG_ERROR", "DATA_ERROR", "INTERNAL_ERROR", "app", "error_code"]

log = logging.getLogger(__name__)

CONFIG_ERROR, DATA_ERROR, INTERNAL_ERROR = 4001, 4002, 4003

app = ClientApp()


def error_code(exc: BaseException) -> int:
    """The ``SITE_ERROR_CODES`` code of a failure (data before config: ``DataError`` first; a
    secure stage's refusal carries its own code, ``SecureSumError.code``)."""
    if isinstance(exc, DataError):
        return DATA_ERROR
    if isinstance(exc, SecureSumError):
        return exc.code
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


@app.train(SECURE_ADVERTISE)
def secure_advertise(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 1: the round's signed keys, or a refusal (``client.secure``)."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.advertise))


@app.train(SECURE_SHARE)
def secure_share(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 2: the sealed shares of the site's secrets."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.share))


@app.train(SECURE_MASK)
def secure_mask(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 3: the charged round, answered with its masked vector."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.mask))


@app.train(SECURE_CONSISTENCY)
def secure_consistency(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 4: the site's signature of its participant and survivor sets."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.consistency))


@app.train(SECURE_SAMPLE)
def secure_sample(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 5: which of the committed signatures the site checks."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.sample))


@app.train(SECURE_UNMASK)
def secure_unmask(msg: Message, context: Context) -> Message:
    """Secure aggregation, stage 6: the shares that unmask the sum of the survivors."""
    return _answer(msg, context, functools.partial(_secure, stage=secure.unmask))


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


def _get_site(run: RunConfig, node: SiteConfig, policy: SitePolicy, context: Context) -> Site:
    # the one place the site builds its crash-test fault object (a no-op unless a test set it)
    return get_site(run, node, policy, faults=faults_from_env(), run_id=context.run_id)


def _secure(
    msg: Message, context: Context, *, stage: Callable[[secure.SecureStage], RecordDict]
) -> Message:
    """``stage``'s answer to a secure-aggregation message, its context resolved once."""
    run, node, policy = _site(context)
    resolved = secure.SecureStage.resolve(
        msg.content, context, open_site=lambda: _get_site(run, node, policy, context)
    )
    return Message(content=stage(resolved), reply_to=msg)


def _train(msg: Message, context: Context) -> Message:
    run, node, policy = _site(context)
    # Flower types a record lookup as any record type, and a config value as any config
    # value; the coordinator's train message (``prism_runtime.protocol``) has the arrays in an
    # ArrayRecord and the round number (an int) in a ConfigRecord.
    config = cast(ConfigRecord, msg.content[CONFIG])
    arrays = cast(ArrayRecord, msg.content[ARRAYS]).to_torch_state_dict()
    site = _get_site(run, node, policy, context)
    server_round = config.get(SERVER_ROUND)  # checked by the site before anything else
    start = time.perf_counter()
    reply = site.train_round(server_round, arrays, run_id=str(config.get("run-id", "")))
    log.info("round %.40r answered in %.3f s", server_round, time.perf_counter() - start)
    accounting = facts_record(reply.accounting, str(config.get(ROUND_NONCE, "")))
    content = RecordDict({UPDATE: ArrayRecord(reply.arrays), ACCOUNTING: accounting})
    if reply.nonprivate:  # run asked AND site allowed; labelled non-private in key and record
        content[NONPRIVATE] = MetricRecord({**reply.nonprivate})
    return Message(content=content, reply_to=msg)
