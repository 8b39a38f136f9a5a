"""The site's own privacy ledger: durable creation, torn last lines, damage that stops a site."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

import client.site_ledger as site_ledger_module
from client.site_ledger import SiteLedger, SiteLedgerEntry
from prism_core.records import SKELLAM_MECHANISM, PrivacyEvent, SkellamShare
from prism_runtime.errors import ConfigError


def _entry(round_: int, steps: int = 5) -> SiteLedgerEntry:
    return SiteLedgerEntry(round_, PrivacyEvent(1.1, 0.05, steps), 1e-5)


def _line(entry: SiteLedgerEntry) -> bytes:
    return (json.dumps(entry.to_json(), sort_keys=True) + "\n").encode()


def _valid_file(tmp_path, rounds=(1, 2)):
    ledger = SiteLedger(tmp_path)
    for r in rounds:
        ledger.charge(_entry(r))
    return ledger.path, ledger.path.read_bytes()


def test_entries_survive_a_restart(tmp_path):
    _, data = _valid_file(tmp_path)
    assert data == _line(_entry(1)) + _line(_entry(2))
    assert SiteLedger(tmp_path).entries() == [_entry(1), _entry(2)]


def test_a_torn_last_line_is_dropped_with_a_warning_and_truncated_by_the_next_charge(
    tmp_path, caplog
):
    path, data = _valid_file(tmp_path)
    torn = _line(_entry(3))[:25]  # power loss in the middle of the third charge
    path.write_bytes(data + torn)
    with caplog.at_level(logging.WARNING, logger="client.site_ledger"):
        ledger = SiteLedger(tmp_path)
    assert ledger.entries() == [_entry(1), _entry(2)]
    assert "incomplete charge" in caplog.text and str(path) in caplog.text
    assert path.read_bytes() == data + torn  # reading never modifies the file
    ledger.charge(_entry(3, steps=7))
    assert path.read_bytes() == data + _line(_entry(3, steps=7))
    assert SiteLedger(tmp_path).entries() == [_entry(1), _entry(2), _entry(3, steps=7)]


@pytest.mark.parametrize("tail", [b"\x00\x00\x00\x00", b"   ", b'{"delta": 1e-05, "mech'])
def test_other_torn_tails_are_dropped_too(tmp_path, tail):
    path, data = _valid_file(tmp_path)
    path.write_bytes(data + tail)
    ledger = SiteLedger(tmp_path)
    assert ledger.entries() == [_entry(1), _entry(2)]
    ledger.charge(_entry(3))
    assert path.read_bytes() == data + _line(_entry(3))


def test_a_crash_at_any_byte_of_a_charge_leaves_a_ledger_that_starts_and_charges(tmp_path):
    """Cut the file after every byte of the last entry: the site starts with the entries whose
    JSON is complete, and the next charge leaves exactly those entries plus the new one."""
    path, data = _valid_file(tmp_path, rounds=(1, 2, 3))
    first_two = len(_line(_entry(1)) + _line(_entry(2)))
    for cut in range(first_two, len(data) + 1):
        path.write_bytes(data[:cut])
        complete = cut >= len(data) - 1  # the JSON of entry 3 is whole (newline optional)
        kept = [_entry(1), _entry(2)] + ([_entry(3)] if complete else [])
        ledger = SiteLedger(tmp_path)
        assert ledger.entries() == kept, cut
        ledger.charge(_entry(9))
        assert path.read_bytes() == b"".join(_line(e) for e in [*kept, _entry(9)]), cut
        assert SiteLedger(tmp_path).entries() == [*kept, _entry(9)]


def _assert_refused_unchanged(tmp_path, path, content: bytes, line: int, what: str) -> None:
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        SiteLedger(tmp_path)
    message = str(info.value)
    assert str(path) in message and f"line {line}" in message and what in message
    assert "Restore it from a backup" in message
    assert path.read_bytes() == content


def test_a_corrupt_middle_line_stops_the_site_and_leaves_the_file_unchanged(tmp_path):
    path, _ = _valid_file(tmp_path, rounds=(1, 2, 3))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:20] + b"\n"  # a bad line before the last one is never a torn write
    _assert_refused_unchanged(tmp_path, path, b"".join(lines), 2, "not a JSON line")


def test_a_bad_last_line_that_ends_in_a_newline_stops_the_site(tmp_path):
    path, data = _valid_file(tmp_path)
    _assert_refused_unchanged(tmp_path, path, data + b"{garbage\n", 3, "not a JSON line")


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"sigma": "1.1"}, "sigma='1.1' is not of type"),
        ({"steps": True}, "steps=True is not of type"),
        ({"q": 1.5}, "q=1.5 must be in (0, 1]"),
        ({"delta": 0.0}, "delta=0.0 must be in (0, 1)"),
        ({"extra": 1}, "unknown fields ['extra']"),
        ({"sigma": None}, "sigma=None is not of type"),
        ({"mechanism": " "}, "mechanism=' ' must be a non-empty string"),  # the event refuses it
        ({"unit": "household"}, "unit='household' must be one of ['record', 'user']"),
        ({"unit": 1}, "unit=1 is not of type str"),
    ],
)
def test_wrong_fields_stop_the_site(tmp_path, change, what):
    path, data = _valid_file(tmp_path)
    bad = json.dumps({**_entry(3).to_json(), **change}, sort_keys=True).encode()
    for content, line in ((data + bad + b"\n", 3), (data + bad, 3)):  # complete JSON: not torn
        _assert_refused_unchanged(tmp_path, path, content, line, what)


def test_a_missing_field_and_a_non_object_stop_the_site(tmp_path):
    path, data = _valid_file(tmp_path)
    partial = {k: v for k, v in _entry(3).to_json().items() if k != "delta"}
    content = data + json.dumps(partial).encode() + b"\n"
    _assert_refused_unchanged(tmp_path, path, content, 3, "missing fields ['delta']")
    _assert_refused_unchanged(tmp_path, path, b"[1, 2]\n" + data, 1, "expected a JSON object")


def test_a_charge_on_a_file_damaged_since_loading_refuses_and_writes_nothing(tmp_path):
    path, data = _valid_file(tmp_path)
    ledger = SiteLedger(tmp_path)
    damaged = b"{not json}\n" + data
    path.write_bytes(damaged)
    with pytest.raises(ConfigError, match="line 1"):
        ledger.charge(_entry(3))
    assert path.read_bytes() == damaged


def test_a_complete_last_entry_without_its_newline_is_kept_and_completed(tmp_path):
    path, data = _valid_file(tmp_path)
    path.write_bytes(data[:-1])
    ledger = SiteLedger(tmp_path)
    assert ledger.entries() == [_entry(1), _entry(2)]
    ledger.charge(_entry(3))
    assert path.read_bytes() == data + _line(_entry(3))


def _record_fsyncs(monkeypatch):
    """Record every real ``os.fsync``: (is a directory, inode) of the descriptor, in order."""
    calls = []
    real = os.fsync

    def spy(fd):
        info = os.fstat(fd)
        calls.append((stat.S_ISDIR(info.st_mode), info.st_ino))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_the_folder_is_fsynced_when_the_first_charge_creates_the_file(tmp_path, monkeypatch):
    state = tmp_path / "site-state"
    calls = _record_fsyncs(monkeypatch)
    ledger = SiteLedger(state)
    # the new state folder itself was made durable in its parent
    assert (True, tmp_path.stat().st_ino) in calls
    calls.clear()
    ledger.charge(_entry(1))
    file_sync = (False, ledger.path.stat().st_ino)
    dir_sync = (True, state.stat().st_ino)
    assert file_sync in calls and dir_sync in calls
    assert calls.index(file_sync) < calls.index(dir_sync)  # content durable, then the name
    calls.clear()
    ledger.charge(_entry(2))
    assert calls == [file_sync]  # appending to an existing file needs no folder fsync


def test_fsync_dir_is_called_on_create_only(tmp_path, monkeypatch):
    seen = []
    real = site_ledger_module.fsync_dir
    monkeypatch.setattr(site_ledger_module, "fsync_dir", lambda p: (seen.append(p), real(p)))
    ledger = SiteLedger(tmp_path)
    ledger.charge(_entry(1))
    ledger.charge(_entry(2))
    assert seen == [tmp_path]


# -- from mutation testing (docs/testing.md): what the site's accounting reads -----------------


def test_events_and_epsilon_come_from_every_charged_entry_with_steps(tmp_path):
    from prism_core.accounting import epsilon

    ledger = SiteLedger(tmp_path)
    ledger.charge(SiteLedgerEntry(1, PrivacyEvent(1.1, 0.05, 5), 1e-5))
    ledger.charge(SiteLedgerEntry(2, PrivacyEvent(0.9, 0.02, 0), 1e-5))  # no steps
    ledger.charge(SiteLedgerEntry(3, PrivacyEvent(2.0, 0.1, 1), 1e-5))
    # the entries are current right after each charge, without a reload
    assert [e.server_round for e in ledger.entries()] == [1, 2, 3]
    expected = [PrivacyEvent(1.1, 0.05, 5), PrivacyEvent(2.0, 0.1, 1)]
    assert ledger.events() == expected
    assert ledger.epsilon(1e-5) == pytest.approx(epsilon(expected, 1e-5), rel=1e-12)
    assert ledger.epsilon(1e-5) > epsilon(expected[:1], 1e-5) > 0  # every event counts


def test_reload_sees_a_charge_made_by_another_process_of_the_site(tmp_path):
    first, other = SiteLedger(tmp_path), SiteLedger(tmp_path)
    first.charge(_entry(1))
    other.charge(_entry(2))  # e.g. the next round's ClientApp process
    assert first.entries() == [_entry(1)]
    first.reload()
    assert first.entries() == [_entry(1), _entry(2)]


def test_a_blank_line_between_entries_loses_no_entry_after_it(tmp_path):
    path = tmp_path / SiteLedger.FILE
    path.write_bytes(_line(_entry(1)) + b"\n" + _line(_entry(2)))
    assert SiteLedger(tmp_path).entries() == [_entry(1), _entry(2)]


def test_a_damaged_line_names_every_problem_and_the_json_type_it_found(tmp_path):
    path, data = _valid_file(tmp_path)
    bad = b'{"extra": 1, ' + json.dumps(_entry(3).to_json() | {"q": 2.0})[1:].encode() + b"\n"
    _assert_refused_unchanged(tmp_path, path, data + bad, 3, "unknown fields ['extra']")
    with pytest.raises(ConfigError, match=r"q=2\.0 must be in \(0, 1\]"):
        SiteLedger(tmp_path)  # a field after the unknown one is still checked
    _assert_refused_unchanged(tmp_path, path, b'"text"\n' + data, 1, "found str")


def test_charging_over_a_torn_line_warns_with_the_file(tmp_path, caplog):
    path, data = _valid_file(tmp_path)
    path.write_bytes(data + b'{"delta": 1e-05, "mech')
    ledger = SiteLedger(tmp_path)
    with caplog.at_level(logging.WARNING, logger="client.site_ledger"):
        ledger.charge(_entry(3))
    assert f"{path}: removing the incomplete last line" in caplog.text


def test_every_entry_stores_its_unit_and_a_line_without_one_reads_as_a_record(tmp_path):
    """New lines carry the event's privacy unit; a line written without ``unit`` (the format
    before the unit) reads as a record-level event, and the file is left as it was."""
    user = SiteLedgerEntry(2, PrivacyEvent(1.1, 0.05, 5, unit="user"), 1e-5)
    old = {k: v for k, v in _entry(1).to_json().items() if k != "unit"}
    path = tmp_path / SiteLedger.FILE
    path.write_bytes(json.dumps(old, sort_keys=True).encode() + b"\n")
    ledger = SiteLedger(tmp_path)
    assert ledger.entries() == [_entry(1)] and ledger.entries()[0].unit == "record"
    ledger.charge(user)
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0]) == old  # the old line is kept byte for byte
    assert json.loads(lines[1])["unit"] == "user"
    assert [e.unit for e in SiteLedger(tmp_path).entries()] == ["record", "user"]
    assert _entry(3).to_json()["unit"] == "record"


def _secure(round_: int, honest: int = 3, share: float = 0.5) -> SiteLedgerEntry:
    event = PrivacyEvent(
        1.1, 0.05, 5, mechanism=SKELLAM_MECHANISM, secure=SkellamShare(honest, share)
    )
    return SiteLedgerEntry(round_, event, 1e-5)


def test_a_secure_entry_stores_its_honest_sites_and_share_sigma_and_old_lines_read_none(tmp_path):
    """A secure-aggregation charge's line carries ``honest_sites`` and ``share_sigma``; no other
    line does, and a line written without them (the format before secure aggregation) reads
    as an event without them; the file round-trips every entry."""
    old = {k: v for k, v in _entry(1).to_json().items() if k != "unit"}
    path = tmp_path / SiteLedger.FILE
    path.write_bytes(json.dumps(old, sort_keys=True).encode() + b"\n")
    ledger = SiteLedger(tmp_path)
    ledger.charge(_secure(2))
    ledger.charge(_entry(3))
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert lines[0] == old
    assert (lines[1]["honest_sites"], lines[1]["share_sigma"]) == (3, 0.5)
    assert "honest_sites" not in lines[2] and "share_sigma" not in lines[2]
    entries = SiteLedger(tmp_path).entries()
    assert entries == [_entry(1), _secure(2), _entry(3)]
    secure_fields = [(e.honest_sites, e.share_sigma) for e in entries]
    assert secure_fields == [(None, None), (3, 0.5), (None, None)]


def test_collusion_epsilon_composes_the_ledger_at_the_secure_shares(tmp_path):
    """``collusion_epsilon`` is ``prism_core.accounting.collusion_epsilon`` of the ledger's
    events with the ledger's group size, at least the charged ``epsilon``."""
    from prism_core.accounting import collusion_epsilon, epsilon

    ledger = SiteLedger(tmp_path)
    ledger.charge(_entry(1))
    ledger.charge(_secure(2, share=0.6))
    events = ledger.events()
    expected = collusion_epsilon(events, 1e-5)
    assert ledger.collusion_epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    assert ledger.collusion_epsilon(1e-5) >= ledger.epsilon(1e-5) == epsilon(events, 1e-5)
    assert ledger.collusion_epsilon(1e-5, events[:1]) == pytest.approx(
        collusion_epsilon(events[:1], 1e-5), rel=1e-12
    )
    ledger.group_size = 3  # per person: the same group-size handling as epsilon
    assert ledger.collusion_epsilon(1e-5) == pytest.approx(
        collusion_epsilon(events, 1e-5, group_size=3), rel=1e-12
    )


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"honest_sites": 0}, "honest_sites=0 must be >= 1"),
        ({"honest_sites": 2.0}, "honest_sites=2.0 is not of type int"),
        ({"honest_sites": True}, "honest_sites=True is not of type int"),
        ({"share_sigma": -0.1}, "share_sigma=-0.1 must be >= 0"),
        ({"share_sigma": "0.5"}, "share_sigma='0.5' is not of type float"),
        ({"share_sigma": 1.2}, "share_sigma=1.2 must be a finite number in [0, noise_multiplier"),
        ({"honest_sites": None}, "honest_sites=None is not of type int"),
        ({"mechanism": "prism-tangent-gaussian"}, "only a 'prism-tangent-skellam' event has"),
    ],
)
def test_wrong_secure_fields_stop_the_site(tmp_path, change, what):
    path, data = _valid_file(tmp_path)
    bad = json.dumps({**_secure(3).to_json(), **change}, sort_keys=True).encode()
    _assert_refused_unchanged(tmp_path, path, data + bad + b"\n", 3, what)


def test_a_secure_line_without_its_fields_stops_the_site(tmp_path):
    path, data = _valid_file(tmp_path)
    line = {k: v for k, v in _secure(3).to_json().items() if k != "share_sigma"}
    content = data + json.dumps(line, sort_keys=True).encode() + b"\n"
    _assert_refused_unchanged(tmp_path, path, content, 3, "share_sigma=None must be a finite")
