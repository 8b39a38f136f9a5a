"""A site's training rows: its own file, or its partition of the run's data in a simulation.

The rows are checked against the run's resolved data settings
(``prism_runtime.data.settings.data_settings``), which the coordinator's model is built from: a
label outside 0..num-labels-1 is a ``DataError`` naming its line, pairs that disagree with
``text-pairs`` a ``ConfigError`` naming the key (the site's error replies 4002 and 4001).
"""

from __future__ import annotations

from typing import Any

from prism_runtime.config import RunConfig, SiteConfig
from prism_runtime.data import dirichlet_partition, iid_partition, load_examples
from prism_runtime.data.settings import data_settings, pairs_problem, text_pairs_origin
from prism_runtime.errors import ConfigError
from prism_runtime.synthetic import synthetic_examples, synthetic_stream


def _num_labels(run: RunConfig) -> int | None:
    return data_settings(run).num_labels if run.task == "seq-cls" else None


def site_examples(run: RunConfig, site: SiteConfig) -> list[dict[str, Any]]:
    """The site's training rows: its own file, or its partition of the run's data (simulation).

    Raises:
        DataError: the rows cannot be read, or a label lies outside 0..num-labels-1.
        ConfigError: no data for this site, or the run's data settings cannot be resolved.
    """
    if site.data_path:
        return load_examples(site.data_path, run.task, num_labels=_num_labels(run))
    if site.partition_id < 0 or site.num_partitions < 1:
        raise ConfigError("node config needs data-path, or partition-id and num-partitions")
    if run.data == "synthetic":
        seed = synthetic_stream(run.seed, f"site-{site.partition_id}")
        return synthetic_examples(run.synthetic_examples, seed=seed)
    rows = load_examples(run.data, run.task, num_labels=_num_labels(run))
    if run.partitioner == "iid":
        parts = iid_partition(len(rows), site.num_partitions, run.seed)
    else:
        labels = [int(r["label"]) for r in rows]
        parts = dirichlet_partition(  # every simulated site holds at least one expected batch
            labels,
            site.num_partitions,
            run.dirichlet_alpha,
            run.seed,
            min_size=run.batch_size if len(rows) >= run.batch_size * site.num_partitions else 1,
        )
    return [rows[i] for i in parts[site.partition_id]]


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
