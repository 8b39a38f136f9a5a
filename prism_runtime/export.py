"""Save a trained adapter in peft's format so it loads on the ORIGINAL base model.

With the spectral-residual initialisation (peft's ``init_lora_weights="pissa"``) the frozen
weight was changed to ``W0 - s A0 B0.T``, where ``A0 B0.T`` is the adapter as peft initialised it
(``LoadedModel.initial_points``). The export is peft's own PiSSA-to-LoRA conversion,
``PeftModel.save_pretrained(..., path_initial_model_for_weight_conversion=...)``: the initial
adapter is written to a temporary folder and peft saves the rank-2r adapter
``lora_A = [lora_A; lora_A0]``, ``lora_B = [lora_B, -lora_B0]`` (``[A, -A0] [B, B0].T`` in
PRISM's notation, ``prism_runtime.lora``) with doubled ``lora_alpha``, so ``s`` is unchanged and the
original base gives ``W0 + s (A B.T - A0 B0.T)``, the trained weight, up to float rounding (on
tiny float32 BERT and Llama the logits agree within 3e-7). With the other
initialisations the base is untouched and the adapter is saved as is.

A classifier (``seq-cls``) is the peft adapter on the base ENCODER (``AutoModel``) plus the
pooling and head of ``prism_runtime.classifier``: ``classifier.json`` (pooling, normalisation, pair
encoding, head shape and how it started) and ``classifier.safetensors`` (head ``weight`` and
``bias``) are written next to the adapter. ``load_exported`` puts the three back together;
``PeftModel.from_pretrained(AutoModel.from_pretrained(base), out_dir)`` alone gives the adapted
encoder.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from prism_core.manifold import Point
from prism_runtime.classifier import SPEC_FILE, ClassifierSpec, PooledClassifier
from prism_runtime.errors import ConfigError
from prism_runtime.lora import LoraHandle
from prism_runtime.model import LoadedModel, ModelConfig, load_tokenizer, resolve_device

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CLASSIFIER_WEIGHTS",
    "export_adapter",
    "load_exported",
    "write_metrics",
]

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CLASSIFIER_WEIGHTS = "classifier.safetensors"
INITIAL_ADAPTER = "prism_initial"  # also the name peft gives the initial adapter while converting


def export_adapter(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` for the original base.

    ``PeftModel.from_pretrained(original_base, out_dir)`` then reproduces the trained base
    model (the encoder of a classifier, whose pooling and head are saved alongside). The live
    model is left as it was (peft loads the initial adapter beside it and deletes it again).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _export_classifier(loaded, out)
    model = loaded.peft_model
    if loaded.initial_points is None:
        model.save_pretrained(str(out))
        return out
    with tempfile.TemporaryDirectory(prefix="prism-export-") as tmp:
        initial = Path(tmp) / INITIAL_ADAPTER
        _save_initial_adapter(model, loaded.handles, loaded.initial_points, initial)
        with warnings.catch_warnings():
            # peft warns that PiSSA should not be combined with other adapters while it loads
            # the initial adapter for exactly the conversion it recommends
            warnings.filterwarnings("ignore", message="PiSSA changes the base weights")
            model.save_pretrained(str(out), path_initial_model_for_weight_conversion=str(initial))
    rank = _lora_config(model).r
    log.info("exported rank-%d adapter (spectral-residual rebase) to %s", 2 * rank, out)
    return out


def _save_initial_adapter(
    model: PeftModel, handles: list[LoraHandle], initial: list[Point], folder: Path
) -> None:
    """The spectral-residual start ``A0 B0.T`` as peft's weights file (peft adds the config)."""
    expected = set(get_peft_model_state_dict(model))
    state: dict[str, torch.Tensor] = {}
    for handle, start in zip(handles, initial, strict=True):
        state[f"{handle.name}.lora_A.weight"] = start.B.T  # peft (r, n)
        state[f"{handle.name}.lora_B.weight"] = start.A  # peft (m, r)
    if set(state) != expected:
        raise KeyError(
            "the initial LoRA factors do not match the peft state dict: "
            f"{sorted(set(state) ^ expected)[:5]}"
        )
    folder.mkdir(parents=True)
    save_file(
        {k: v.detach().float().cpu().contiguous() for k, v in state.items()},
        str(folder / ADAPTER_WEIGHTS),
    )


