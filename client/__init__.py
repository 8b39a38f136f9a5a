"""The site: the Flower ClientApp, the site's own privacy policy and its durable ledger.

A site trains with the shared runtime (``prism_runtime``: configuration, message contract, model,
data and the private trainer) and decides for itself what it accepts (``client.policy``), what it
charges (``client.site_ledger``) and what it sends (``client.site``). ``prism-train``
(``client.cli``) trains centrally on one machine with the same mechanism. Nothing here imports
the coordinator (``server``); the import contracts in ``pyproject.toml`` check it.
"""
