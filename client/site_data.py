"""A site's training rows: its own file, or its partition of the run's data in a simulation."""

from __future__ import annotations

import logging
from typing import Any

from prism_runtime.config import RunConfig, SiteConfig
from prism_runtime.data import dirichlet_partition, iid_partition, load_examples
from prism_runtime.errors import ConfigError
from prism_runtime.synthetic import synthetic_examples, synthetic_stream

log = logging.getLogger(__name__)


def _num_labels(run: RunConfig) -> int | None:
    return run.num_labels if run.task == "seq-cls" else None


def site_examples(run: RunConfig, site: SiteConfig) -> list[dict[str, Any]]:
    """The site's training rows: its own file, or its partition of the run's data (simulation)."""
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
    """The site's rows are pairs exactly when the run says so (``text-pairs`` sizes the head)."""
    if run.task != "seq-cls" or not rows:
        return
    pairs = "text_a" in rows[0]
    if pairs and not run.text_pairs and run.pair_encoding != "joint":
        log.warning(
            "this site's data are text pairs but the run has text-pairs=false: each pair is "
            "encoded as one joint sequence; set text-pairs=true for siamese encoding"
        )
    if run.text_pairs and not pairs:
        raise ConfigError(
            "the run has text-pairs=true but this site's data are single texts ('text'): give "
            "text_a/text_b pairs, or run with text-pairs=false"
        )
