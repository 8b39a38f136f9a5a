"""Helpers shared by the test folders: random factor points (``points``) and the public data
folder next to the checkout (``shared_data``). ``tests/conftest.py`` re-exports them."""
