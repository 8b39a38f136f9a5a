"""Crash-safe coordinator through real Flower processes: SIGKILL the ServerApp process repeatedly.

A real ``flower-superlink`` and two ``flower-supernode`` processes on loopback; the SuperLink
runs the ServerApp in its own ``flwr-serverapp`` process. The test picks 6 random kill points
(named pause points, ``prism_runtime.faults``, at a round; always including mid-aggregation and
mid-ledger-write), SIGKILLs that process at each, starts ``flwr run`` again with the same
run-dir, and finally checks the run against an uninterrupted run of the same configuration
(the loopback driver of ``tests/server/resume_driver.py``, same sites, and the sites in their
reproducible mode with the same secret, ``PRISM_FL_RNG_SECRET``; it runs while the Flower
processes do): the same ledger events (none lost, none twice), the same epsilon per site, and
a bitwise-identical global adapter.

The kill schedule is drawn from the ``crash_seed`` fixture (``tests/conftest.py``): replay one
with ``PRISM_CRASH_SEED=<seed>``, which every run prints.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from flower_harness import (
    BIN,
    ROOT,
    flower_env,
    free_port,
    insecure_superlink,
    insecure_supernode,
    port_open,
    processes,
    wait_for,
    write_connection,
)

from server.checkpoint import load_checkpoint
from server.ledger import Ledger

ROUNDS, SITES, KILLS = 2, 2, 6
SECRET = "resume-e2e"  # the sites' reproducible-mode secret
POINTS = (
    "round-start",
    "ledger-write",
    "mid-aggregation",
    "before-checkpoint",
    "mid-checkpoint",
    "after-checkpoint",
)


def _config(model: str, run_dir: Path) -> dict[str, object]:
    return {
        "model": model,
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "local-steps": 2,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "noise-multiplier": 4.0,
        "target-epsilon": 2.0,
        "sites-per-round": SITES,
        "min-sites": SITES,
        "round-timeout": 600.0,  # a ceiling for a loaded machine; no round waits for it
        "run-dir": str(run_dir),
    }


def _flwr_config(config: dict[str, object]) -> str:
    return " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in config.items())


def _schedule(rng: random.Random, kills: int = KILLS) -> list[tuple[int, str]]:
    """``kills`` distinct (round, point) pairs in execution order, incl. the two required."""
    pairs = [(r, p) for r in range(1, ROUNDS + 1) for p in POINTS]
    required = [
        (rng.randint(1, ROUNDS), "mid-aggregation"),
        (rng.randint(1, ROUNDS), "ledger-write"),
    ]
    others = rng.sample([x for x in pairs if x not in required], kills - len(required))
    return sorted({*required, *others}, key=lambda x: (x[0], POINTS.index(x[1])))


def _outcome(run_dir: Path) -> dict[str, object]:
    ckpt = load_checkpoint(run_dir)
    assert ckpt is not None
    with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
        events = sorted(
            (e.round, e.site_id, e.mechanism, e.sigma, e.q, e.steps, e.delta, e.epsilon_cap)
            for e in ledger.events()
        )
        eps = {s: ledger.epsilon(s).prv for s in ledger.sites()}
    return {"round": ckpt.server_round, "arrays": ckpt.arrays, "events": events, "epsilon": eps}


def _reference(model: str, run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start the uninterrupted reference run: same sites (partitions) and seeds, loopback."""
    driver = ROOT / "tests" / "server" / "resume_driver.py"
    # Sites in reproducible mode (a secret each site process holds; never sent): the only way
    # two runs can be compared bitwise. By default a site's randomness comes from the OS.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PRISM_FL_RNG_SECRET=SECRET)
    env.pop("PRISM_FL_PAUSE_AT", None)
    with log.open("wb") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(
            [sys.executable, str(driver), json.dumps(_config(model, run_dir)), str(SITES)],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_serverapp_sigkilled_at_random_points_resumes_bitwise(tiny_bert, tmp_path, crash_seed):
    schedule = _schedule(random.Random(crash_seed))
    note = f"kill schedule {schedule} (PRISM_CRASH_SEED={crash_seed})"
    print(note)
    reference_dir, reference_log = tmp_path / "reference", tmp_path / "reference.log"
    reference = _reference(tiny_bert, reference_dir, reference_log)
    try:
        _killed_and_resumed(tiny_bert, tmp_path, schedule, note)
        reference.wait(timeout=900)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, reference_log.read_text(errors="replace")[-5000:]
    expected = _outcome(reference_dir)

    got = _outcome(tmp_path / "run")
    assert got["round"] == ROUNDS, note
    assert len(got["events"]) == ROUNDS * SITES, note  # none lost; UNIQUE makes none twice
    assert got["events"] == expected["events"], note
    assert got["epsilon"] == expected["epsilon"], note
    for name, tensor in expected["arrays"].items():  # type: ignore[attr-defined]
        assert got["arrays"][name].equal(tensor), f"{note}: {name}"  # type: ignore[index]


def _killed_and_resumed(
    model: str, tmp_path: Path, schedule: list[tuple[int, str]], note: str
) -> None:
    """Run the federation through real Flower processes, SIGKILLing its ServerApp process at
    every (round, point) of ``schedule``, then let ``flwr run`` finish it."""
    home, run_dir = tmp_path / "flwr", tmp_path / "run"
    control, pause = tmp_path / "pause-at.txt", tmp_path / "paused.json"
    # Same torch thread count as the reference: multi-threaded GEMMs split their reductions by
    # thread count, so float results are bitwise equal only between runs with equal threads.
    env = dict(flower_env(home), OMP_NUM_THREADS="1", PRISM_FL_RNG_SECRET=SECRET)
    port = free_port()
    write_connection(home, "loopback", f"127.0.0.1:{port}")
    link_env = dict(env, PRISM_FL_PAUSE_AT=f"file:{control}", PRISM_FL_PAUSE_FILE=str(pause))
    config = _flwr_config(_config(model, run_dir))
    with processes(env, tmp_path / "logs") as group:
        group.env = link_env  # only the SuperLink (and the ServerApps it starts) see the hook
        group.start(
            "superlink",
            insecure_superlink(port, tmp_path / "superlink.db"),
        )
        group.env = env
        wait_for(lambda: port_open(port), 60, "the SuperLink port")
        for i in range(SITES):
            node = (
                f"partition-id={i} num-partitions={SITES} "
                f"state-dir='{run_dir / 'sites' / f'site-{i}'}'"
            )
            group.start(
                f"site-{i}",
                insecure_supernode(port, node),
            )
        command = [
            str(BIN / "flwr"),
            "run",
            str(ROOT),
            "loopback",
            "--stream",
            "--run-config",
            config,
        ]
        for n, (server_round, point) in enumerate(schedule):
            control.write_text(f"{point}@{server_round}")
            pause.unlink(missing_ok=True)
            runner = group.start(f"flwr-run-{n}", command)
            wait_for(
                lambda runner=runner: pause.exists() or runner.poll() is not None,
                600,
                f"{point}@{server_round}",
            )
            assert pause.exists(), f"{note}: run ended before {point}@{server_round}\n" + (
                group.log(f"flwr-run-{n}")[-3000:] + group.log("superlink")[-3000:]
            )
            pid = json.loads(pause.read_text())["pid"]
            assert pid != runner.pid
            os.kill(pid, signal.SIGKILL)  # the process running the ServerApp
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid), 30, "kill")
            group.stop(runner)  # `flwr run --stream` of the killed run
        control.write_text("")
        final = group.start("flwr-run-final", command)
        wait_for(lambda: final.poll() is not None, 900, "the resumed run")
        log = group.log("flwr-run-final")
        assert final.returncode == 0, note + log[-3000:] + group.log("superlink")[-3000:]
        wait_for(lambda: (run_dir / "summary.json").exists(), 120, "the run's summary")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
