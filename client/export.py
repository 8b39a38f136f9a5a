"""Save a trained adapter in peft's format so it loads on the ORIGINAL base model.

With the spectral-residual (PiSSA) initialisation the frozen weight was changed to
``W0 - s A0 B0.T``. The trained model computes ``W0 - s A0 B0.T + s A B.T``, which equals
``W0 + s [A, -A0] [B, B0].T``: a rank-2r adapter with the same scaling on the original base
(``lora_alpha`` doubles with the rank so ``s`` is unchanged). That is exact up to float rounding.
With the other initialisations the base is untouched and the adapter is saved as is.
The classification head (peft ``modules_to_save``) is saved alongside in both cases.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save_file

from client.model import LoadedModel

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_adapter", "write_metrics"]

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def export_adapter(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` for the original base.

    ``PeftModel.from_pretrained(original_base, out_dir)`` then reproduces the trained model.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    if loaded.initial_points is None:
        model.save_pretrained(str(out))
        return out
    state = get_peft_model_state_dict(model)
    for handle, start in zip(loaded.handles, loaded.initial_points, strict=True):
        key_a, key_b = f"{handle.name}.lora_A.weight", f"{handle.name}.lora_B.weight"
        if key_a not in state or key_b not in state:
            raise KeyError(f"{handle.name}: LoRA weights missing from the peft state dict")
        A0 = start.A.to(state[key_b].dtype)
        B0 = start.B.to(state[key_a].dtype)
        state[key_a] = torch.cat([state[key_a], B0.T], dim=0).contiguous()  # (2r, n)
        state[key_b] = torch.cat([state[key_b], -A0], dim=1).contiguous()  # (m, 2r)
    config = copy.deepcopy(model.peft_config["default"])
    config.r = 2 * config.r
    config.lora_alpha = 2 * config.lora_alpha
    config.init_lora_weights = True
    config.save_pretrained(str(out))
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS)
    )
    log.info("exported rank-%d adapter (spectral-residual rebase) to %s", config.r, out)
    return out


def write_metrics(out_dir: str | Path, metrics: Mapping[str, Any]) -> Path:
    """Write ``metrics.json`` (sorted keys, atomic replace) and return its path."""
    path = Path(out_dir) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(metrics), indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path
