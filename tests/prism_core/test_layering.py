"""Accounting depends on the record of a step, never on the tensor code that produces it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_accounting_does_not_import_the_mechanisms() -> None:
    code = (
        "import sys, prism_core.accounting; "
        "print(sorted(m for m in sys.modules if m in "
        "('prism_core.mechanism', 'prism_core.baselines', 'prism_core.adaptive')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_record_has_one_definition() -> None:
    import prism_core
    import prism_core.accounting
    import prism_core.mechanism
    from prism_core.records import ADJACENCY, NoiseRecord

    assert prism_core.NoiseRecord is prism_core.mechanism.NoiseRecord is NoiseRecord
    assert prism_core.mechanism.ADJACENCY is ADJACENCY
