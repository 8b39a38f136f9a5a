"""Held-out evaluation of a (trained) peft model: accuracy for seq-cls, exact match for causal-lm.

Evaluation data is public or held out by the site; nothing computed here touches the private
training set, so its metrics may be reported.

- ``seq-cls``: argmax of the logits against the label, and the mean per-example cross-entropy
  (the same per-sequence loss the trainer clips, ``prism_runtime.trainer.per_example_loss``). The
  logits come from ``loaded.model``, the same pooling, pair encoding (joint or siamese) and
  head the trainer used (``prism_runtime.classifier``).
- ``causal-lm``: greedy generation from ``[bos] + format_prompt(instruction, input)`` (the prompt
  the model was trained on), then the LAST number in the generated text is compared with the
  example's ``answer`` (or, without one, with the last number of its ``output``) to an absolute
  tolerance of ``NUMERIC_TOLERANCE``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from prism_runtime.data import TokenizedDataset, format_prompt, make_collate
from prism_runtime.errors import ConfigError
from prism_runtime.model import LoadedModel

__all__ = [
    "NUMERIC_TOLERANCE",
    "classifier_logits",
    "evaluate",
    "evaluate_rows",
    "extract_last_number",
    "generate_responses",
    "numeric_match",
    "predict",
]

log = logging.getLogger(__name__)

NUMERIC_TOLERANCE = 1e-4
"""Absolute tolerance of the causal-lm exact-match comparison."""

# Integers and decimals with optional thousands separators and sign: "-1,234.5", "42", ".5".
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas removed), or ``None`` if there is none.

    >>> extract_last_number("3 apples and 1,204.5 pears.")
    1204.5
    """
    for match in reversed(_NUMBER.findall(text)):
        cleaned = match.replace(",", "")
        if cleaned in ("", "-"):
            continue
        try:
            return float(cleaned)
        except ValueError:  # pragma: no cover - the pattern only matches parseable numbers
            continue
    return None


def numeric_match(generated: str, reference: str) -> bool:
    """Whether the last number of ``generated`` equals the last number of ``reference``."""
    predicted, expected = extract_last_number(generated), extract_last_number(reference)
    if predicted is None or expected is None:
        return False
    return math.isclose(predicted, expected, rel_tol=0.0, abs_tol=NUMERIC_TOLERANCE)


def evaluate(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    max_new_tokens: int = 32,
) -> dict[str, float]:
    """Evaluate ``loaded.model`` on held-out examples of its task.

    Runs under ``torch.no_grad()`` in eval mode on ``loaded.device`` and restores the previous
    train/eval mode afterwards.

    Args:
        loaded: The model from ``prism_runtime.model.load_model`` (possibly trained) or
            ``prism_runtime.export.load_exported``.
        examples: Output of ``prism_runtime.data.load_examples`` for the model's task.
        max_length: Token limit per example (seq-cls; per text of a siamese pair) or per prompt
            (causal-lm; longer prompts keep their last tokens, which hold the response marker).
        batch_size: Examples per forward pass or per generation batch.
        max_new_tokens: causal-lm only: the generation budget per example.

    Returns:
        seq-cls: ``{"accuracy", "loss", "examples"}``; causal-lm: ``{"exact_match", "examples"}``.

    Raises:
        ConfigError: ``batch_size`` or ``max_new_tokens`` below 1, or no examples.
    """
    metrics, _ = evaluate_rows(
        loaded,
        examples,
        max_length=max_length,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
    )
    return metrics