def _lora_config(model: PeftModel) -> LoraConfig:
    """The ``default`` adapter's config (peft types ``peft_config`` values as ``PeftConfig``;
    every adapter prism-fl makes or loads is LoRA)."""
    return cast(LoraConfig, model.peft_config["default"])


def _export_classifier(loaded: LoadedModel, out: Path) -> None:
    if loaded.spec is None or not isinstance(loaded.model, PooledClassifier):
        return
    loaded.spec.save(out)
    head = loaded.model.head
    weights = {"weight": head.weight, "bias": head.bias}
    save_file(
        {k: v.detach().float().cpu().contiguous() for k, v in weights.items()},
        str(out / CLASSIFIER_WEIGHTS),
    )


def _adapter_base(folder: Path) -> str:
    path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return str(config["base_model_name_or_path"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: not a readable peft adapter config ({exc}). Point to the adapter folder "
            "a prism-fl run or prism-train exported."
        ) from exc


def load_exported(
    folder: str | Path, *, model: str | None = None, device: str = "auto"
) -> LoadedModel:
    """Load an exported adapter (and its classifier) on the ORIGINAL base, ready to evaluate.

    Args:
        folder: the ``adapter`` folder ``export_adapter`` wrote.
        model: the base model folder or cached name; default the adapter's
            ``base_model_name_or_path``.
        device: ``auto``, ``cpu`` or ``cuda``.

    Returns:
        A ``LoadedModel`` in eval mode for ``prism_runtime.evaluate`` (nothing trainable).

    Raises:
        ConfigError: missing or malformed files, or a base model that cannot be loaded.
    """
    folder = Path(folder)
    base_name = model or _adapter_base(folder)
    is_classifier = (folder / SPEC_FILE).is_file()
    torch_device = resolve_device(device)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16} if torch_device.type == "cuda" else {}
    loader = AutoModel if is_classifier else AutoModelForCausalLM
    try:
        base = loader.from_pretrained(base_name, **kwargs)
    except OSError as exc:
        raise ConfigError(
            f"cannot load the base model {base_name!r}: {exc}. Pass the original base model's "
            "folder (nothing is downloaded at run time)."
        ) from exc
    tokenizer = load_tokenizer(base_name)
    peft_model = PeftModel.from_pretrained(base, str(folder))
    spec: ClassifierSpec | None = None
    net: nn.Module = peft_model
    if is_classifier:
        spec = ClassifierSpec.load(folder)
        net = PooledClassifier(peft_model, spec, _load_head(folder, spec))
    elif peft_model.config.pad_token_id is None:
        peft_model.config.pad_token_id = tokenizer.pad_token_id
    net.to(torch_device).eval()
    net.requires_grad_(False)
    config = ModelConfig(
        model=base_name,
        task="seq-cls" if is_classifier else "causal-lm",
        num_labels=spec.num_labels if spec is not None else 2,
        rank=int(_lora_config(peft_model).r),
        alpha=float(_lora_config(peft_model).lora_alpha),
        # peft types it ``list[str] | str | None``; its __post_init__ makes a list a set
        target_modules=tuple(_lora_config(peft_model).target_modules),  # type: ignore[arg-type]
        pooling=spec.pooling if spec is not None else "auto",
        pair_encoding=spec.pair_encoding if spec is not None else "auto",
        text_pairs=bool(spec and spec.siamese),
        device=device,
    )
    return LoadedModel(net, tokenizer, config, [], [], None, torch_device, spec)


def _load_head(folder: Path, spec: ClassifierSpec) -> nn.Linear:
    path = folder / CLASSIFIER_WEIGHTS
    try:
        weights = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{path}: cannot read the classifier head ({exc})") from exc
    head = nn.Linear(spec.in_features, spec.num_labels)
    try:
        head.load_state_dict({"weight": weights["weight"], "bias": weights["bias"]})
    except (KeyError, RuntimeError) as exc:
        raise ConfigError(
            f"{path}: the head does not match {SPEC_FILE} ({spec.in_features} -> "
            f"{spec.num_labels}): {exc}"
        ) from exc
    return head


def write_metrics(out_dir: str | Path, metrics: Mapping[str, Any]) -> Path:
    """Write ``metrics.json`` (sorted keys, atomic replace) and return its path."""
    path = Path(out_dir) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(metrics), indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path
