"""A built-in synthetic text-classification task, generated deterministically.

It lets a fresh machine run the demo federation with nothing but the project installed: short
English clinic-feedback sentences whose label (0 negative, 1 positive) follows from the words
used, with a little label noise so the task is not trivially separable. The same ``seed`` always
gives the same rows, on every machine.
"""

from __future__ import annotations

import random

__all__ = ["synthetic_examples", "synthetic_stream"]

_SUBJECTS = (
    "the nurse",
    "the doctor",
    "the reception staff",
    "the clinic",
    "the waiting room",
    "the follow-up call",
    "the pharmacy team",
    "the surgeon",
    "the night shift",
    "the discharge process",
)
_POSITIVE = (
    "was kind and attentive",
    "explained everything clearly",
    "made me feel safe",
    "was quick and helpful",
    "answered all my questions patiently",
    "was spotless and calm",
    "treated us with great respect",
    "went out of their way to help",
)
_NEGATIVE = (
    "was rude and dismissive",
    "left me confused and worried",
    "kept us waiting for hours",
    "ignored my questions",
    "was dirty and noisy",
    "lost my paperwork twice",
    "seemed careless and rushed",
    "never called back",
)
_ENDINGS = (
    "",
    " during my visit",
    " last week",
    " this morning",
    " after the operation",
    " on the weekend",
)


def synthetic_stream(run_seed: int, part: str) -> str:
    """The seed of one draw of the built-in task in a run: a site's partition (``"site-3"``) or
    the coordinator's held-out set (``"server-eval"``). A name, not arithmetic: ``seed * 1000 +
    partition`` collided with the held-out draw at partition 999 and across run seeds."""
    return f"prism-fl synthetic {run_seed} {part}"


def synthetic_examples(
    n: int, *, seed: int | str = 0, label_noise: float = 0.05
) -> list[dict[str, object]]:
    """``n`` rows ``{"text": str, "label": 0 | 1}`` from a seeded generator.

    Args:
        n: number of rows.
        seed: generator seed; equal seeds give identical rows. A string names a stream
            (:func:`synthetic_stream`): distinct names never share rows by arithmetic accident.
        label_noise: probability that a row's label is flipped.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if not 0.0 <= label_noise < 0.5:
        raise ValueError(f"label_noise={label_noise} must be in [0, 0.5)")
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        label = rng.randint(0, 1)
        phrase = rng.choice(_POSITIVE if label else _NEGATIVE)
        text = f"{rng.choice(_SUBJECTS).capitalize()} {phrase}{rng.choice(_ENDINGS)}."
        if rng.random() < label_noise:
            label = 1 - label
        rows.append({"text": text, "label": label})
    return rows
