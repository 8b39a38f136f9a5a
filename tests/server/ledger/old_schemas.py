"""Test helper: ledger files of older schema versions, written with the CREATE statements
prism-fl used then: schema 1 (before unconfirmed charges), schema 2 (before a round
could hold a private clip estimate beside its training), schema 3 (before the privacy unit) and
schema 4 (before secure aggregation's honest sites and share sigma). ``v1_ledger`` to
``v4_ledger`` write one holding ``V1_ROWS`` to ``V4_ROWS``; ``v1_view`` to ``v4_view`` read a
ledger's events back in those rows' form."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from server.ledger import LEDGER_APPLICATION_ID, Ledger

V1_SCHEMA = f"""
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY CHECK (length(run_id) > 0),
    started_at TEXT NOT NULL,
    config_json TEXT NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL CHECK (length(run_id) > 0),
    round INTEGER NOT NULL CHECK (round >= 0),
    site_id TEXT NOT NULL CHECK (length(site_id) > 0),
    mechanism TEXT NOT NULL CHECK (length(mechanism) > 0),
    adjacency TEXT NOT NULL CHECK (length(adjacency) > 0),
    sampling TEXT NOT NULL CHECK (length(sampling) > 0),
    sigma REAL NOT NULL CHECK (sigma >= 0),
    q REAL NOT NULL CHECK (q > 0 AND q <= 1),
    steps INTEGER NOT NULL CHECK (steps >= 0),
    delta REAL NOT NULL CHECK (delta > 0 AND delta < 1),
    epsilon_cap REAL CHECK (epsilon_cap IS NULL OR epsilon_cap > 0),
    recorded_at TEXT NOT NULL,
    UNIQUE (run_id, round, site_id)
);
CREATE INDEX events_by_site ON events (site_id, id);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, DELETE refused'); END;
CREATE TRIGGER runs_no_update BEFORE UPDATE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, UPDATE refused'); END;
CREATE TRIGGER runs_no_delete BEFORE DELETE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, DELETE refused'); END;
CREATE TRIGGER meta_no_update BEFORE UPDATE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, UPDATE refused'); END;
CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, DELETE refused'); END;
PRAGMA application_id = {LEDGER_APPLICATION_ID};
PRAGMA user_version = 1;
"""
"""The schema-1 CREATE statements, as prism-fl wrote them before unconfirmed charges."""
V1_ROWS = [
    # run, round, site, mechanism, sigma, q, steps, delta, cap
    ("run-0", 1, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1e-5, 8.0),
    ("run-0", 1, "b", "prism-tangent-gaussian", 0.9, 0.02, 100, 1e-6, None),
    ("run-0", 2, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1e-5, 8.0),
    ("run-0", 3, "a", "prism-tangent-gaussian", 1.0, 0.01, 0, 1e-5, 8.0),
]


def v1_ledger(path: Path, rows: list[tuple[object, ...]] = V1_ROWS) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "1"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute(
        "INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{\"rounds\": 3}')"
    )
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at) "
        "VALUES (?, ?, ?, ?, 'add-remove', 'poisson', ?, ?, ?, ?, ?, '2026-01-01T00:00:01')",
        rows,
    )
    conn.commit()
    conn.close()


def v1_view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, e.delta, e.epsilon_cap)
        for e in ledger.events()
    ]


V2_SCHEMA = f"""
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY CHECK (length(run_id) > 0),
    started_at TEXT NOT NULL,
    config_json TEXT NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL CHECK (length(run_id) > 0),
    round INTEGER NOT NULL CHECK (round >= 0),
    site_id TEXT NOT NULL CHECK (length(site_id) > 0),
    mechanism TEXT NOT NULL CHECK (length(mechanism) > 0),
    adjacency TEXT NOT NULL CHECK (length(adjacency) > 0),
    sampling TEXT NOT NULL CHECK (length(sampling) > 0),
    sigma REAL NOT NULL CHECK (sigma >= 0),
    q REAL NOT NULL CHECK (q > 0 AND q <= 1),
    steps INTEGER NOT NULL CHECK (steps >= 0),
    delta REAL NOT NULL CHECK (delta > 0 AND delta < 1),
    epsilon_cap REAL CHECK (epsilon_cap IS NULL OR epsilon_cap > 0),
    recorded_at TEXT NOT NULL,
    confirmed INTEGER NOT NULL DEFAULT 1 CHECK (confirmed IN (0, 1)),
    params_known INTEGER NOT NULL DEFAULT 1 CHECK (params_known IN (0, 1)),
    rng TEXT CHECK (rng IS NULL OR length(rng) > 0),
    code TEXT NOT NULL DEFAULT '',
    CHECK (confirmed = 0 OR (params_known = 1 AND code = '')),
    CHECK (params_known = 1 OR (sigma = 0 AND q = 1)),
    UNIQUE (run_id, round, site_id, confirmed)
);
CREATE INDEX events_by_site ON events (site_id, id);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, UPDATE refused'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: events are append-only, DELETE refused'); END;
CREATE TRIGGER runs_no_update BEFORE UPDATE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, UPDATE refused'); END;
CREATE TRIGGER runs_no_delete BEFORE DELETE ON runs
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: runs are append-only, DELETE refused'); END;
CREATE TRIGGER meta_no_update BEFORE UPDATE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, UPDATE refused'); END;
CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'prism-fl ledger: meta is read-only, DELETE refused'); END;
PRAGMA application_id = {LEDGER_APPLICATION_ID};
PRAGMA user_version = 2;
"""
"""The schema-2 CREATE statements, as prism-fl wrote them before the private clip estimate."""
V2_ROWS = [
    # run, round, site, sigma, q, steps, confirmed, params_known, rng, code
    ("run-0", 1, "a", 1.0, 0.01, 100, 1, 1, "os-csprng", ""),
    ("run-0", 1, "b", 0.9, 0.02, 100, 1, 1, "reproducible", ""),
    ("run-0", 2, "a", 1.0, 0.01, 100, 0, 1, "os-csprng", "no-reply"),
    ("run-0", 2, "b", 0.0, 1.0, 100, 0, 0, None, "error-reply-4003"),
    ("run-0", 2, "a", 1.0, 0.01, 100, 1, 1, "os-csprng", ""),
]


def v2_ledger(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V2_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "2"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute("INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{}')")
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at, confirmed, params_known, rng, code) VALUES "
        "(?, ?, ?, 'prism-tangent-gaussian', 'add-remove', 'poisson', ?, ?, ?, 1e-5, 8.0, "
        "'2026-01-01T00:00:01', ?, ?, ?, ?)",
        V2_ROWS,
    )
    conn.commit()
    conn.close()


def v2_view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.sigma, e.q, e.steps, int(e.confirmed),
         int(e.params_known), e.rng, e.code)
        for e in ledger.records()
    ]  # fmt: skip


V3_SCHEMA = V2_SCHEMA.replace(
    "UNIQUE (run_id, round, site_id, confirmed)",
    "UNIQUE (run_id, round, site_id, mechanism, confirmed)",
).replace("PRAGMA user_version = 2;", "PRAGMA user_version = 3;")
"""The schema-3 CREATE statements, as prism-fl wrote them before the privacy unit: schema 2's
with the mechanism in the UNIQUE key."""
V3_ROWS = [
    # run, round, site, mechanism, sigma, q, steps, confirmed, params_known, rng, code
    ("run-0", 1, "a", "quantile-gaussian", 6.4, 0.01, 30, 1, 1, "os-csprng", ""),
    ("run-0", 1, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1, 1, "os-csprng", ""),
    ("run-0", 1, "b", "prism-tangent-gaussian", 0.9, 0.02, 100, 1, 1, "reproducible", ""),
    ("run-0", 2, "b", "prism-tangent-gaussian", 0.9, 0.02, 100, 0, 1, "reproducible", "no-reply"),
]


def v3_ledger(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V3_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "3"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute("INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{}')")
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at, confirmed, params_known, rng, code) VALUES "
        "(?, ?, ?, ?, 'add-remove', 'poisson', ?, ?, ?, 1e-5, 8.0, '2026-01-01T00:00:01', ?, ?, "
        "?, ?)",
        V3_ROWS,
    )
    conn.commit()
    conn.close()


def v3_view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, int(e.confirmed),
         int(e.params_known), e.rng, e.code)
        for e in ledger.records()
    ]  # fmt: skip


V4_SCHEMA = V3_SCHEMA.replace(
    "    code TEXT NOT NULL DEFAULT '',\n",
    "    code TEXT NOT NULL DEFAULT '',\n"
    "    unit TEXT NOT NULL DEFAULT 'record' CHECK (length(unit) > 0),\n",
).replace("PRAGMA user_version = 3;", "PRAGMA user_version = 4;")
"""The schema-4 CREATE statements, as prism-fl wrote them before secure aggregation: schema 3's
with the privacy unit."""
V4_ROWS = [
    # run, round, site, mechanism, sigma, q, steps, confirmed, params_known, rng, code, unit
    ("run-0", 1, "a", "quantile-gaussian", 6.4, 0.01, 30, 1, 1, "os-csprng", "", "user"),
    ("run-0", 1, "a", "prism-tangent-gaussian", 1.0, 0.01, 100, 1, 1, "os-csprng", "", "user"),
    ("run-0", 1, "b", "prism-tangent-gaussian", 0.9, 0.02, 100, 1, 1, "os-csprng", "", "record"),
    ("run-0", 2, "b", "prism-tangent-gaussian", 0.0, 1.0, 100, 0, 0, None, "no-reply", "record"),
]


def v4_ledger(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V4_SCHEMA)
    conn.executemany(
        "INSERT INTO meta (key, value) VALUES (?, ?)",
        [
            ("application", "prism-fl-ledger"),
            ("schema_version", "4"),
            ("created_at", "2026-01-01T00:00:00+00:00"),
        ],
    )
    conn.execute("INSERT INTO runs VALUES ('run-0', '2026-01-01T00:00:00+00:00', '{}')")
    conn.executemany(
        "INSERT INTO events (run_id, round, site_id, mechanism, adjacency, sampling, sigma, q, "
        "steps, delta, epsilon_cap, recorded_at, confirmed, params_known, rng, code, unit) VALUES "
        "(?, ?, ?, ?, 'add-remove', 'poisson', ?, ?, ?, 1e-5, 8.0, '2026-01-01T00:00:01', ?, ?, "
        "?, ?, ?)",
        V4_ROWS,
    )
    conn.commit()
    conn.close()


def v4_view(ledger: Ledger) -> list[tuple[object, ...]]:
    return [
        (e.run_id, e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, int(e.confirmed),
         int(e.params_known), e.rng, e.code, e.unit)
        for e in ledger.records()
    ]  # fmt: skip