def evaluate_rows(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    max_new_tokens: int = 32,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``evaluate``'s metrics and one prediction per row (``predict``'s, plus ``correct``)."""
    rows = _predict(loaded, examples, max_length, batch_size, max_new_tokens, keep_logits=True)
    n = len(rows)
    if loaded.config.task == "seq-cls":
        logits = torch.stack([row.pop("_logits") for row in rows])
        labels = torch.tensor([int(ex["label"]) for ex in examples], dtype=torch.long)
        loss = float(F.cross_entropy(logits, labels, reduction="sum"))
        for row, label in zip(rows, labels.tolist(), strict=True):
            row["label"], row["correct"] = label, row["prediction"] == label
        accuracy = sum(row["correct"] for row in rows) / n
        return {"accuracy": accuracy, "loss": loss / n, "examples": n}, rows
    references = [_reference(ex) for ex in examples]
    unscorable = sum(extract_last_number(ref) is None for ref in references)
    if unscorable:
        log.warning("%d of %d examples have no number in their answer", unscorable, n)
    for row, ref in zip(rows, references, strict=True):
        row["reference"], row["correct"] = ref, numeric_match(row["response"], ref)
    return {"exact_match": sum(row["correct"] for row in rows) / n, "examples": n}, rows


def predict(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
    max_new_tokens: int = 32,
) -> list[dict[str, Any]]:
    """One prediction per example (labels, outputs and answers are not needed).

    seq-cls: ``{"prediction": class, "probabilities": [p_0, ..., p_K-1]}``; causal-lm:
    ``{"response": greedy text, "prediction": its last number or None}``. Same settings,
    mode handling and errors as ``evaluate``.
    """
    return _predict(loaded, examples, max_length, batch_size, max_new_tokens, keep_logits=False)


def _predict(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    max_length: int,
    batch_size: int,
    max_new_tokens: int,
    *,
    keep_logits: bool,
) -> list[dict[str, Any]]:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}.")
    if not examples:
        raise ConfigError("No examples: give a non-empty file.")
    model = loaded.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _autocast(loaded.device):
            if loaded.config.task == "seq-cls":
                logits = classifier_logits(
                    loaded, examples, max_length=max_length, batch_size=batch_size
                )
                probabilities = logits.softmax(dim=-1)
                return [
                    {
                        "prediction": int(p.argmax()),
                        "probabilities": [round(float(x), 6) for x in p],
                        **({"_logits": z} if keep_logits else {}),
                    }
                    for p, z in zip(probabilities, logits, strict=True)
                ]
            if max_new_tokens < 1:
                raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
            responses = generate_responses(
                loaded,
                examples,
                max_length=max_length,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
            )
            return [{"response": r, "prediction": extract_last_number(r)} for r in responses]
    finally:
        model.train(was_training)


def _autocast(device: torch.device) -> torch.autocast:
    # Same precision as training: on CUDA the frozen base is bf16 and the LoRA factors float32.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def classifier_logits(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    batch_size: int = 64,
) -> Tensor:
    """(N, K) float32 CPU logits of ``loaded.model`` (call under ``no_grad``, in eval mode).

    Examples are tokenized the way the model encodes them (joint or siamese pairs).
    """
    dataset = TokenizedDataset(
        examples,
        loaded.tokenizer,
        "seq-cls",
        max_length=max_length,
        pair_encoding=loaded.pair_encoding,
    )
    collate = make_collate(loaded.tokenizer, "seq-cls")
    out: list[Tensor] = []
    for items in _chunks([dataset[i] for i in range(len(dataset))], batch_size):
        batch = {k: v.to(loaded.device) for k, v in collate(items).items() if k != "labels"}
        out.append(loaded.model(**batch).logits.float().cpu())
    return torch.cat(out)


def _reference(example: Mapping[str, Any]) -> str:
    answer = example.get("answer")
    if answer is not None and str(answer).strip():
        return str(answer)
    return str(example.get("output") or "")


def _prompt_ids(loaded: LoadedModel, example: Mapping[str, Any], max_length: int) -> list[int]:
    tokenizer = loaded.tokenizer
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt = format_prompt(example["instruction"], example.get("input") or "")
    ids: list[int] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    keep = max(max_length - len(bos), 1)
    return bos + ids[-keep:]


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError(
            "The tokenizer has neither a pad nor an eos token, which generation needs. "
            "Set tokenizer.pad_token first."
        )
    return int(pad)


def _left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def generate_responses(
    loaded: LoadedModel,
    examples: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    batch_size: int = 16,
    max_new_tokens: int = 32,
) -> list[str]:
    """Greedy responses of a causal LM to the prompts of ``examples`` (instruction + input).

    Prompts are ``[bos] + format_prompt(...)`` as in training, left-padded within a batch so
    every response starts right after its prompt; the prompt itself is not returned.
    Call under ``torch.no_grad()`` with the model in eval mode (``evaluate`` does).

    Args:
        loaded: A causal-lm model from ``prism_runtime.model.load_model``.
        examples: Records with ``instruction`` and optional ``input``.
        max_length: Longest prompt in tokens; longer prompts keep their last tokens.
        batch_size: Prompts per ``generate`` call.
        max_new_tokens: Generation budget per prompt.

    Returns:
        One decoded response per example, special tokens removed.
    """
    tokenizer, pad_id = loaded.tokenizer, _pad_id(loaded)
    responses: list[str] = []
    for chunk in _chunks(examples, batch_size):
        input_ids, attention_mask = _left_pad(
            [_prompt_ids(loaded, ex, max_length) for ex in chunk], pad_id
        )
        # a causal-lm's model is a PeftModelForCausalLM; nn.Module types its attributes
        # ``Tensor | Module``
        generated = loaded.model.generate(  # type: ignore[operator]
            input_ids=input_ids.to(loaded.device),
            attention_mask=attention_mask.to(loaded.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        responses += tokenizer.batch_decode(
            generated[:, input_ids.shape[1] :], skip_special_tokens=True
        )
    return responses
