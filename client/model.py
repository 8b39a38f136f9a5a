"""Load a Hugging Face model and attach a full-rank LoRA adapter for PRISM (DESIGN.md §2).

Tasks: ``seq-cls`` (sequence classification, single texts or pairs) and ``causal-lm``
(instruction tuning). Models come from a local path or the local Hugging Face cache only; nothing
is downloaded at run time unless the caller allows it.

Initialisation (PRISM needs a full-rank point: at ``Z = 0`` the fixed-rank tangent space is
degenerate):

- ``spectral-residual`` (default): the top-r SVD of each frozen weight moves into the adapter,
  ``W0 <- W0 - s U_r S_r V_r.T`` with balanced factors; this is peft's PiSSA initialisation.
  The exported adapter is rebased onto the original weights (``client.export``).
- ``orthonormal``: balanced random orthonormal factors scaled by ``init_scale``; the base is
  unchanged.
- ``standard``: peft's default (``lora_B = 0``), for the baselines only; refused for PRISM.

Classification head: peft marks the new head (``classifier``/``score``) as a module to save. With
``head="train"`` (default) it is trained INSIDE the DP mechanism: its per-example gradients join
the global clip and get the same noise (``prism_core.mechanism.clip_and_sum(euclidean=...)``).
With ``head="frozen"`` it keeps its seeded random initialisation. It is never trained outside DP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from client.errors import ConfigError
from client.lora import LoraHandle, lora_handles, read_points
from prism_core.manifold import Point

__all__ = ["LoadedModel", "ModelConfig", "load_model", "resolve_device"]

log = logging.getLogger(__name__)

Task = Literal["seq-cls", "causal-lm"]
Init = Literal["spectral-residual", "orthonormal", "standard"]


class ModelConfig(BaseModel):
    """What model to load and how to attach LoRA."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field(description="Hugging Face model name (local cache) or a local folder")
    task: Task = Field("seq-cls", description="seq-cls or causal-lm")
    num_labels: int = Field(2, ge=2, description="number of classes (seq-cls)")
    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; scaling s = alpha / r")
    target_modules: tuple[str, ...] = Field(("query", "value"), min_length=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    init: Init = Field("spectral-residual", description="adapter initialisation")
    init_scale: float = Field(0.1, gt=0, description="factor scale of the orthonormal init")
    svd_niter: int | None = Field(
        None, ge=1, description="randomised SVD iterations for spectral-residual (None: exact)"
    )
    head: Literal["train", "frozen"] = Field(
        "train", description="seq-cls head: DP-trained or frozen"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(0, description="seeds the head and orthonormal initialisation (public)")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value


@dataclass
class LoadedModel:
    """A peft model ready for private training, with everything the trainer needs."""

    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    handles: list[LoraHandle]
    head_params: list[nn.Parameter]
    initial_points: list[Point] | None  # spectral-residual start, for the exact export rebase
    device: torch.device


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available: use 'cpu' or 'auto'")
    return torch.device(device)


def _load_base(config: ModelConfig, device: torch.device) -> PreTrainedModel:
    kwargs: dict[str, object] = {}
    if device.type == "cuda":
        kwargs["dtype"] = torch.bfloat16  # frozen base in bf16; LoRA factors stay float32
    try:
        torch.manual_seed(config.seed)  # the new head's initialisation is public and seeded
        if config.task == "seq-cls":
            return AutoModelForSequenceClassification.from_pretrained(
                config.model, num_labels=config.num_labels, **kwargs
            )
        return AutoModelForCausalLM.from_pretrained(config.model, **kwargs)
    except OSError as exc:
        raise ConfigError(
            f"cannot load model {config.model!r}: {exc}. Give a local folder or a model already "
            "in the Hugging Face cache (nothing is downloaded at run time)."
        ) from exc


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (eos when the tokenizer has none)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except OSError as exc:
        raise ConfigError(f"cannot load the tokenizer of {model!r}: {exc}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_ranks(base: nn.Module, config: ModelConfig) -> None:
    matched = [
        (name, module)
        for name, module in base.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] in config.target_modules
    ]
    if not matched:
        raise ConfigError(
            f"target_modules={list(config.target_modules)} match no linear layer of "
            f"{config.model!r}: name the last part of a module path (e.g. query, q_proj)"
        )
    for name, module in matched:
        limit = min(module.in_features, module.out_features)
        if config.rank > limit:
            raise ConfigError(
                f"rank={config.rank} is larger than min(m, n)={limit} of {name} "
                f"({module.out_features} x {module.in_features}): use rank <= {limit}"
            )


def _peft_init(config: ModelConfig) -> bool | str:
    if config.init == "spectral-residual":
        return f"pissa_niter_{config.svd_niter}" if config.svd_niter else "pissa"
    return True


@torch.no_grad()
def _orthonormal_init_(handles: list[LoraHandle], scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for h in handles:
        m, n, r = h.shape
        QA, _ = torch.linalg.qr(torch.randn(m, r, generator=g))
        QB, _ = torch.linalg.qr(torch.randn(n, r, generator=g))
        h.lora_B.copy_(scale * QA)
        h.lora_A.copy_(scale * QB.T)


def load_model(config: ModelConfig, *, method: str = "prism") -> LoadedModel:
    """Load the base model and tokenizer, attach LoRA, set what is trainable.

    Args:
        config: model settings.
        method: ``prism``, ``dp-adamw``, ``ffa`` or ``nondp``; PRISM refuses ``init="standard"``,
            FFA freezes ``lora_A`` (the down-projection).

    Raises:
        ConfigError: unknown model, zero-init with PRISM, rank too large, no target matched.
    """
    if method == "prism" and config.init == "standard":
        raise ConfigError(
            "init='standard' puts the adapter at Z = 0, where the rank-r tangent space PRISM "
            "works in is degenerate: use init='spectral-residual' (default) or 'orthonormal'"
        )
    device = resolve_device(config.device)
    base = _load_base(config, device)
    tokenizer = load_tokenizer(config.model)
    if config.task == "causal-lm" and base.config.pad_token_id is None:
        base.config.pad_token_id = tokenizer.pad_token_id
    _check_ranks(base, config)
    lora_config = LoraConfig(
        task_type="SEQ_CLS" if config.task == "seq-cls" else "CAUSAL_LM",
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        init_lora_weights=_peft_init(config),
    )
    model = get_peft_model(base, lora_config)
    handles = lora_handles(model)
    if config.init == "orthonormal":
        _orthonormal_init_(handles, config.init_scale, config.seed)
    initial = read_points(handles) if config.init == "spectral-residual" else None
    for h in handles:
        h.lora_A.data = h.lora_A.data.to(torch.float32)
        h.lora_B.data = h.lora_B.data.to(torch.float32)
        h.lora_A.requires_grad_(method != "ffa")
    head = [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and "lora_" not in name and "modules_to_save" in name
    ]
    if config.head == "frozen" or config.task != "seq-cls":
        for p in head:
            p.requires_grad_(False)
        head = []
    model.to(device)
    _check_trainable(model, handles, head)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s: %d LoRA modules, %d trainable parameters", config.model, len(handles), n_train)
    return LoadedModel(model, tokenizer, config, handles, head, initial, device)


def _check_trainable(model: nn.Module, handles: list[LoraHandle], head: list[nn.Parameter]) -> None:
    """Everything trainable is a LoRA factor or the DP head (privacy rule: no other tensor)."""
    allowed = {id(p) for h in handles for p in (h.lora_A, h.lora_B)} | {id(p) for p in head}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in allowed]
    if stray:
        raise ConfigError(f"parameters trainable outside the DP mechanism: {stray[:5]}")
