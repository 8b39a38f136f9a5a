"""Sentence classifier on a peft-wrapped encoder: the model's own pooling and a linear head.

A classification head is only as good as the representation it reads (docs/design.md §3, heads
under DP). ``PooledClassifier`` pools the encoder's token states the way the model was trained
to, optionally L2-normalises, and applies one ``nn.Linear`` (the DP head):

- Pooling (``pooling``): ``mean`` (masked mean of the last hidden states), ``cls`` (first
  token), ``max`` (masked max), ``last`` (last non-padding token; right padding) or
  ``pooler`` (the model's own pooler, BERT's dense + tanh on [CLS]). ``auto`` reads the
  model's sentence-transformers files (``modules.json`` and its Pooling module's
  ``config.json``): the bundled all-MiniLM-L6-v2 says ``mean`` and ends in ``Normalize``.
  A plain Hugging Face model without those files gets its ``pooler`` when it has one (what
  ``AutoModelForSequenceClassification`` uses for BERT-like models), else ``cls`` for an
  encoder (a masked-LM architecture) and ``last`` for a decoder.
- Normalisation: unit vectors when the model's own pipeline ends in ``Normalize`` and for
  siamese pairs (cosine geometry); otherwise the pooled vector as is.
- Text pairs (``pair_encoding``): ``joint`` feeds ``[CLS] a [SEP] b [SEP]`` as one sequence;
  ``siamese`` encodes each text separately with the SAME LoRA-adapted encoder (as
  sentence-transformers models were trained) and the head reads ``[u, v, |u - v|, u * v]``.
  ``auto`` = siamese for sentence-transformers models, joint otherwise. A siamese batch holds
  ``input_ids`` of shape (B, 2, L); the encoder runs once on the 2B texts in the interleaved
  order (a_1, b_1, a_2, b_2, ...), so per-example gradients of the encoder have 2B rows and
  ``fold_text_rows`` adds rows 2i and 2i + 1 into example i before the clip.
- Head initialisation (``head_init``): ``random`` draws ``N(0, initializer_range^2)`` weights
  from a seeded generator (public). ``zero-shot`` builds the head from PUBLIC label
  descriptions before any private data is read: with ``e_k`` the frozen model's pooled
  embedding of label text k, ``W_k = scale * e_k / (|e_k| * mean_j |e_j|)``, ``b = 0``, a
  cosine classifier with temperature ``1 / scale``. For siamese pairs the zero-shot head needs
  no text: ``logit(similar) - logit(dissimilar) = scale * (cos(u, v) - t)`` with a fixed
  public threshold t. Since u and v are unit vectors, ``cos(u, v) = sum(u * v)`` is linear in
  the ``u * v`` block of the features, so the head expresses it exactly (no extra feature).
  The label texts are sent to every site in the run config: they must be public, never
  derived from private data.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from prism_runtime.errors import ConfigError

__all__ = [
    "PAIR_COSINE_THRESHOLD",
    "POOLINGS",
    "ZERO_SHOT_SCALE",
    "ClassifierSpec",
    "PooledClassifier",
    "embed_texts",
    "fold_text_rows",
    "random_head_",
    "read_sentence_transformers",
    "resolve_pair_encoding",
    "resolve_pooling",
    "zero_shot_head_",
]

log = logging.getLogger(__name__)

Pooling = Literal["auto", "mean", "cls", "max", "last", "pooler"]
PairEncoding = Literal["auto", "siamese", "joint"]
HeadInit = Literal["random", "zero-shot"]

POOLINGS: tuple[str, ...] = ("auto", "mean", "cls", "max", "last", "pooler")
ZERO_SHOT_SCALE = 20.0
"""Inverse temperature of the zero-shot head (sentence-transformers' contrastive scale 20)."""
PAIR_COSINE_THRESHOLD = 0.8
"""Default public cosine threshold t of the siamese zero-shot head (class 1 = similar)."""
SIAMESE_FEATURES = 4  # [u, v, |u - v|, u * v]
SIMILAR, DISSIMILAR = 1, 0  # the GLUE convention of paraphrase tasks (MRPC, QQP): 1 = similar
SPEC_FILE = "classifier.json"
SPEC_VERSION = 1

# sentence-transformers Pooling config key -> our pooling name
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class SentenceTransformersInfo:
    """What a model folder's sentence-transformers files say about its sentence embedding."""

    pooling: str
    normalize: bool


@dataclass(frozen=True)
class ClassifierSpec:
    """Everything that defines the classifier around the encoder (saved as ``classifier.json``).

    Attributes:
        pooling: the resolved pooling (never ``auto``).
        normalize: L2-normalise the pooled vector.
        siamese: text pairs encoded separately, head on ``[u, v, |u - v|, u * v]``.
        num_labels: classes K.
        hidden_size: the encoder's hidden size d; the head reads d (or 4d when siamese).
        head_init: how the head started (``random`` or ``zero-shot``), for the record.
        label_texts: the public label descriptions of a zero-shot head (empty otherwise).
        pair_threshold: the cosine threshold of a siamese zero-shot head.
    """

    pooling: str
    normalize: bool
    siamese: bool
    num_labels: int
    hidden_size: int
    head_init: str = "random"
    label_texts: tuple[str, ...] = ()
    pair_threshold: float = PAIR_COSINE_THRESHOLD
    version: int = field(default=SPEC_VERSION)

    @property
    def in_features(self) -> int:
        return self.hidden_size * (SIAMESE_FEATURES if self.siamese else 1)

    @property
    def pair_encoding(self) -> str:
        """How a text pair is tokenized: ``siamese`` (two sequences) or ``joint`` (one)."""
        return "siamese" if self.siamese else "joint"

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / SPEC_FILE
        data = asdict(self)
        data["label_texts"] = list(self.label_texts)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> ClassifierSpec:
        path = Path(folder) / SPEC_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"{path}: cannot read the classifier description ({exc}). Point to the "
                "adapter folder a prism-fl run or prism-train exported."
            ) from exc
        if not isinstance(data, dict) or data.get("version") != SPEC_VERSION:
            raise ConfigError(
                f"{path}: unknown classifier description format (version "
                f"{data.get('version') if isinstance(data, dict) else None!r}, expected "
                f"{SPEC_VERSION})"
            )
        try:
            data["label_texts"] = tuple(data.get("label_texts", ()))
            spec = cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{path}: malformed classifier description ({exc})") from exc
        if spec.pooling not in POOLINGS[1:]:
            raise ConfigError(f"{path}: unknown pooling {spec.pooling!r}")
        return spec


