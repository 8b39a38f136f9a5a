"""The coordinator's strategy, ledger, report and CLI load without the site's training code.

Imported in a fresh interpreter, they load neither ``prism_runtime.trainer`` nor the model
runtime (``prism_runtime.model``, ``prism_runtime.data``, transformers, peft), and the only
modules of this repository that import Opacus on their way are the accountants
(``prism_core.accounting``: Opacus' PRV and RDP accountants; ``prism_core.skellam_accounting``:
its RDP conversion). The import contracts in pyproject.toml (``make lint``) state the same of
every import statement; this test checks what an interpreter actually loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = ("server.strategy", "server.ledger", "server.report", "server.cli")
TRAINING = (
    "prism_runtime.trainer",
    "prism_runtime.model",
    "prism_runtime.data",
    "transformers",
    "peft",
)

_PROBE = """
import builtins, json, sys

importers = set()
real_import = builtins.__import__

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] == "opacus":
        importers.add((globals or {}).get("__name__", "?"))
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy
for module in sys.argv[1:]:
    __import__(module)
ours = sorted(m for m in importers if m.split(".")[0] != "opacus")
print(json.dumps({"modules": sorted(sys.modules), "opacus-importers": ours}))
"""


def _load(*modules: str) -> dict[str, list[str]]:
    """What importing ``modules`` in a fresh interpreter loads, and which of the modules outside
    Opacus import it."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result: dict[str, list[str]] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_coordinator_loads_no_training_code_and_opacus_only_through_the_accountant() -> None:
    loaded = _load(*COORDINATOR)
    modules = set(loaded["modules"])
    assert set(COORDINATOR) <= modules
    assert [m for m in TRAINING if m in modules] == []
    assert sorted(loaded["opacus-importers"]) == [
        "prism_core.accounting",
        "prism_core.skellam_accounting",
    ]
