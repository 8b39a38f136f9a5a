"""The run-config keys that follow the data: ``text-pairs``, ``num-labels``, ``label-texts`` and
``head-init``, each of which may be ``auto``.

``data_settings(run)`` resolves them, and gives the same answer at the coordinator (which builds
the model and its head) and at every site (which must build the identical model), because it
reads only what both hold: the run's ``data`` (the built-in synthetic task, or the file a
simulation partitions) and the model.

- ``text-pairs = auto``: true when the run's data are text pairs (rows with ``text_a`` and
  ``text_b``), false for single texts and for the built-in task.
- ``num-labels = auto``: the classes 0..K-1 of the run's data (``prism_runtime.data.labels``: K is
  the first label no row holds, at least 2); a row above that gap is refused, naming the row,
  never taken for a new class. The built-in task has 2.
- ``label-texts = auto``: the sentiment texts ``this is bad|this is great``
  (``SENTIMENT_LABEL_TEXTS``) for two-class single-text data, else none: they describe no other
  data's classes.
- ``head-init = auto``: zero-shot where a public start exists (label texts; for text pairs encoded
  siamese with 2 classes, the cosine rule), else seeded random.

Only an ``auto`` ``text-pairs`` or ``num-labels`` makes it read the run's data file; a participant
that cannot read it (a deployed site holds only its own data) refuses with a ``ConfigError``
naming the keys to set. When the file is read, the keys that are set are checked against it too.
A site checks its own rows against the resolved settings as it reads them
(``client.site_data``): labels outside 0..K-1 and pairs that disagree with ``text-pairs`` are
refused there (error replies 4002 and 4001).

In a deployment the sites hold the data and the run's ``data`` stays ``synthetic``, so ``auto``
means single texts of 2 classes with the sentiment texts: a coordinator whose sites hold text
pairs or other classes sets ``text-pairs``, ``num-labels`` and ``label-texts`` in the run config.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from prism_runtime.classifier import resolve_pair_encoding
from prism_runtime.config import (
    AUTO,
    SENTIMENT_LABEL_TEXTS,
    SYNTHETIC,
    RunConfig,
    check_label_texts,
    resolve_model,
    split_label_texts,
)
from prism_runtime.data.labels import check_labels, derived_class_count
from prism_runtime.data.reading import read_examples
from prism_runtime.errors import ConfigError

__all__ = [
    "DataSettings",
    "auto_head_init",
    "auto_label_texts",
    "data_settings",
    "pairs_problem",
    "text_pairs_origin",
]

log = logging.getLogger(__name__)

BINARY = 2
"""The classes of the built-in task, of the sentiment label texts and of the pairs' cosine rule."""


@dataclass(frozen=True)
class DataSettings:
    """The resolved data-dependent settings of a run (no ``auto`` left)."""

    text_pairs: bool
    num_labels: int
    label_texts: str
    """'|'-separated public class descriptions; '' for none."""
    head_init: str
    """``zero-shot`` or ``random``."""


@dataclass(frozen=True)
class _Facts:
    """What the run's data say: pairs or not, and each row's label and place (for errors)."""

    source: str
    pairs: bool
    labels: tuple[int, ...]
    where: tuple[str, ...]
    from_file: bool


_SYNTHETIC_FACTS = _Facts(SYNTHETIC, False, (0, 1), ("", ""), from_file=False)


@functools.lru_cache(maxsize=8)
def _file_facts(path: str, task: str, stamp: tuple[int, int]) -> _Facts:
    """The facts of a data file, read once per file version (``stamp``: mtime and size)."""
    del stamp  # part of the cache key only
    read = read_examples(path, task)
    return _Facts(
        path,
        pairs="text_a" in read.examples[0],
        labels=tuple(read.labels),
        where=tuple(read.where),
        from_file=True,
    )


def _facts(run: RunConfig, auto_keys: list[str]) -> _Facts:
    if run.data == SYNTHETIC:
        return _SYNTHETIC_FACTS
    path = Path(run.data)
    if not path.exists():
        raise ConfigError(
            f"{' and '.join(auto_keys)} = auto are derived from the run's data {run.data}, "
            f"which this participant cannot read: set {', '.join(auto_keys)} in the run config "
            "(where the sites hold their own data, the run config states what they are)"
        )
    info = path.stat()
    return _file_facts(str(path), run.task, (info.st_mtime_ns, info.st_size))


