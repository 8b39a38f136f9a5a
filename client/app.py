"""Flower ClientApp of a prism-fl site (thin: validate config, delegate to ``client.site``)."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.config import RunConfig, SiteConfig, parse_config
from client.logs import setup_logging
from client.protocol import ACCOUNTING, ARRAYS, CONFIG, NONPRIVATE, ROUND_NONCE, UPDATE
from client.site import get_site

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One federated round on this site (see ``client.site.Site.train_round``)."""
    setup_logging()
    run = parse_config(RunConfig, context.run_config, what="run config")
    site = parse_config(SiteConfig, context.node_config, what="node config")
    config = msg.content[CONFIG]
    arrays = msg.content[ARRAYS].to_torch_state_dict()
    worker = get_site(run, site, run_dir=str(config.get("run-dir", "")))
    reply = worker.train_round(
        int(config["server-round"]), arrays, run_id=str(config.get("run-id", ""))
    )
    content = RecordDict(
        {UPDATE: ArrayRecord(reply.arrays), ACCOUNTING: ConfigRecord(reply.accounting)}
    )
    if reply.nonprivate:  # opt-in only, labelled non-private in its key and record name
        content[NONPRIVATE] = MetricRecord(reply.nonprivate)
    # Freshness: echo this round's nonce (also on a stored reply the site resends), so the
    # coordinator can tell this answer from a replay of an earlier round's.
    content[ACCOUNTING][ROUND_NONCE] = str(config.get(ROUND_NONCE, ""))
    return Message(content=content, reply_to=msg)
