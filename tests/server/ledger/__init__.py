"""Tests of ``server.ledger``, one test module per product module; ``sample_events`` is their
helper module, ``conftest`` holds the ``ledger`` fixture."""
