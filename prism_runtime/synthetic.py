"""A built-in synthetic text-classification task, generated deterministically.

It lets a fresh machine run the demo federation with nothing but the project installed: short
English clinic-feedback sentences whose label (0 negative, 1 positive) follows from the words
used, with a little label noise so the task is not trivially separable. The same ``seed`` always
gives the same rows, on every machine.

Every row is a feedback note of one patient (``patient_id``, ``SYNTHETIC_USER_FIELD``): the
notes per patient are heavy-tailed (``P(c) ~ c^-2`` for 1 to ``MAX_NOTES_PER_PATIENT`` notes,
mean about 2.6; a few patients write dozens), as a hospital's records per patient are, so the
demo's per-patient guarantee protects people with many records. Patients are drawn from their own
stream of the seed: the notes are the same with or without them, and the ids of two seeds (two
sites) never coincide.
"""

from __future__ import annotations

import hashlib
import itertools
import random

__all__ = [
    "MAX_NOTES_PER_PATIENT",
    "SYNTHETIC_USER_FIELD",
    "synthetic_examples",
    "synthetic_stream",
]

SYNTHETIC_USER_FIELD = "patient_id"
"""The field of a built-in row naming its patient."""

MAX_NOTES_PER_PATIENT = 40
"""The most notes one synthetic patient writes."""

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
    """``n`` rows ``{"text": str, "label": 0 | 1, "patient_id": str}`` from a seeded generator.

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
    for row, patient in zip(rows, _patients(seed), strict=False):
        row[SYNTHETIC_USER_FIELD] = patient
    return rows


def _patients(seed: int | str) -> itertools.chain[str]:
    """Patient ids, one per row in row order: consecutive runs of heavy-tailed lengths
    (``P(c) ~ c^-2``, 1 to ``MAX_NOTES_PER_PATIENT``), from the seed's own patient stream."""
    rng = random.Random(f"{seed} patients")
    tag = hashlib.sha256(str(seed).encode()).hexdigest()[:10]
    sizes = range(1, MAX_NOTES_PER_PATIENT + 1)
    weights = [c**-2.0 for c in sizes]
    return itertools.chain.from_iterable(
        itertools.repeat(f"patient-{tag}-{i}", rng.choices(sizes, weights)[0])
        for i in itertools.count()
    )
