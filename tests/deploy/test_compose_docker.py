"""``docker-compose.yml`` on a REAL Docker Engine: ``make test-compose`` (marker ``docker``).

Not part of ``make test`` (CI has no engine). It needs a running engine with Compose v2 and the
image ``prism-fl:cpu`` built from this checkout (``make test-compose`` builds it first).

What runs, as a hospital IT team would run it (deploy/README.md, section 1), in a throw-away
compose project with its own volumes and a free host port:

1. ``docker compose up -d``: pki, the three key steps, the SuperLink (TLS + SuperNode
   authentication), register, three SuperNodes; the one-shots exit 0, the rest keep running.
2. ``flwr run . prism-compose`` from the host over TLS with the CA copied out of the SuperLink:
   a 1-round SECURE-AGGREGATION run finishes (the sites pin each other's published identity
   keys), the run folder lands in the bind-mounted ``runs/``, and the budget
   report shows each site's epsilon (within its request, and its cap).
3. A SuperNode container with a key the SuperLink never registered is refused
   (``Failed to activate SuperNode``).
4. ``docker compose down`` and ``up -d`` keep the budgets: the sites' ledgers survive on their
   volumes, ``register`` sends no key again (no ``already in use`` error at the SuperLink), and
   a second run that would take every site past its cap is refused by every site: no round
   applied, no adapter exported.

Everything is removed at the end (``docker compose down -v``, the extra container).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from flower_harness import ROOT, flower_env, flwr_run, free_port, wait_for, write_connection

from deploy.pki import site_key

pytestmark = pytest.mark.docker

IMAGE = "prism-fl:cpu"
SITES = ("hospital-a", "hospital-b", "clinic-c")
ONE_SHOTS = ("pki", *(f"{site}-key" for site in SITES), "register")
CONNECTION = "prism-compose"
CAP, REQUEST = 4.0, 3.0  # each site's own cap; each run's request: a second run must not fit


def _docker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def image_user() -> tuple[int, int]:
    """The image's uid:gid (the build's PRISM_UID/PRISM_GID): the bind folders' owner."""
    info = _docker("info", "--format", "{{.ServerVersion}}", timeout=30)
    if info.returncode != 0:
        pytest.fail(
            "no Docker Engine answers (`docker info` failed): start one, then "
            f"`make test-compose`.\n{info.stderr}"
        )
    inspect = _docker("image", "inspect", IMAGE, "--format", "{{.Config.User}}", timeout=30)
    if inspect.returncode != 0:
        pytest.fail(f"image {IMAGE} not found: build it with `make test-compose`")
    uid, gid = (int(v) for v in inspect.stdout.strip().split(":"))
    assert uid != 0 and gid != 0, "the image must never run as root"
    return uid, gid


