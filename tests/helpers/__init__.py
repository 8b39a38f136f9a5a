"""Helpers shared by the test folders: random factor points (``points``), the public data
folder next to the checkout (``shared_data``), which ``tests/conftest.py`` re-exports, a tiny
simulated site's run and node configs (``sites``), and the loopback grids of the coordinator
tests, which the benchmarks import too (``grids``)."""
