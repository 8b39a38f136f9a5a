"""``make demo``: a 3-site PRISM federation with Flower's simulation engine, then clean up.

Runs ``flwr run . local`` (the bundled MiniLM, the built-in synthetic task, a coordinator-owned
synthetic held-out set), waits for it, stops the local SuperLink that ``flwr run`` leaves running,
and prints where the adapter (or why there is none: no round was applied) and the budget report
are. Extra arguments are passed to ``--run-config`` (e.g. ``python -m server.demo "num-rounds=5
data='/path/train.jsonl' server-eval-data='/path/dev.jsonl'"``); a key the user gives replaces the
demo's own default for it (``run-dir``, ``server-eval-data``), since Flower refuses a run config
that names a key twice. The synthetic held-out set is the default only for the built-in task: with
the user's own ``data`` there is no server-side evaluation unless ``server-eval-data`` names a
held-out file of the same kind.

The three simulated sites use the simulation defaults of their policy (``client.policy``: cap
8.0, delta 1e-5, state in ``<run-dir>/sites/<site-id>``) and draw their randomness from the OS.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prism_runtime.config import SYNTHETIC
from server.report import UNIT_NAMES

__all__ = [
    "LOCAL_PORTS",
    "demo_env",
    "demo_run_config",
    "demo_summary",
    "main",
    "stop_local_superlinks",
]

ROOT = Path(__file__).resolve().parents[1]


LOCAL_PORTS = ("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT")
"""The environment variables that move ``flwr run . local``'s SuperLink off its fixed ports."""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that are free now (the OS picks them)."""
    holders = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in holders:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in holders]
    finally:
        for sock in holders:
            sock.close()


def demo_env(flwr_home: Path) -> dict[str, str]:
    """Environment for a local, offline Flower run that installs nothing at run time, with its
    own local SuperLink: on ports of its own (``LOCAL_PORTS``, unless set already), so a demo
    started while another runs (another checkout, another venv) starts its own SuperLink and
    simulation instead of submitting to the other one's."""
    env = dict(os.environ)
    for name, port in zip(LOCAL_PORTS, _free_ports(len(LOCAL_PORTS)), strict=True):
        env.setdefault(name, str(port))
    # Ray's socket paths must stay under 108 bytes: keep its folder short.
    ray_dir = Path(tempfile.gettempdir()) / f"pfl-ray-{os.getuid()}"
    ray_dir.mkdir(parents=True, exist_ok=True)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RAY_TMPDIR=str(ray_dir),
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
    )
    flwr_home.mkdir(parents=True, exist_ok=True)
    return env