def pairs_problem(pairs: bool, text_pairs: bool, data: str, origin: str = "") -> str | None:
    """Why data that are (or are not) text pairs contradict ``text-pairs``, or None.

    Args:
        pairs: whether the data's rows hold ``text_a``/``text_b``.
        text_pairs: the run's resolved ``text-pairs``.
        data: what the data are, for the message (e.g. ``this site's data``).
        origin: where ``text-pairs`` came from when it was ``auto``, e.g. `` (auto, from ...)``.
    """
    if pairs and not text_pairs:
        return (
            f"{data} are text pairs (text_a, text_b) but the run has text-pairs=false{origin}: "
            "set text-pairs=true, or give single texts ('text')"
        )
    if text_pairs and not pairs:
        return (
            f"the run has text-pairs=true{origin} but {data} are single texts ('text'): give "
            "text_a/text_b pairs, or run with text-pairs=false"
        )
    return None


def text_pairs_origin(run: RunConfig) -> str:
    """Where the run's ``text-pairs`` came from, for ``pairs_problem``: '' when it is set."""
    return f" (auto, from the run's data {run.data!r})" if run.text_pairs == AUTO else ""


def auto_label_texts(pairs: bool, num_labels: int) -> str:
    """``label-texts = auto``: the sentiment texts for two-class single texts, else none."""
    return SENTIMENT_LABEL_TEXTS if not pairs and num_labels == BINARY else ""


def auto_head_init(*, pairs: bool, siamese: bool, num_labels: int, label_texts: str) -> str:
    """``head-init = auto``: ``zero-shot`` where a public start exists, else ``random``.

    Args:
        pairs: the data are text pairs.
        siamese: pairs are encoded one text at a time (``resolve_pair_encoding``).
        num_labels: the classes K.
        label_texts: the resolved label texts ('|'-separated, '' for none).
    """
    if pairs and siamese:  # the cosine rule: 2 classes, no label texts needed
        return "zero-shot" if num_labels == BINARY else "random"
    return "zero-shot" if split_label_texts(label_texts) else "random"


def _head_init(run: RunConfig, pairs: bool, num_labels: int, label_texts: str) -> str:
    if run.head_init != AUTO:
        return run.head_init
    siamese = pairs and (
        resolve_pair_encoding(resolve_model(run.model), run.pair_encoding) == "siamese"
    )
    return auto_head_init(
        pairs=pairs,
        siamese=siamese,
        num_labels=num_labels,
        label_texts=label_texts,
    )


def data_settings(run: RunConfig) -> DataSettings:
    """Resolve ``text-pairs``, ``num-labels``, ``label-texts`` and ``head-init`` (module doc).

    Raises:
        ConfigError: the run's data file is needed but cannot be read here; the data are pairs
            and ``text-pairs=false`` (or the reverse); label texts whose count is not K.
        DataError: the run's data cannot be read, or hold a label outside 0..K-1 (a stray label
            with ``num-labels = auto``), naming the rows.
    """
    if run.task != "seq-cls":  # the classifier keys do not apply
        return DataSettings(
            text_pairs=run.text_pairs if isinstance(run.text_pairs, bool) else False,
            num_labels=run.num_labels if isinstance(run.num_labels, int) else BINARY,
            label_texts="" if run.label_texts == AUTO else run.label_texts,
            head_init="random" if run.head_init == AUTO else run.head_init,
        )
    auto_keys = [
        key
        for key, value in (("text-pairs", run.text_pairs), ("num-labels", run.num_labels))
        if value == AUTO
    ]
    facts = _facts(run, auto_keys) if auto_keys else None
    pairs = run.text_pairs if isinstance(run.text_pairs, bool) else bool(facts and facts.pairs)
    if facts is not None and facts.from_file:
        problem = pairs_problem(facts.pairs, pairs, f"the run's data {facts.source}")
        if problem:
            raise ConfigError(problem)
    if isinstance(run.num_labels, int):
        num_labels = run.num_labels
        if facts is not None and facts.from_file:
            check_labels(
                facts.source,
                facts.labels,
                facts.where,
                num_labels,
                fix="Fix those rows' labels, or set num-labels to the number of classes.",
            )
    elif facts is None or not facts.from_file:
        num_labels = BINARY
    else:
        num_labels = derived_class_count(
            facts.source,
            facts.labels,
            facts.where,
            fix="set num-labels (and label-texts) to the number of classes.",
        )
    if run.label_texts != AUTO:
        label_texts = run.label_texts
        auto_k = facts is not None and run.num_labels == AUTO
        origin = f" (num-labels = auto, from {facts.source})" if facts and auto_k else ""
        check_label_texts(split_label_texts(label_texts), num_labels, origin=origin)
    else:
        label_texts = auto_label_texts(pairs, num_labels)
    settings = DataSettings(
        text_pairs=pairs,
        num_labels=num_labels,
        label_texts=label_texts,
        head_init=_head_init(run, pairs, num_labels, label_texts),
    )
    log.info(
        "data settings%s: text-pairs=%s num-labels=%d label-texts=%r head-init=%s",
        f" (auto from {facts.source})" if facts is not None else "",
        str(settings.text_pairs).lower(),
        settings.num_labels,
        settings.label_texts,
        settings.head_init,
    )
    return settings
