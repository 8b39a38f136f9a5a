"""A site's training rows: its own file, or its partition of the run's data in a simulation.

The rows are checked against the run's resolved data settings
(``prism_runtime.data.settings.data_settings``), which the coordinator's model is built from: a
label outside 0..num-labels-1 is a ``DataError`` naming its line, pairs that disagree with
``text-pairs`` a ``ConfigError`` naming the key (the site's error replies 4002 and 4001).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prism_runtime.config import RunConfig, SiteConfig
from prism_runtime.data import dirichlet_partition, iid_partition, load_examples
from prism_runtime.data.reading import person_id
from prism_runtime.data.settings import data_settings, pairs_problem, text_pairs_origin
from prism_runtime.errors import ConfigError
from prism_runtime.synthetic import SYNTHETIC_USER_FIELD, synthetic_examples, synthetic_stream


def _num_labels(run: RunConfig) -> int | None:
    return data_settings(run).num_labels if run.task == "seq-cls" else None


def site_examples(
    run: RunConfig, site: SiteConfig, *, user_field: str | None = None
) -> list[dict[str, Any]]:
    """The site's training rows: its own file, or its partition of the run's data (simulation).

    With ``user_field`` (the site runs per person) every row carries its person as ``user``
    (``prism_runtime.data.load_examples``; rows without one are refused by line). A simulated
    site's partition keeps every person on one site whenever the run asks for ``user``: the
    split is a function of the run config alone, the same at every site.

    Raises:
        DataError: the rows cannot be read, a label lies outside 0..num-labels-1, or (per
            person) a row names no person.
        ConfigError: no data for this site, the run's data settings cannot be resolved, or a
            simulated site set to ``user`` in a run that splits the data per record.
    """
    if site.data_path:
        return load_examples(
            site.data_path, run.task, num_labels=_num_labels(run), user_field=user_field
        )
    if site.partition_id < 0 or site.num_partitions < 1:
        raise ConfigError("node config needs data-path, or partition-id and num-partitions")
    if user_field is not None and run.privacy_unit != "user":
        raise ConfigError(
            "a simulated site set to privacy-unit=user needs a run with privacy-unit=user: only "
            "then does the simulation split the data by person, keeping each on one site"
        )
    by_person = run.privacy_unit == "user"
    if run.data == "synthetic":  # each site draws its own patients: none is on two sites
        seed = synthetic_stream(run.seed, f"site-{site.partition_id}")
        notes = synthetic_examples(run.synthetic_examples, seed=seed)
        return [_with_person(r, SYNTHETIC_USER_FIELD, by_person) for r in notes]
    rows = load_examples(
        run.data,
        run.task,
        num_labels=_num_labels(run),
        user_field=run.user_field if by_person else None,
    )
    units = [r["user"] for r in rows] if by_person else None
    if run.partitioner == "iid":
        parts = iid_partition(len(rows), site.num_partitions, run.seed, units=units)
    else:
        labels = [int(r["label"]) for r in rows]
        parts = dirichlet_partition(  # every simulated site holds at least one expected batch
            labels,
            site.num_partitions,
            run.dirichlet_alpha,
            run.seed,
            min_size=run.batch_size if len(rows) >= run.batch_size * site.num_partitions else 1,
            units=units,
        )
    return [rows[i] for i in parts[site.partition_id]]


def person_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The number of rows of each person (``user``) in ``rows``: private facts of the shard,
    kept at the site."""
    return dict(Counter(str(r["user"]) for r in rows))


def _with_person(row: dict[str, object], field: str, by_person: bool) -> dict[str, Any]:
    """``row`` with its person as ``user`` (``by_person``) and without the raw ``field``."""
    out = {k: v for k, v in row.items() if k != field}
    if by_person:
        out["user"] = person_id(str(row[field]))
    return out


def check_text_pairs(run: RunConfig, rows: list[dict[str, Any]]) -> None:
    """The site's rows are pairs exactly when the run's resolved ``text-pairs`` says so (it
    sizes the head every participant builds).

    Raises:
        ConfigError: pairs under ``text-pairs=false``, or single texts under ``true``.
    """
    if run.task != "seq-cls" or not rows:
        return
    pairs, resolved = "text_a" in rows[0], data_settings(run).text_pairs
    problem = pairs_problem(pairs, resolved, "this site's data", text_pairs_origin(run))
    if problem:
        raise ConfigError(problem)
