"""A site's privacy unit is its own policy: per patient when it says so, whatever the run asks;
a per-record site refuses a run that asks for per-person, charging nothing; a ledger's record
events count per person by group privacy, and a per-person ledger never goes back."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers.sites import simulated_node, tiny_run_config

from client.policy import site_policy
from client.site import Site
from client.site_data import site_examples
from prism_core.accounting import epsilon
from prism_core.records import PrivacyEvent
from prism_runtime.config import RunConfig, SiteConfig, parse_config
from prism_runtime.errors import ConfigError, DataError
from prism_runtime.exchange import to_arrays
from prism_runtime.protocol import REFUSAL_REASONS, STATUS_OK, STATUS_REFUSED


def _run(tiny_bert, **overrides):
    values = {"batch-size": 8, "micro-batch-size": 8, "synthetic-examples": 96, **overrides}
    return tiny_run_config(tiny_bert, **values)


def _site(run, tmp_path, **node):
    config = simulated_node(tmp_path, **node)
    return Site(run, config, site_policy(config))


def _deployed(tmp_path, rows, **node):
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {
        "data-path": str(data),
        "site-id": "hospital-a",
        "state-dir": str(tmp_path / "state"),
        "epsilon-cap": 50.0,
        "delta": 1e-5,
        **node,
    }
    return parse_config(SiteConfig, values, what="node config")


def _notes(people=24, per_person=3):
    return [
        {"text": f"note {j} of patient {i}", "label": (i + j) % 2, "patient_id": f"p{i}"}
        for i in range(people)
        for j in range(per_person)
    ]


def test_a_user_run_in_simulation_samples_people_and_every_record_says_user(tiny_bert, tmp_path):
    site = _site(_run(tiny_bert, **{"privacy-unit": "user"}), tmp_path)
    rows = site_examples(site.run, site.site, user_field="patient_id")
    people = Counter(r["user"] for r in rows)
    assert site.num_units == len(people) < len(rows)  # N counts people, not notes
    assert site.sample_rate == pytest.approx(8 / len(people), rel=1e-12)  # q = b_u / N_users
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.status == STATUS_OK
    assert reply.accounting.unit == "user"
    assert reply.accounting.q == pytest.approx(8 / len(people), rel=1e-12)
    assert [e.unit for e in site.ledger.entries()] == ["user"]


def test_a_user_site_runs_per_person_when_the_run_asks_for_records(tiny_bert, tmp_path):
    rows = _notes()
    node = _deployed(
        tmp_path,
        rows,
        **{"privacy-unit": "user", "user-field": "patient_id", "share-num-examples": True},
    )
    site = Site(_run(tiny_bert), node, site_policy(node))  # the run asks for record
    assert site.num_units == 24
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.status == STATUS_OK
    assert reply.accounting.unit == "user"
    # N is in the site's unit: its people, as b / q says (the coordinator checks the two agree)
    assert reply.accounting.num_examples == 24
    assert 8 / reply.accounting.q == pytest.approx(24, rel=1e-12)
    assert site.ledger.entries()[0].event.unit == "user"


def test_a_record_site_refuses_a_user_run_with_a_code_and_charges_nothing(tiny_bert, tmp_path):
    node = _deployed(tmp_path, _notes(), **{"privacy-unit": "record"})
    site = Site(_run(tiny_bert, **{"privacy-unit": "user"}), node, site_policy(node))
    ledger = site.ledger.path
    before = ledger.read_bytes() if ledger.exists() else None
    reply = site.train_round(1, {})
    assert reply.accounting.status == STATUS_REFUSED
    assert reply.accounting.reason == "user-level-not-configured"
    assert "user-level-not-configured" in REFUSAL_REASONS
    assert reply.accounting.unit == "record"
    assert reply.arrays == {}
    assert (ledger.read_bytes() if ledger.exists() else None) == before


def test_a_deployed_site_without_a_unit_is_per_record_and_refuses_a_user_run(tiny_bert, tmp_path):
    node = _deployed(tmp_path, _notes())
    site = Site(_run(tiny_bert, **{"privacy-unit": "user"}), node, site_policy(node))
    assert site.refusal == "user-level-not-configured"


def test_a_deployed_user_site_must_name_its_person_field(tmp_path):
    node = _deployed(tmp_path, _notes(), **{"privacy-unit": "user"})
    with pytest.raises(ConfigError, match="user-field"):
        site_policy(node)


def test_rows_without_the_person_field_are_refused_by_row_number(tiny_bert, tmp_path):
    rows = _notes()
    del rows[4]["patient_id"]
    rows[7]["patient_id"] = ""
    node = _deployed(tmp_path, rows, **{"privacy-unit": "user", "user-field": "patient_id"})
    with pytest.raises(DataError) as err:
        Site(_run(tiny_bert), node, site_policy(node))
    message = str(err.value)
    assert "5" in message and "8" in message  # lines 5 and 8 of the file
    assert "note 1 of patient 1" not in message  # no values quoted


def test_record_events_count_per_person_by_group_privacy_after_a_switch(tiny_bert, tmp_path):
    rows = _notes(people=20, per_person=1) + _notes(people=4, per_person=5)[::1]
    for r in rows[20:]:
        r["patient_id"] = "big-" + r["patient_id"]
    record_node = _deployed(tmp_path, rows, **{"privacy-unit": "record"})
    run = _run(tiny_bert, **{"noise-multiplier": 4.0})
    record_site = Site(run, record_node, site_policy(record_node))
    record_site.train_round(1, to_arrays(record_site.loaded))
    record_events = record_site.ledger.events()
    assert [e.unit for e in record_events] == ["record"]

    user_node = _deployed(tmp_path, rows, **{"privacy-unit": "user", "user-field": "patient_id"})
    user_site = Site(run, user_node, site_policy(user_node))
    assert user_site.ledger.group_size == 5  # the site's largest records per person
    reply = user_site.train_round(2, to_arrays(user_site.loaded))
    assert reply.accounting.status == STATUS_OK and reply.accounting.unit == "user"
    events = user_site.ledger.events()
    assert [e.unit for e in events] == ["record", "user"]
    expected = epsilon(events, 1e-5, group_size=5)
    assert reply.accounting.epsilon == pytest.approx(expected, rel=1e-9)
    # never below the per-record epsilon times the group (the conversion is conservative)
    assert expected > 5 * epsilon(record_events, 1e-5)


@pytest.mark.parametrize(
    ("unit", "request_", "code"),
    [
        # 24 patients with 3 notes each: N = 24 per patient, 72 per record
        ("user", {"batch-size": 30}, "batch-above-site-data"),  # 24 < b <= 72
        ("record", {"batch-size": 30}, None),
        ("user", {"batch-size": 24}, None),
        ("user", {"delta": 0.045}, "delta-not-below-1/n"),  # 1/24 <= delta
        ("user", {"delta": 1 / 24}, "delta-not-below-1/n"),
        ("user", {"delta": 0.02}, None),  # 1/72 <= delta < 1/24: below 1/N for N people
        ("record", {"delta": 0.02}, "delta-not-below-1/n"),
    ],
)
def test_a_person_level_sites_delta_and_batch_count_people(
    unit, request_, code, tiny_bert, tmp_path
):
    """At the person level N is the number of PEOPLE (24), not of records (72): a batch between
    the two is refused (q = b / N_people would pass 1), a delta at or above 1/24 is refused, and
    a delta in [1/72, 1/24) is below 1/N for people (a record-level site refuses it)."""
    node = {"privacy-unit": unit, "delta": 0.05}
    if unit == "user":
        node["user-field"] = "patient_id"
    config = _deployed(tmp_path, _notes(people=24, per_person=3), **node)
    site = Site(_run(tiny_bert, **request_), config, site_policy(config))
    assert site.num_units == (24 if unit == "user" else 72)
    assert site.refusal == code
    assert code is None or code in REFUSAL_REASONS


def test_a_sites_own_bound_on_records_per_person_caps_the_runs(tiny_bert, tmp_path):
    """The run asks for 50 records per sampled person; a deployed site that sets none takes
    at most the default 4, one that sets 2 takes 2: the coordinator never raises k."""
    for own, k in ((None, 4), (2, 2)):
        node = {"privacy-unit": "user", "user-field": "patient_id"}
        if own is not None:
            node["max-records-per-user"] = own
        (tmp_path / str(own)).mkdir()
        config = _deployed(tmp_path / str(own), _notes(), **node)
        site = Site(_run(tiny_bert, **{"max-records-per-user": 50}), config, site_policy(config))
        assert site.trainer.config.max_records_per_user == k
        assert site.trainer._loader.batch_sampler.max_records == k


def test_a_patient_with_40_records_after_record_rounds_is_refused_not_an_error(tiny_bert, tmp_path):
    """Record-level rounds at sigma 1, then the site turns per person with a patient holding 40
    records: group privacy gives no finite epsilon per person (prism_core.accounting), so the
    site refuses the round with its cap code and charges nothing; no OverflowError."""
    rows = _notes(people=20, per_person=1) + _notes(people=1, per_person=40)
    for r in rows[20:]:
        r["patient_id"] = "many-notes"
    record_node = _deployed(tmp_path, rows, **{"privacy-unit": "record"})
    run = _run(tiny_bert, **{"noise-multiplier": 1.0})
    record_site = Site(run, record_node, site_policy(record_node))
    assert record_site.train_round(1, to_arrays(record_site.loaded)).accounting.status == (
        STATUS_OK
    )
    user_node = _deployed(tmp_path, rows, **{"privacy-unit": "user", "user-field": "patient_id"})
    user_site = Site(run, user_node, site_policy(user_node))
    assert user_site.ledger.group_size == 40
    before = user_site.ledger.path.read_bytes()
    reply = user_site.train_round(2, to_arrays(user_site.loaded))
    assert reply.accounting.status == STATUS_REFUSED
    assert reply.accounting.reason == "cap-exhausted" and "cap-exhausted" in REFUSAL_REASONS
    assert user_site.ledger.path.read_bytes() == before


def test_a_person_level_ledger_never_goes_back_to_records(tiny_bert, tmp_path):
    rows = _notes()
    user_node = _deployed(tmp_path, rows, **{"privacy-unit": "user", "user-field": "patient_id"})
    user_site = Site(_run(tiny_bert), user_node, site_policy(user_node))
    user_site.train_round(1, to_arrays(user_site.loaded))
    before = user_site.ledger.path.read_bytes()
    record_node = _deployed(tmp_path, rows, **{"privacy-unit": "record"})
    with pytest.raises(ConfigError, match="never weakens"):
        Site(_run(tiny_bert), record_node, site_policy(record_node))
    assert user_site.ledger.path.read_bytes() == before


def test_a_person_is_never_split_across_simulated_sites(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [
        {"text": f"t{i}-{j}", "label": (i // 3) % 2, "patient_id": f"p{i}"}
        for i in range(60)
        for j in range(1 + i % 7)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for partitioner in ("iid", "dirichlet"):
        run = parse_config(
            RunConfig,
            {
                "data": str(data),
                "privacy-unit": "user",
                "partitioner": partitioner,
                "batch-size": 4,
                "num-labels": 2,
            },
            what="run config",
        )
        owners: dict[str, set[int]] = {}
        total = 0
        for part in range(4):
            node = parse_config(
                SiteConfig, {"partition-id": part, "num-partitions": 4}, what="node config"
            )
            site_rows = site_examples(run, node, user_field="patient_id")
            total += len(site_rows)
            for r in site_rows:
                owners.setdefault(r["user"], set()).add(part)
        assert total == len(rows)
        assert len(owners) == 60
        assert all(len(parts) == 1 for parts in owners.values()), partitioner


def test_the_clip_estimate_counts_people_at_the_person_level(tiny_bert, tmp_path):
    run = _run(
        tiny_bert,
        **{"privacy-unit": "user", "max-norm": "auto", "clip-quantile-steps": 2},
    )
    site = _site(run, tmp_path)
    reply = site.train_round(1, to_arrays(site.loaded))
    assert reply.accounting.status == STATUS_OK
    units = [e.event.unit for e in site.ledger.entries()]
    assert units == ["user", "user"]  # the quantile event, then the steps
    assert isinstance(site.ledger.entries()[0].event, PrivacyEvent)