# --------------------------------------------------------------------------------------------
# Resolving the model's own pooling
# --------------------------------------------------------------------------------------------


def _model_file(model: str, name: str) -> Path | None:
    """``name`` inside a local model folder, or inside the local HF cache copy of ``model``."""
    folder = Path(model)
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, name)
    except Exception:  # an invalid repo id: no cached file
        return None
    return Path(cached) if isinstance(cached, str) else None


def read_sentence_transformers(model: str) -> SentenceTransformersInfo | None:
    """The pooling and normalisation a sentence-transformers model folder declares, or None.

    Reads ``modules.json`` and the ``config.json`` of its ``sentence_transformers.models.Pooling``
    module. Raises ``ConfigError`` for a pooling this classifier cannot reproduce.
    """
    modules_path = _model_file(model, "modules.json")
    if modules_path is None:
        return None
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{modules_path}: unreadable sentence-transformers modules ({exc})"
        ) from exc
    if not isinstance(modules, list):
        raise ConfigError(f"{modules_path}: expected a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling_module = next(
        (m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")),
        None,
    )
    if pooling_module is None:
        return None
    config_path = _model_file(model, f"{pooling_module.get('path', '')}/config.json".lstrip("/"))
    if config_path is None:
        raise ConfigError(
            f"{model}: modules.json names a Pooling module at {pooling_module.get('path')!r} "
            "but its config.json is missing: set pooling explicitly (mean, cls, max, last)"
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    chosen = [name for key, name in _ST_MODES.items() if config.get(key)]
    unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ConfigError(
            f"{config_path}: pooling modes {chosen + unsupported} cannot be reproduced (one of "
            f"{sorted(set(_ST_MODES.values()))} is supported): set pooling explicitly"
        )
    return SentenceTransformersInfo(chosen[0], normalize)


def _has_pooler(encoder: nn.Module) -> bool:
    return getattr(encoder, "pooler", None) is not None


def resolve_pooling(model: str, encoder: nn.Module, requested: str) -> tuple[str, bool]:
    """``(pooling, normalize)`` for ``requested`` (``auto`` = the model's own), see module doc.

    Raises:
        ConfigError: unknown pooling, or ``pooler`` on a model without one.
    """
    if requested not in POOLINGS:
        raise ConfigError(f"pooling={requested!r}: use one of {list(POOLINGS)}")
    info = read_sentence_transformers(model)
    normalize = info.normalize if info is not None else False
    if requested == "auto":
        if info is not None:
            return info.pooling, normalize
        if _has_pooler(encoder):
            return "pooler", False
        model_type = getattr(getattr(encoder, "config", None), "model_type", "")
        return ("cls" if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "last"), False
    if requested == "pooler" and not _has_pooler(encoder):
        raise ConfigError(
            f"pooling='pooler' but {model!r} has no pooler layer: use pooling=auto, mean, cls "
            "or last"
        )
    return requested, normalize


def resolve_pair_encoding(model: str, requested: str) -> str:
    """``siamese`` or ``joint``; ``auto`` = siamese for sentence-transformers models."""
    if requested == "auto":
        return "siamese" if _model_file(model, "modules.json") is not None else "joint"
    if requested not in ("siamese", "joint"):
        raise ConfigError(f"pair-encoding={requested!r}: use auto, siamese or joint")
    return requested


# --------------------------------------------------------------------------------------------
# Pooling and the classifier module
# --------------------------------------------------------------------------------------------


def pool(
    hidden: Tensor, attention_mask: Tensor, pooling: str, pooler_output: Tensor | None
) -> Tensor:
    """(n, d) sentence vectors from (n, L, d) token states (right padding)."""
    if pooling == "pooler":
        if pooler_output is None:
            raise ConfigError("pooling='pooler' but the encoder returned no pooler output")
        return pooler_output
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if pooling == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    if pooling == "max":
        low = torch.finfo(hidden.dtype).min
        return hidden.masked_fill(mask == 0, low).max(dim=1).values
    if pooling == "last":
        last = (attention_mask.sum(1) - 1).clamp_min(0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ConfigError(f"unknown pooling {pooling!r}")


def fold_text_rows(grad: Tensor, examples: int) -> Tensor:
    """Per-EXAMPLE gradients from per-TEXT rows: sum the k rows ``i k .. i k + k - 1`` of each.

    A siamese batch of ``examples`` pairs runs the encoder on ``2 * examples`` texts in the
    interleaved order (a_1, b_1, a_2, b_2, ...); Opacus' ``grad_sample`` of an encoder
    parameter then has one row per text. Example i's loss depends only on its own two texts,
    so its gradient is the sum of their two rows. A tensor with ``examples`` rows is returned
    unchanged.
    """
    rows = int(grad.shape[0])
    if rows == examples:
        return grad
    if examples <= 0 or rows % examples:
        raise ValueError(f"{rows} gradient rows do not fold into {examples} examples")
    return grad.reshape(examples, rows // examples, *grad.shape[1:]).sum(1)


class PooledClassifier(nn.Module):
    """``encoder`` (a peft-wrapped base model) + pooling + one linear head.

    ``forward(**batch)`` returns an object with ``.logits`` (B, K), like a Hugging Face
    classifier, so ``prism_runtime.trainer.per_example_loss`` and Opacus' ``GradSampleModule`` work
    on it unchanged. A siamese batch has ``input_ids`` (B, 2, L); otherwise (B, L).
    """

    def __init__(self, encoder: nn.Module, spec: ClassifierSpec, head: nn.Linear) -> None:
        super().__init__()
        if head.in_features != spec.in_features or head.out_features != spec.num_labels:
            raise ValueError(
                f"head {head.in_features} -> {head.out_features} does not fit the spec "
                f"{spec.in_features} -> {spec.num_labels}"
            )
        self.encoder = encoder
        self.head = head
        self.spec = spec

    @property
    def config(self) -> Any:
        """The encoder's Hugging Face config (e.g. ``max_position_embeddings``)."""
        return self.encoder.config

    def embed(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """(n, d) pooled (and, per the spec, normalised) vectors of n sequences (n, L)."""
        return embed_batch(
            self.encoder,
            self.spec.pooling,
            self.spec.normalize,
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
        )

    def features(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """What the head reads: (B, d), or (B, 4d) ``[u, v, |u - v|, u * v]`` for pairs."""
        if not self.spec.siamese:
            if input_ids.dim() != 2:
                raise ValueError(f"expected input_ids (B, L), got {tuple(input_ids.shape)}")
            return self.embed(input_ids, attention_mask, token_type_ids)
        if input_ids.dim() != 3 or input_ids.shape[1] != 2:
            raise ValueError(
                f"a siamese classifier expects text pairs, input_ids (B, 2, L); got "
                f"{tuple(input_ids.shape)}. Tokenize with pair_encoding='siamese'."
            )
        B, _, L = input_ids.shape
        types = token_type_ids.reshape(2 * B, L) if token_type_ids is not None else None
        flat = self.embed(input_ids.reshape(2 * B, L), attention_mask.reshape(2 * B, L), types)
        pairs = flat.reshape(B, 2, -1)
        u, v = pairs[:, 0], pairs[:, 1]
        return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> SequenceClassifierOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.features(input_ids, attention_mask, token_type_ids)
        return SequenceClassifierOutput(logits=self.head(x.to(self.head.weight.dtype)))


def embed_batch(
    encoder: nn.Module,
    pooling: str,
    normalize: bool,
    *,
    input_ids: Tensor,
    attention_mask: Tensor,
    token_type_ids: Tensor | None = None,
) -> Tensor:
    """Run ``encoder`` on (n, L) sequences and pool them (see ``PooledClassifier.embed``)."""
    kwargs: dict[str, Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        kwargs["token_type_ids"] = token_type_ids
    out = encoder(**kwargs)
    pooled = pool(
        out.last_hidden_state, attention_mask, pooling, getattr(out, "pooler_output", None)
    )
    return F.normalize(pooled, dim=-1) if normalize else pooled


@torch.no_grad()
def embed_texts(
    encoder: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    pooling: str,
    normalize: bool,
    max_length: int = 128,
    device: torch.device | None = None,
) -> Tensor:
    """(len(texts), d) float32 pooled embeddings of single texts, encoder in eval mode."""
    was_training = encoder.training
    encoder.eval()
    try:
        batch = tokenizer(
            list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt"
        )
        if device is not None:
            batch = batch.to(device)
        types = batch.get("token_type_ids")
        return embed_batch(
            encoder,
            pooling,
            normalize,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=types,
        ).float()
    finally:
        encoder.train(was_training)


@torch.no_grad()
def random_head_(head: nn.Linear, *, std: float, seed: int) -> None:
    """``W ~ N(0, std^2)`` from a generator seeded with the public ``seed``, ``b = 0``."""
    g = torch.Generator().manual_seed(seed)
    head.weight.copy_(torch.randn(head.weight.shape, generator=g) * std)
    head.bias.zero_()


@torch.no_grad()
def zero_shot_head_(
    head: nn.Linear,
    spec: ClassifierSpec,
    label_embeddings: Tensor | None,
    *,
    scale: float = ZERO_SHOT_SCALE,
) -> None:
    """Write the zero-shot head (module doc) into ``head``.

    Args:
        head: the head, ``spec.in_features -> spec.num_labels``.
        spec: the classifier it belongs to.
        label_embeddings: (K, d) pooled embeddings of the public label texts (single texts);
            ``None`` for siamese pairs, whose zero-shot head is the cosine rule.
        scale: inverse temperature.
    """
    head.bias.zero_()
    if spec.siamese:
        if spec.num_labels != 2:
            raise ConfigError(
                f"head-init=zero-shot for siamese pairs is the cosine rule of 2 classes "
                f"(0 dissimilar, 1 similar); num-labels={spec.num_labels}: use head-init=random"
            )
        d, t = spec.hidden_size, spec.pair_threshold
        head.weight.zero_()
        product = slice(3 * d, 4 * d)  # the u * v block: sum(u * v) = cos(u, v) for unit u, v
        head.weight[SIMILAR, product] = scale / 2
        head.weight[DISSIMILAR, product] = -scale / 2
        head.bias[SIMILAR], head.bias[DISSIMILAR] = -scale * t / 2, scale * t / 2
        return
    if label_embeddings is None or label_embeddings.shape != (spec.num_labels, spec.hidden_size):
        shape = None if label_embeddings is None else tuple(label_embeddings.shape)
        raise ValueError(
            f"need ({spec.num_labels}, {spec.hidden_size}) label embeddings, got {shape}"
        )
    norms = label_embeddings.float().norm(dim=1, keepdim=True).clamp_min(1e-12)
    weight = scale * label_embeddings.float() / (norms * norms.mean())
    head.weight.copy_(weight.to(head.weight.dtype))
