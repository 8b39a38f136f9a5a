"""docs/configuration.md is generated from the configuration models and agrees with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from prism_runtime.config import SITE_BOUNDS, RunConfig, SiteConfig
from prism_runtime.config_docs import COMMAND, render
from prism_runtime.protocol import REFUSAL_REASONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
NOT_A_REQUEST = {"bad-broadcast", "bad-round"}  # refusals of a message, not of a run-config key


def test_the_page_is_the_generated_one() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        f"docs/configuration.md disagrees with prism_runtime/config.py: run `{COMMAND}`"
    )


@pytest.mark.parametrize("model", [RunConfig, SiteConfig])
def test_every_key_has_a_meaning_and_a_row(model: type[BaseModel]) -> None:
    page = render()
    for name, info in model.model_fields.items():
        assert info.description and info.description.strip(), f"{name} has no description"
        assert f"| `{name.replace('_', '-')}` |" in page, name


def test_the_keys_a_site_bounds_are_run_keys_with_the_sites_refusal_codes() -> None:
    keys = {name.replace("_", "-") for name in RunConfig.model_fields}
    assert set(SITE_BOUNDS) <= keys
    codes = {code for bound in SITE_BOUNDS.values() for code in bound}
    assert codes == set(REFUSAL_REASONS) - NOT_A_REQUEST
    page = render()
    for code in codes:
        assert f"(`{code}`)" in page
