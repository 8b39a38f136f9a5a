"""Tests of ``server.strategy``, one test module per product module, and the helper
modules they share (``two_modules``, ``three_sites``, ``clip_estimate``, ``hostile``)."""