def stop_local_superlinks(flwr_home: Path, *, grace: float = 15.0) -> list[int]:
    """Stop the SuperLinks that ``flwr run . local`` started with this ``FLWR_HOME``.

    Sends SIGTERM, waits up to ``grace`` seconds for each to exit, then SIGKILLs what is left,
    so that nothing is running when this returns. Returns the PIDs it stopped.
    """
    stopped = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(part.endswith(b"flower-superlink") for part in cmdline[:2]):
            continue
        if f"FLWR_HOME={flwr_home}".encode() in environ:
            os.kill(int(proc.name), signal.SIGTERM)
            stopped.append(int(proc.name))
    deadline = time.monotonic() + grace
    while (alive := [pid for pid in stopped if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return stopped


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _flwr_value(value: object) -> str:
    """One value in Flower's ``--run-config`` syntax (TOML scalars)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    return f"'{text}'" if "'" not in text else f'"{text}"'


def demo_run_config(extra: str, default_run_dir: Path) -> tuple[str, Path]:
    """The ``--run-config`` string of the demo and the run folder it writes to.

    The user's ``extra`` (``key=value`` pairs, Flower's syntax) wins over the demo's defaults
    (``run-dir``; ``server-eval-data='synthetic'`` and ``privacy-unit='user'``, one epsilon per
    patient, while ``data`` is the built-in task, whose notes have patients): each key
    appears once. A relative ``run-dir`` is made absolute from the repository root, so the demo
    finds its report.

    Raises:
        ValueError: ``extra`` is not Flower's ``key=value ...`` syntax.
    """
    from flwr.common.config import parse_config_args

    try:
        given = parse_config_args([extra]) if extra.strip() else {}
    except Exception as exc:  # Flower raises click's ClickException for a malformed string
        raise ValueError(str(getattr(exc, "message", exc))) from exc
    values: dict[str, object] = {"run-dir": str(default_run_dir)}
    if given.get("data", SYNTHETIC) == SYNTHETIC:  # the built-in task's own held-out draw
        values["server-eval-data"] = SYNTHETIC
        # the built-in notes have patients: one epsilon per patient with all their notes
        values["privacy-unit"] = "user"
    values.update(given)
    run_dir = Path(str(values["run-dir"]) or default_run_dir)
    values["run-dir"] = str(run_dir if run_dir.is_absolute() else ROOT / run_dir)
    config = " ".join(f"{k}={_flwr_value(v)}" for k, v in values.items())
    return config, Path(str(values["run-dir"]))


def main(argv: list[str] | None = None) -> int:
    """Run the demo federation; return the exit status of ``flwr run``."""
    extra = " ".join(sys.argv[1:] if argv is None else argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        run_config, run_dir = demo_run_config(extra, ROOT / "runs" / f"demo-{stamp}")
    except ValueError as exc:
        print(f"prism-fl demo: bad run config {extra!r}: {exc}", file=sys.stderr)
        return 2
    flwr_home = ROOT / ".flwr"
    env = demo_env(flwr_home)
    command = [
        str(Path(sys.executable).parent / "flwr"),
        "run",
        str(ROOT),
        "local",
        "--stream",
        "--run-config",
        run_config,
        "--federation-config",
        "num-supernodes=3 client-resources-num-cpus=1",
    ]
    try:
        status = subprocess.run(command, env=env, cwd=ROOT, check=False).returncode
    finally:
        stop_local_superlinks(flwr_home)
    report = run_dir / "report.json"
    if status != 0 or not report.exists():
        print(f"prism-fl demo: flwr run failed with status {status}", file=sys.stderr)
        return status or 1
    print(demo_summary(run_dir))
    return 0


def demo_summary(run_dir: Path) -> str:
    """What the demo prints when its run finished: each site's epsilon in its unit (per
    patient for the built-in task; under secure aggregation also the epsilon of its own noise
    share alone), the held-out accuracy before and after, the outputs."""
    sites = json.loads((run_dir / "report.json").read_text())["sites"]
    lines = ["", "prism-fl demo finished"]
    for row in sites:
        unit = UNIT_NAMES.get(row["unit"], row["unit"])
        line = (
            f"  {row['site_id']}: epsilon {row['epsilon']:.3f} per {unit} "
            f"of cap {row['epsilon_cap']} (delta {row['delta']})"
        )
        if row.get("epsilon_collusion") is not None:  # secure aggregation: both guarantees
            line += (
                f" if at least {row['honest_sites']} sites are honest; "
                f"{row['epsilon_collusion']:.3f} if every other site colludes with the "
                "coordinator"
            )
        lines.append(line)
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = summary.get("server-eval", {})
    if evals:
        first, last = evals[min(evals, key=int)], evals[max(evals, key=int)]
        before, after = first.get("accuracy", float("nan")), last.get("accuracy", float("nan"))
        lines.append(f"  held-out accuracy: {before:.3f} (start) -> {after:.3f} (end)")
    if summary.get("adapter"):
        lines.append(f"  adapter (peft format): {run_dir / summary['adapter']}")
    else:
        lines.append(f"  NO adapter: {summary.get('adapter-reason', 'no round was applied')}")
    lines.append(f"  budget report: {run_dir / 'report.html'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