class Project:
    """``docker compose`` on the repository's compose file, in a throw-away project folder."""

    def __init__(self, folder: Path, name: str, env: dict[str, str]) -> None:
        self.folder, self.name, self.env = folder, name, env

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        command = [
            "docker",
            "compose",
            "-f",
            str(ROOT / "docker-compose.yml"),
            "--project-directory",
            str(self.folder),
            "-p",
            self.name,
            *args,
        ]
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env,
        )

    def states(self) -> dict[str, tuple[str, int]]:
        """service -> (state, exit code) of every container of the project."""
        done = self("ps", "--all", "--format", "json", timeout=60)
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        return {r["Service"]: (r["State"], int(r.get("ExitCode", 0))) for r in rows}

    def logs(self, service: str) -> str:
        done = self("logs", "--no-color", service, timeout=60)
        return done.stdout + done.stderr

    def up(self) -> None:
        """``up -d`` (no build: the image is this checkout's), then wait for every service."""
        done = self("up", "-d", "--no-build", timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr

        def settled() -> bool:
            states = self.states()
            for service in ONE_SHOTS:
                state, code = states.get(service, ("missing", -1))
                if state == "exited" and code != 0:
                    pytest.fail(f"{service} exited {code}:\n{self.logs(service)[-3000:]}")
            return all(states.get(s, ("",))[0] == "exited" for s in ONE_SHOTS) and all(
                states.get(s, ("",))[0] == "running" for s in ("superlink", *SITES)
            )

        wait_for(settled, 300, "the compose federation to come up")


def _site_ledger_lines(project: Project, site: str) -> int:
    done = project("exec", "-T", site, "cat", "/var/lib/prism/privacy-ledger.jsonl", timeout=60)
    assert done.returncode == 0, done.stderr
    return sum(1 for line in done.stdout.splitlines() if line.strip())


def _run_config(**extra: object) -> str:
    values = {
        "num-rounds": 1,
        "local-steps": 1,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "target-epsilon": REQUEST,
        "min-sites": 3,
        "connect-timeout": 300,
        **extra,
    }
    return " ".join(f"{k}={v}" for k, v in values.items())


def _run(project: Project, env: dict[str, str], runs: Path, **extra: object) -> tuple[Path, float]:
    """One ``flwr run`` (``extra``: run-config values); return its new run folder and the wall
    time."""
    before = {p.parent for p in runs.glob("*/summary.json")}
    start = time.monotonic()
    result = flwr_run(env, CONNECTION, _run_config(**extra), timeout=900)
    wall = time.monotonic() - start
    logs = "\n".join(project.logs(s)[-2000:] for s in ("superlink", "hospital-a"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:] + logs
    wait_for(
        lambda: {p.parent for p in runs.glob("*/summary.json")} - before, 120, "the run's summary"
    )
    (run_dir,) = {p.parent for p in runs.glob("*/summary.json")} - before
    return run_dir, wall


def test_compose_federation_on_a_real_engine(image_user, tmp_path):
    uid, gid = image_user
    folder = tmp_path / "project"
    runs = folder / "runs"
    for path in (runs, *(folder / "deploy" / "local" / s / "data" for s in SITES)):
        path.mkdir(parents=True)
    for path in [folder, *folder.rglob("*")]:
        shutil.chown(path, uid, gid)
    port = free_port()
    home = tmp_path / "operator-flwr-home"
    env = {
        **flower_env(home),
        "PRISM_UID": str(uid),
        "PRISM_GID": str(gid),
        "PRISM_PORT": str(port),
        **{f"{s.upper().replace('-', '_')}_EPSILON_CAP": str(CAP) for s in SITES},
    }
    project = Project(folder, f"prism-fl-test-{port}", env)
    rogue_name = f"{project.name}-rogue"
    timings: dict[str, float] = {}
    try:
        # 1. the federation comes up; each site has its own key volume, one registration each
        start = time.monotonic()
        project.up()
        timings["up"] = time.monotonic() - start
        register = project.logs("register")
        assert register.count("registered ") == len(SITES), register

        # 2. one run from the host over TLS, with the CA copied out of the SuperLink
        ca = tmp_path / "ca.crt"
        done = project("cp", "superlink:/tls/ca.crt", str(ca), timeout=60)
        assert done.returncode == 0, done.stderr
        write_connection(home, CONNECTION, f"127.0.0.1:{port}", root_certificates=str(ca))
        # with secure aggregation: the identity keys the key steps published are the pinned
        # peers; each site counts on its own H = 2 (the compose default) of the run's 3
        run_dir, timings["run-1"] = _run(
            project, env, runs, **{"secure-aggregation": "true", "min-honest-sites": 3}
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds-applied"] == 1, summary
        assert (run_dir / "adapter" / "adapter_config.json").is_file()
        report = json.loads((run_dir / "report.json").read_text())
        spent = {row["site_id"]: row["epsilon"] for row in report["sites"]}
        assert sorted(spent) == sorted(SITES), report["sites"]
        for site, eps in spent.items():  # each site spent (nearly) its request, never more
            assert 0.9 * REQUEST <= eps <= REQUEST + 1e-6, (site, eps)
        for row in report["sites"]:  # the sum's epsilon at H = 2, and the share's alone
            assert row["honest_sites"] == 2 and row["epsilon_collusion"] > row["epsilon"], row
        for site in SITES:
            assert _site_ledger_lines(project, site) == 1
            # the site's warm worker (the image's default executor) ran the round in-process
            # with the installed ClientApp: no flwr-clientapp process, one task line for each of
            # the secure round's six messages
            site_log = project.logs(site)
            assert len(re.findall(r"task \d+ of run \d+: [0-9.]+ s", site_log)) == 6, site_log
            assert "Start `flwr-clientapp` process" not in site_log

        # 3. a SuperNode container whose key was never registered is refused
        rogue = tmp_path / "rogue-keys"
        site_key(rogue, "rogue", ca_cert=ca)
        for path in [rogue, *rogue.iterdir()]:
            shutil.chown(path, uid, gid)
        refused = _docker(
            "run",
            "--name",
            rogue_name,
            "--network",
            f"{project.name}_default",
            "-e",
            "PRISM_SUPERLINK=superlink:8000",
            "-e",
            "PRISM_CA_CERT=/keys/ca.crt",
            "-e",
            "PRISM_SITE_KEY=/keys/site.key",
            "-e",
            "PRISM_SITE_ID=rogue",
            "-e",
            "PRISM_STATE_DIR=/var/lib/prism",
            "-e",
            f"PRISM_EPSILON_CAP={CAP}",
            "-e",
            "PRISM_DELTA=1e-5",
            "-v",
            f"{rogue}:/keys:ro",
            IMAGE,
            "supernode",
            "--max-retries",
            "2",
            timeout=180,
        )
        assert refused.returncode != 0
        assert "Failed to activate SuperNode" in refused.stdout + refused.stderr

        # 4. down / up: keys, registrations and every site's spent budget survive
        start = time.monotonic()
        assert project("down", timeout=300).returncode == 0
        project.up()
        timings["down-up"] = time.monotonic() - start
        register = project.logs("register")
        assert register.count("already known as node") == len(SITES), register
        assert "already in use" not in project.logs("superlink")
        for site in SITES:
            assert _site_ledger_lines(project, site) == 1
        run_dir, timings["run-2"] = _run(project, env, runs)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds-applied"] == 0, summary  # REQUEST twice exceeds every CAP
        assert summary["adapter"] is None and "adapter-reason" in summary, summary
        assert not (run_dir / "adapter").exists()
        for site in SITES:
            assert _site_ledger_lines(project, site) == 1  # a refused round charges nothing
        print("compose timings (s):", {k: round(v, 1) for k, v in timings.items()})
    finally:
        _docker("rm", "-f", rogue_name, timeout=60)
        project("down", "-v", "--remove-orphans", timeout=300)
