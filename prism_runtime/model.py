"""Load a Hugging Face model and attach a full-rank LoRA adapter for PRISM (docs/design.md §2).

Tasks: ``seq-cls`` (sequence classification, single texts or pairs) and ``causal-lm``
(instruction tuning). Models come from a local path or the local Hugging Face cache only; nothing
is downloaded at run time unless the caller allows it.

Initialisation (PRISM needs a full-rank point: at ``Z = 0`` the fixed-rank tangent space is
degenerate):

- ``spectral-residual`` (default): the top-r SVD of each frozen weight moves into the adapter,
  ``W0 <- W0 - s U_r S_r V_r.T`` with balanced factors; this is peft's PiSSA initialisation.
  The exported adapter is rebased onto the original weights (``prism_runtime.export``).
- ``orthonormal``: balanced random orthonormal factors scaled by ``init_scale``; the base is
  unchanged.
- ``standard``: peft's default (``lora_B = 0``), for the baselines only; refused for PRISM.

Classification (``seq-cls``): the base is loaded as a plain encoder (``AutoModel``), LoRA is
attached with peft, and ``prism_runtime.classifier.PooledClassifier`` pools the token states the way
the model was trained (``pooling``, default ``auto``: the model's own sentence-transformers
pooling) and applies one linear head; text pairs are encoded jointly or siamese
(``pair_encoding``). The head starts from public knowledge (``head_init="zero-shot"``: the
frozen model's embeddings of public ``label_texts``, computed before any private data is read)
or from a seeded random draw. With ``head="train"`` (default) it is trained INSIDE the DP
mechanism: its per-example gradients join the global clip (jointly, or with their own share of
it, ``prism_runtime.trainer.TrainConfig.head_max_norm``) and get the same noise. With
``head="frozen"`` it keeps its initialisation. It is never trained outside DP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
from peft import LoraConfig, PeftModel
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from prism_core.manifold import Point
from prism_runtime.classifier import (
    PAIR_COSINE_THRESHOLD,
    ClassifierSpec,
    HeadInit,
    PairEncoding,
    PooledClassifier,
    Pooling,
    embed_texts,
    random_head_,
    read_sentence_transformers,
    resolve_pair_encoding,
    resolve_pooling,
    zero_shot_head_,
)
from prism_runtime.config import (
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_RANK,
    DEFAULT_LORA_TARGETS,
    RunConfig,
    check_label_texts,
    resolve_model,
)
from prism_runtime.data.settings import data_settings
from prism_runtime.errors import ConfigError
from prism_runtime.init_cache import attach_lora
from prism_runtime.lora import LoraHandle, lora_handles, read_points

__all__ = [
    "LoadedModel",
    "ModelConfig",
    "classifier_spec",
    "load_model",
    "load_tokenizer",
    "new_head",
    "resolve_device",
]

log = logging.getLogger(__name__)

Task = Literal["seq-cls", "causal-lm"]
Init = Literal["spectral-residual", "orthonormal", "standard"]


class ModelConfig(BaseModel):
    """What model to load and how to attach LoRA."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str = Field(description="Hugging Face model name (local cache) or a local folder")
    task: Task = Field("seq-cls", description="seq-cls or causal-lm")
    num_labels: int = Field(2, ge=2, description="number of classes (seq-cls)")
    rank: int = Field(DEFAULT_LORA_RANK, ge=1, description="LoRA rank r")
    alpha: float = Field(DEFAULT_LORA_ALPHA, gt=0, description="LoRA alpha; scaling s = alpha / r")
    target_modules: tuple[str, ...] = Field(DEFAULT_LORA_TARGETS, min_length=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    init: Init = Field("spectral-residual", description="adapter initialisation")
    init_scale: float = Field(0.1, gt=0, description="factor scale of the orthonormal init")
    svd_niter: int | None = Field(
        None, ge=1, description="randomised SVD iterations for spectral-residual (None: exact)"
    )
    head: Literal["train", "frozen"] = Field(
        "train", description="seq-cls head: DP-trained or frozen"
    )
    pooling: Pooling = Field(
        "auto", description="seq-cls sentence vector: auto (the model's own), mean, cls, ..."
    )
    pair_encoding: PairEncoding = Field(
        "auto", description="text pairs: siamese, joint, or auto (siamese for ST models)"
    )
    text_pairs: bool = Field(
        False, description="seq-cls examples are text pairs (sizes a siamese head)"
    )
    head_init: HeadInit = Field(
        "random", description="seq-cls head start: random (seeded) or zero-shot (label texts)"
    )
    label_texts: tuple[str, ...] = Field(
        (),
        description="PUBLIC description of each class for head_init=zero-shot ('a|b' or a list)",
    )
    pair_threshold: float = Field(
        PAIR_COSINE_THRESHOLD,
        ge=-1.0,
        le=1.0,
        description="public cosine threshold of the siamese zero-shot head",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(0, description="seeds the head and the adapter's random start (public)")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("label_texts", mode="before")
    @classmethod
    def _split_labels(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split("|")) if value.strip() else ()
        return value

    @field_validator("label_texts")
    @classmethod
    def _non_empty_labels(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not text.strip() for text in value):
            raise ValueError("every label text must be non-empty (separate them with '|')")
        return value


@dataclass
class LoadedModel:
    """A model ready for private training, with everything the trainer needs.

    ``model`` is a ``PooledClassifier`` around the peft model for ``seq-cls`` (its ``spec``
    says how it pools and pairs) and the peft model itself for ``causal-lm``.
    """

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    handles: list[LoraHandle]
    head_params: list[nn.Parameter]
    initial_points: list[Point] | None  # spectral-residual start, for the exact export rebase
    device: torch.device
    spec: ClassifierSpec | None = None

    @property
    def peft_model(self) -> PeftModel:
        """The peft-wrapped base model (what ``PeftModel.from_pretrained`` reloads)."""
        inner = self.model.encoder if isinstance(self.model, PooledClassifier) else self.model
        if not isinstance(inner, PeftModel):
            raise TypeError(f"expected a peft model, found {type(inner).__name__}")
        return inner

    @property
    def pair_encoding(self) -> str:
        """How this model tokenizes text pairs: ``siamese`` or ``joint``."""
        return self.spec.pair_encoding if self.spec is not None else "joint"


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
        # from_pretrained is untyped (Any); it returns the loaded PreTrainedModel
        if config.task == "seq-cls":
            return cast(PreTrainedModel, AutoModel.from_pretrained(config.model, **kwargs))
        return cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(config.model, **kwargs))
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


def load_model(
    config: ModelConfig, *, method: str = "prism", cache_dir: Path | None = None
) -> LoadedModel:
    """Load the base model and tokenizer, attach LoRA (and the classifier), set what trains.

    Args:
        config: model settings.
        method: ``prism``, ``dp-adamw``, ``ffa`` or ``nondp``; PRISM refuses ``init="standard"``,
            FFA freezes ``lora_A`` (the down-projection).
        cache_dir: a site-local folder where the spectral-residual start is cached
            (``prism_runtime.init_cache``; the model is bit-for-bit the same); None: computed.

    Raises:
        ConfigError: unknown model, zero-init with PRISM, rank too large, no target matched,
            a pooling the model lacks, zero-shot without usable label texts.
    """
    if method == "prism" and config.init == "standard":
        raise ConfigError(
            "init='standard' puts the adapter at Z = 0, where the rank-r tangent space PRISM "
            "works in is degenerate: use init='spectral-residual' (default) or 'orthonormal'"
        )
    # Modules built here and peft's standard start draw from torch's global generator: seed it
    # from the config's public seed, leaving the caller's generator as it was.
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        return _load(config, method, cache_dir)


def _load(config: ModelConfig, method: str, cache_dir: Path | None) -> LoadedModel:
    device = resolve_device(config.device)
    base = _load_base(config, device)
    tokenizer = load_tokenizer(config.model)
    if config.task == "causal-lm" and base.config.pad_token_id is None:
        base.config.pad_token_id = tokenizer.pad_token_id
    _check_ranks(base, config)
    spec, head = None, None
    if config.task == "seq-cls":
        base.to(device)  # type: ignore[arg-type]  # transformers' decorated .to loses its signature
        spec = classifier_spec(config, base)
        head = new_head(config, spec, base, tokenizer, device)  # before LoRA touches the base
    lora_config = LoraConfig(
        task_type="FEATURE_EXTRACTION" if config.task == "seq-cls" else "CAUSAL_LM",
        r=config.rank,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # peft annotates int; used as a float
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        # peft's Literal has the placeholder 'pissa_niter_[number of iters]', not 'pissa_niter_<n>'
        init_lora_weights=_peft_init(config),  # type: ignore[arg-type]
    )
    peft_model = attach_lora(base, lora_config, cache_dir=cache_dir)
    handles = lora_handles(peft_model)
    if config.init == "orthonormal":
        _orthonormal_init_(handles, config.init_scale, config.seed)
    initial = read_points(handles) if config.init == "spectral-residual" else None
    for h in handles:
        h.lora_A.data = h.lora_A.data.to(torch.float32)
        h.lora_B.data = h.lora_B.data.to(torch.float32)
        h.lora_A.requires_grad_(method != "ffa")
    model: nn.Module = peft_model
    head_params: list[nn.Parameter] = []
    if spec is not None and head is not None:
        model = PooledClassifier(peft_model, spec, head)
        head.requires_grad_(config.head == "train")
        head_params = list(head.parameters()) if config.head == "train" else []
    model.to(device)
    _check_trainable(model, handles, head_params)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s: %d LoRA modules, %d trainable parameters", config.model, len(handles), n_train)
    return LoadedModel(model, tokenizer, config, handles, head_params, initial, device, spec)


def classifier_spec(config: ModelConfig, encoder: nn.Module) -> ClassifierSpec:
    """The resolved pooling, normalisation and pair encoding of ``config`` on ``encoder``."""
    pooling, normalize = resolve_pooling(config.model, encoder, config.pooling)
    siamese = config.text_pairs and resolve_pair_encoding(config.model, config.pair_encoding) == (
        "siamese"
    )
    hidden = getattr(encoder.config, "hidden_size", None)
    if not isinstance(hidden, int):
        raise ConfigError(f"{config.model!r}: its config has no hidden_size to size the head")
    spec = ClassifierSpec(
        pooling=pooling,
        normalize=normalize or siamese,  # siamese pairs compare unit vectors (cosine)
        siamese=siamese,
        num_labels=config.num_labels,
        hidden_size=hidden,
        head_init=config.head_init,
        label_texts=config.label_texts if config.head_init == "zero-shot" else (),
        pair_threshold=config.pair_threshold,
    )
    st = read_sentence_transformers(config.model)
    log.info(
        "classifier: pooling=%s%s, normalize=%s, pairs=%s (sentence-transformers model: %s)",
        spec.pooling,
        " (auto)" if config.pooling == "auto" else "",
        spec.normalize,
        spec.pair_encoding if config.text_pairs else "-",
        st is not None,
    )
    return spec


def new_head(
    config: ModelConfig,
    spec: ClassifierSpec,
    encoder: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
) -> nn.Linear:
    """The head at its public start: seeded random, or zero-shot from the FROZEN ``encoder``.

    Call before LoRA is attached: the zero-shot head must see the pretrained model, and no
    private example is involved.
    """
    head = nn.Linear(spec.in_features, spec.num_labels).to(device=device, dtype=torch.float32)
    if config.head_init == "random":
        if config.label_texts:
            log.warning("label_texts are ignored with head_init='random'")
        std = float(getattr(encoder.config, "initializer_range", 0.02))
        random_head_(head, std=std, seed=config.seed)
        return head
    embeddings = None
    if spec.siamese:
        if config.label_texts:
            log.warning(
                "label_texts are not used by the siamese zero-shot head (the cosine rule, "
                "class 1 = similar, threshold %.3f)",
                spec.pair_threshold,
            )
    else:
        _check_label_texts(config)
        embeddings = embed_texts(
            encoder,
            tokenizer,
            config.label_texts,
            pooling=spec.pooling,
            normalize=spec.normalize,
            device=device,
        )
    zero_shot_head_(head, spec, embeddings)
    return head


def _check_label_texts(config: ModelConfig) -> None:
    if not config.label_texts:
        raise ConfigError(
            "head-init=zero-shot needs label-texts: one PUBLIC description per class in label "
            "order, separated by '|' (e.g. 'this is bad|this is great' for sentiment). Never "
            "derive them from private data: they are sent to every site. Or use "
            "head-init=random."
        )
    check_label_texts(config.label_texts, config.num_labels)


def _check_trainable(model: nn.Module, handles: list[LoraHandle], head: list[nn.Parameter]) -> None:
    """Everything trainable is a LoRA factor or the DP head (privacy rule: no other tensor)."""
    allowed = {id(p) for h in handles for p in (h.lora_A, h.lora_B)} | {id(p) for p in head}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in allowed]
    if stray:
        raise ConfigError(f"parameters trainable outside the DP mechanism: {stray[:5]}")


def model_config_for(run: RunConfig) -> ModelConfig:
    """The ``ModelConfig`` every participant derives from the run config (its ``auto`` data
    settings resolved by ``prism_runtime.data.settings.data_settings``)."""
    data = data_settings(run)
    return ModelConfig(
        model=resolve_model(run.model),
        task=run.task,
        num_labels=data.num_labels,
        rank=run.lora_rank,
        alpha=run.lora_alpha,
        target_modules=run.targets,
        init=run.init,
        head=run.lora_head,
        pooling=run.pooling,
        pair_encoding=run.pair_encoding,
        text_pairs=data.text_pairs,
        head_init=data.head_init,
        label_texts=data.label_texts,  # 'a|b': ModelConfig splits it
        device="auto",
        seed=run.seed,
    )
