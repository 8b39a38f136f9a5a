"""Run real Flower processes (SuperLink, SuperNodes, ``flwr run``) on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(home: Path) -> dict[str, str]:
    """An offline, telemetry-free environment with its own FLWR_HOME."""
    from server.demo import demo_env

    return demo_env(home)


def insecure_superlink(port: int, database: Path) -> list[str]:
    """argv of a plain-text loopback SuperLink that keeps its state in ``database``."""
    return [
        str(BIN / "flower-superlink"),
        "--insecure",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        str(database),
    ]


def insecure_supernode(superlink_port: int, node_config: str) -> list[str]:
    """argv of a plain-text loopback SuperNode on a free port with ``node_config``."""
    return [
        str(BIN / "flower-supernode"),
        "--insecure",
        "--superlink",
        f"127.0.0.1:{superlink_port}",
        "--port",
        str(free_port()),
        "--node-config",
        node_config,
    ]


def write_connection(home: Path, name: str, address: str, *, root_certificates: str = "") -> None:
    """Add a SuperLink connection to ``$FLWR_HOME/config.toml``."""
    home.mkdir(parents=True, exist_ok=True)
    lines = [
        "[superlink]",
        f'default = "{name}"',
        "",
        f"[superlink.{name}]",
        f'address = "{address}"',
    ]
    lines.append(
        f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    )
    (home / "config.toml").write_text("\n".join(lines) + "\n")


class Processes:
    """Start processes in their own process groups and stop every one of them."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            list(args),
            env=self.env if env is None else env,
            cwd=ROOT if cwd is None else cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            self.stop(proc)


@contextmanager
def processes(env: dict[str, str], logs: Path) -> Iterator[Processes]:
    group = Processes(env, logs)
    try:
        yield group
    finally:
        group.stop_all()


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def flwr_run(
    env: dict[str, str],
    federation: str,
    run_config: str,
    *,
    extra: Sequence[str] = (),
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``flwr run <repo> <federation> --stream`` and wait for it."""
    command = [
        str(BIN / "flwr"),
        "run",
        str(ROOT),
        federation,
        "--stream",
        "--run-config",
        run_config,
        *extra,
    ]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
