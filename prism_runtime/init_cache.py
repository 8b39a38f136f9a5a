"""The spectral-residual (PiSSA) start, cached per base model (``prism_runtime.cache``).

peft's PiSSA initialisation (``init_lora_weights="pissa"``) takes a full SVD of every target
weight and writes ``lora_A``, ``lora_B`` and the residual base weight ``W0 - s B A``. It is a
deterministic function of the PUBLIC base weights and the LoRA settings, yet a deployed site
repeated it in every ClientApp process, i.e. every round. ``attach_lora`` stores the three
tensors of every LoRA layer once and, in later processes, attaches the adapter with
``init_lora_weights=False`` (no SVD) and writes the stored tensors back: the model is BIT-FOR-BIT
the one peft builds (``tests/runtime/test_start_cache.py``), so the exported adapter stays exact.

The key covers everything the result depends on: the targeted base weights themselves (names,
dtypes, shapes, bytes: a changed checkpoint is a new key), the device type the SVD ran on, the
LoRA settings (rank, alpha, rsLoRA, targets, init) and the torch, peft and safetensors versions.
Randomised SVD (``pissa_niter_K``) is never cached: its result depends on the global random state,
so it is not a function of the key.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import peft
import safetensors
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import Tensor, nn

from prism_runtime.cache import key_of, load_tensors, save_tensors, tensor_digest

__all__ = ["CACHED_INIT", "attach_lora", "start_key"]

log = logging.getLogger(__name__)

CACHED_INIT = "pissa"
"""The one ``init_lora_weights`` value whose result is cached (exact SVD: deterministic)."""

ADAPTER = "default"
_PARTS = ("lora_A", "lora_B", "base")


def _targets(base: nn.Module, config: LoraConfig) -> dict[str, Tensor]:
    """The weights of the modules peft will adapt, by module name (peft's own matching)."""
    return {
        name: module.weight
        for name, module in base.named_modules()
        if name
        and isinstance(getattr(module, "weight", None), Tensor)
        and check_target_module_exists(config, name)
    }


def start_key(base: nn.Module, config: LoraConfig) -> str:
    """The cache key of peft's PiSSA start of ``base`` under ``config`` (module doc)."""
    weights = _targets(base, config)
    device = {w.device.type for w in weights.values()}
    return key_of(
        {
            "what": "spectral-residual start",
            "weights": tensor_digest(weights),
            "device": sorted(device),
            "r": config.r,
            "alpha": config.lora_alpha,
            "rslora": config.use_rslora,
            "fan-in-fan-out": config.fan_in_fan_out,
            "targets": sorted(config.target_modules or ()),
            "init": config.init_lora_weights,
            "versions": [torch.__version__, peft.__version__, safetensors.__version__],
        }
    )


def _layers(model: PeftModel) -> dict[str, LoraLayer]:
    return {
        name: module
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }


def _params(layer: LoraLayer) -> dict[str, nn.Parameter]:
    """The three tensors PiSSA writes in one layer, by part name."""
    params = {
        "lora_A": layer.lora_A[ADAPTER].weight,
        "lora_B": layer.lora_B[ADAPTER].weight,
        "base": layer.get_base_layer().weight,
    }
    return {part: p for part, p in params.items() if isinstance(p, nn.Parameter)}


def _read(model: PeftModel) -> dict[str, Tensor]:
    return {
        f"{name}/{part}": p.data
        for name, layer in _layers(model).items()
        for part, p in _params(layer).items()
    }


def _fits(model: PeftModel, stored: dict[str, Tensor]) -> bool:
    """Stored tensors name exactly this model's LoRA layers, with their shapes."""
    expected = _read(model)
    if set(stored) != set(expected):
        return False
    return all(tuple(stored[k].shape) == tuple(v.shape) for k, v in expected.items())


@torch.no_grad()
def _write(model: PeftModel, stored: dict[str, Tensor]) -> None:
    for name, layer in _layers(model).items():
        params = _params(layer)
        device = params["base"].device
        for part, p in params.items():
            p.data = stored[f"{name}/{part}"].to(device)


def attach_lora(base: nn.Module, config: LoraConfig, *, cache_dir: Path | None) -> PeftModel:
    """``get_peft_model(base, config)``, with the PiSSA start read from ``cache_dir`` if stored.

    Without a ``cache_dir``, or with another init than exact PiSSA, this is
    ``get_peft_model``. Otherwise a trusted cache file (``prism_runtime.cache.load_tensors``) that
    fits the model's LoRA layers is written into an adapter attached without initialisation;
    anything else (missing, corrupt, other key, other shapes) is computed by peft and stored.
    """
    if cache_dir is None or config.init_lora_weights != CACHED_INIT:
        return get_peft_model(base, config)
    key = start_key(base, config)
    path = cache_dir / f"spectral-residual-{key[:32]}.safetensors"
    stored = load_tensors(path, key)
    if stored is not None:
        if set(stored) != {f"{n}/{p}" for n in _targets(base, config) for p in _PARTS}:
            log.warning("cache file %s names other modules; recomputing", path)
        else:
            bare = copy.deepcopy(config)
            bare.init_lora_weights = False  # no SVD: the stored start is written below
            model = get_peft_model(base, bare)
            if _fits(model, stored):
                _write(model, stored)
                model.peft_config[ADAPTER].init_lora_weights = config.init_lora_weights  # type: ignore[attr-defined]
                log.info("spectral-residual start read from %s", path)
                return model
            # Nothing was written yet: the base still holds its original weights.
            log.warning("cache file %s does not fit the model's shapes; recomputing", path)
            base = model.unload()
    model = get_peft_model(base, config)
    if save_tensors(path, _read(model), key):
        log.info("spectral-residual start stored in %s", path)
    return model
