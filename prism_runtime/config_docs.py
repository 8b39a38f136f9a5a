"""``docs/configuration.md``, generated from the configuration models of ``prism_runtime.config``.

Every key of the run config (``RunConfig``: ``[tool.flwr.app.config]``) and of a site's node
config (``SiteConfig``: ``--node-config``) with its type, default, allowed values
(``describe_allowed``), meaning (the field's description) and who sets it. Regenerate the page
after changing a field::

    python -m prism_runtime.config_docs > docs/configuration.md

``tests/runtime/test_config_docs.py`` fails while the page and the models disagree.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from prism_runtime.config import SITE_BOUNDS, RunConfig, SiteConfig, describe_allowed
from prism_runtime.protocol import REFUSAL_REASONS

__all__ = ["COMMAND", "main", "render"]

COMMAND = "python -m prism_runtime.config_docs > docs/configuration.md"
"""How the page is made (written at its top)."""

_KINDS = {int: "integer", float: "number", str: "string", bool: "boolean"}

_INTRO = f"""\
# Configuration

Generated from the pydantic models of `prism_runtime/config.py` by

    {COMMAND}

Change a field's description or default there and regenerate; do not edit this page
(`tests/runtime/test_config_docs.py` fails while the two disagree).

prism-fl has two configurations, validated once at the top of the Flower apps (unknown keys are
refused with the list of valid ones; every error names the key, the value and what is allowed):

- the **run config** (`RunConfig`): the keys of `[tool.flwr.app.config]` in `pyproject.toml`,
  overridden with `flwr run . <federation> --run-config "key=value ..."`. It is the
  coordinator's REQUEST: every site receives it. Where a site's own policy bounds a key, a site
  refuses a run that asks for more (a refusal, charged nothing, with the code named below);
- the **node config** (`SiteConfig`): a site's `--node-config` (the site kit's `PRISM_*`
  variables). It is the site's own POLICY: nothing the coordinator sends can change or loosen it.
"""

_AUTO_TITLE = "## Keys that follow the data (`auto`)"


def _markdown(text: str) -> str:
    """Docstring text as Markdown: ``code`` as `code`."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: Any) -> str:
    """``integer``, ``number or 'auto'``, ``one of ...``: the value kinds a key takes."""
    if get_origin(annotation) is Literal:
        return "choice"
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        kinds = [_type_name(a) for a in args if a is not type(None)]
        literals = [repr(v) for a in args if get_origin(a) is Literal for v in get_args(a)]
        named = [k for k in kinds if k != "choice"] + literals
        optional = " (optional)" if type(None) in args else ""
        return " or ".join(named) + optional
    return _KINDS.get(annotation, str(annotation))


def _default(info: FieldInfo) -> str:
    """The default as it is written in TOML (``true``, ``"minilm"``), or ``not set``."""
    value = info.default
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _key(name: str) -> str:
    return name.replace("_", "-")


def _run_setter(key: str) -> str:
    codes = SITE_BOUNDS.get(key)
    if not codes:
        return "coordinator (run config)"
    refusals = "; ".join(f"{REFUSAL_REASONS[c]} (`{c}`)" for c in codes)
    return f"coordinator (request); bounded by each site's policy: {refusals}"


def _table(model: type[BaseModel], setter: Any) -> list[str]:
    rows = [
        "| key | type | default | allowed | meaning | set by |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, info in model.model_fields.items():
        key = _key(name)
        cells = (
            f"`{key}`",
            _type_name(info.annotation),
            f"`{_default(info)}`",
            describe_allowed(model, name),
            info.description or "",
            setter(key),
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def _auto_section() -> list[str]:
    from prism_runtime.data import settings

    doc = _markdown(settings.__doc__ or "").strip()
    return [_AUTO_TITLE, "", doc]


def render() -> str:
    """The whole page."""
    site_doc = _markdown(" ".join((SiteConfig.__doc__ or "").split("\n\n", 1)[-1].split()))
    lines = [
        _INTRO,
        "## Run config (`[tool.flwr.app.config]`)",
        "",
        *_table(RunConfig, _run_setter),
        "",
        "## Node config (a site's `--node-config`)",
        "",
        site_doc,
        "",
        *_table(SiteConfig, lambda _key: "site operator (node config)"),
        "",
        *_auto_section(),
    ]
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def main() -> int:
    """Write the page to standard output."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
