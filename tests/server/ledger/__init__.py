"""Tests of ``server.ledger``, one test module per product module; ``sample_events``
and ``old_schemas`` are their helper modules, ``conftest`` holds the ``ledger``
fixture."""
