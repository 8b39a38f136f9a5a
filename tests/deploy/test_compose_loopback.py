"""``docker-compose.yml``'s services run as local processes on loopback (no Docker engine here).

Each service's command (image ENTRYPOINT/CMD + the service's entrypoint/command, with its
environment, its volumes mapped to WHOLE folders under a temp dir, as every Docker Engine mounts
them) runs in order: the pki one-shot and each site's key one-shot, the SuperLink (TLS +
SuperNode authentication + ``--database`` on its volume), the register one-shot and the three
SuperNodes; then a 2-round run with a tiny model. Checked on the way: the
run completes and its ledger, reports and adapter land on the host-mounted runs volume; an
unregistered (and a revoked) site key is refused; a client that does not trust the federation's
CA cannot connect, nor can a plain-text client; the SuperLink's state and the ledger survive a
SuperLink restart; no private key material appears in any log. Every process is stopped.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

from compose_local import LocalService, compose_config, localize, setup_steps
from cryptography import x509
from flower_harness import (
    BIN,
    ROOT,
    flower_env,
    flwr_run,
    free_port,
    port_open,
    processes,
    wait_for,
    write_connection,
)

from deploy.pki import init_federation, site_key
from deploy.register import Registrar
from server.ledger import Ledger

SITES = ("hospital-a", "hospital-b", "clinic-c")
ROUNDS, STEPS = 2, 2
CONNECTION = "prism-compose"


def _run_config(model: str) -> str:
    # run-dir is left at its default (runs/<timestamp> under the SuperLink's working_dir), so the
    # outputs must appear in the folder that compose bind-mounts from the host.
    values = {
        "model": f"'{model}'",
        "lora-rank": 4,
        "num-rounds": ROUNDS,
        "local-steps": STEPS,
        "batch-size": 16,
        "micro-batch-size": 16,
        "synthetic-examples": 64,
        "max-length": 24,
        "target-epsilon": 8.0,  # a request at the sites' own cap (compose default 8.0)
        "min-sites": 3,
    }
    return " ".join(f"{k}={v}" for k, v in values.items())


def _one_shot(service: LocalService, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*service.argv, *extra],
        env=service.env,
        cwd=service.cwd,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _private_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _flwr_ls(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [str(BIN / "flwr"), "ls", CONNECTION, "--format", "json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    reply = json.loads(done.stdout)
    assert reply["success"], reply
    return {run["run-id"]: run["status"] for run in reply["runs"]}


def _key_material(path: Path) -> list[str]:
    """The base64 body lines of a PEM/OpenSSH private key (what must never be logged)."""
    return [
        line for line in path.read_text().splitlines() if len(line) > 20 and "-----" not in line
    ]


def test_compose_services_on_loopback(tiny_bert, tmp_path):
    config = compose_config(ROOT / "docker-compose.yml")
    assert {"pki", "superlink", "register", *SITES} <= set(config["services"])
    steps = setup_steps(config)
    assert steps == ["pki", *sorted(f"{site}-key" for site in SITES)]
    port = free_port()
    home = tmp_path / "operator-flwr-home"  # the operator's flwr CLI on the host
    base = flower_env(home)
    svc = {
        name: localize(config, name, tmp_path, superlink_port=port, base_env=base)
        for name in config["services"]
    }
    for site in SITES:  # each container has its own network namespace; here each needs a port
        svc[site].env["PRISM_CLIENTAPP_PORT"] = str(free_port())
    superlink = svc["superlink"]
    runs = superlink.host_path("/srv/prism/runs")
    assert runs == tmp_path / "binds" / "runs"  # ./runs on the host
    outputs: list[str] = []

    with processes(base, tmp_path / "logs") as group:
        # 1. pki one-shots: CA, server certificate with the SANs, one 0600 key per site
        for step in steps:
            done = _one_shot(svc[step])
            outputs.append(done.stdout + done.stderr)
            assert done.returncode == 0, done.stderr
        tls = superlink.host_path("/tls")
        assert _private_mode(tls / "server.key") == 0o600
        cert = x509.load_pem_x509_certificate((tls / "server.crt").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {"superlink", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
        for site in SITES:
            assert _private_mode(svc[site].host_path("/keys/site.key")) == 0o600
        assert not (svc["register"].host_path("/pki-public") / "ca.key").exists()
        # a re-run keeps every key (registered keys stay valid)
        before = (tls / "server.key").read_bytes()
        site_before = svc["clinic-c"].host_path("/keys/site.key").read_bytes()
        assert all(_one_shot(svc[step]).returncode == 0 for step in steps)
        assert (tls / "server.key").read_bytes() == before
        assert svc["clinic-c"].host_path("/keys/site.key").read_bytes() == site_before

        # 2. SuperLink with TLS, SuperNode auth and its database on the state volume
        group.start("superlink", superlink.argv, env=superlink.env, cwd=superlink.cwd)
        wait_for(lambda: port_open(port), 60, "the SuperLink port")
        assert "--enable-supernode-auth" in group.log("superlink")

        # 3. register one-shot: every site's public key
        done = _one_shot(svc["register"])
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("registered ") == len(SITES), done.stdout
        registry_file = svc["register"].host_path("/var/lib/prism/registered-sites.json")
        registry = json.loads(registry_file.read_text())
        assert sorted(registry) == sorted(SITES)
        # the next `up`: every key is known, none is sent again, the SuperLink logs no ERROR
        again = _one_shot(svc["register"])
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("already known as node") == len(SITES), again.stdout
        assert "already in use" not in group.log("superlink")

        # 4. the three SuperNodes
        for site in SITES:
            group.start(site, svc[site].argv, env=svc[site].env, cwd=svc[site].cwd)

        # 5. clients that must be refused (they give up after a few tries)
        site_env = svc["hospital-a"].env
        rogue = site_key(tmp_path / "rogue-keys", "rogue")  # never registered
        revoked = site_key(tmp_path / "revoked-keys", "revoked")  # registered, then revoked
        registrar = Registrar(
            f"127.0.0.1:{port}", tls / "ca.crt", tmp_path / "operator-registry.json"
        )
        assert "registered revoked" in registrar.add(revoked, "revoked")
        assert "revoked revoked" in registrar.revoke("revoked")
        init_federation(tmp_path / "foreign-pki", ["x"])  # a CA the SuperLink's cert is not from
        refused = {
            "unregistered-key": {"PRISM_SITE_KEY": str(rogue.with_suffix(".key"))},
            "revoked-key": {"PRISM_SITE_KEY": str(revoked.with_suffix(".key"))},
            "foreign-ca": {"PRISM_CA_CERT": str(tmp_path / "foreign-pki" / "ca" / "ca.crt")},
            "plain-text": {"PRISM_CA_CERT": "", "PRISM_SITE_KEY": "", "PRISM_ALLOW_INSECURE": "1"},
        }
        refused_procs = {}
        for name, change in refused.items():
            env = {**site_env, "PRISM_SITE_ID": name, "PRISM_CLIENTAPP_PORT": str(free_port())}
            # no secure aggregation: its pinned-peers check would refuse these clients before
            # Flower starts, and the SuperLink's refusal is what is tested here
            env["PRISM_SECURE_AGGREGATION"] = "off"
            env.update(change)
            argv = [*svc["hospital-a"].argv, "--max-retries", "2"]
            refused_procs[name] = group.start(name, argv, env=env, cwd=tmp_path)
        # plain text without the explicit flag is refused by the launcher before Flower starts
        env = {**site_env, "PRISM_CA_CERT": "", "PRISM_SITE_KEY": ""}
        done = subprocess.run(
            svc["hospital-a"].argv, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2
        assert "PRISM_ALLOW_INSECURE=1" in done.stderr and "no TLS is configured" in done.stderr

        # 6. the run: `flwr run . prism-compose` with the CA copied from the SuperLink
        write_connection(
            home, CONNECTION, f"127.0.0.1:{port}", root_certificates=str(tls / "ca.crt")
        )
        result = flwr_run(base, CONNECTION, _run_config(tiny_bert))
        logs = "\n".join(group.log(n)[-2000:] for n in ("superlink", "hospital-a"))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:] + logs
        wait_for(lambda: list(runs.glob("*/summary.json")), 120, "the run's summary on the host")
        (run_dir,) = [p.parent for p in runs.glob("*/summary.json")]
        for name in ("ledger.sqlite", "report.json", "report.html", "adapter/adapter_config.json"):
            assert (run_dir / name).is_file(), name
        summary = json.loads((run_dir / "summary.json").read_text())
        assert [r["applied"] for r in summary["rounds"]] == [True] * ROUNDS
        with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
            assert sorted(ledger.sites()) == sorted(SITES)
            events = [e.event for e in ledger.events()]
        assert sum(e.steps for e in events) == ROUNDS * STEPS * len(SITES)
        for site in SITES:  # each site's own durable ledger on its state volume
            site_ledger = svc[site].host_path("/var/lib/prism/privacy-ledger.jsonl")
            assert site_ledger.read_text().count("\n") == ROUNDS
            # the launcher's default executor, the site's warm worker, ran every round in its
            # one process with the installed ClientApp: no flwr-clientapp process was started
            site_log = group.log(site)
            assert len(re.findall(r"task \d+ of run \d+: [0-9.]+ s", site_log)) == ROUNDS, site_log
            assert "Start `flwr-clientapp` process" not in site_log

        for name, proc in refused_procs.items():
            proc.wait(90)
            assert proc.returncode != 0, name
        assert "Failed to activate SuperNode" in group.log("unregistered-key")
        assert "Failed to activate SuperNode" in group.log("revoked-key")
        assert "CERTIFICATE_VERIFY_FAILED" in group.log("foreign-ca")
        assert "WITHOUT TLS" in group.log("plain-text")
        # Flower reports a plain-text client at a TLS port as a failed start or, when the
        # attempt lands while it retries, as a failed connection; either way it never joins
        plain = group.log("plain-text")
        assert re.search(r"Failed to initialize the connection|\(ConnectError\)", plain), plain
        assert "SuperNode ID" not in plain  # what Flower logs once a SuperNode has joined
        with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
            assert set(ledger.sites()) == set(SITES)  # none of them took part

        # 7. restart the SuperLink: registered sites, runs and the ledger survive
        runs_before = _flwr_ls(base)
        assert len(runs_before) == 1, runs_before
        assert all(s.startswith("finished") for s in runs_before.values()), runs_before
        group.stop(group.procs[0][1])
        wait_for(lambda: not port_open(port), 30, "the SuperLink to stop")
        group.start("superlink-restarted", superlink.argv, env=superlink.env, cwd=superlink.cwd)
        wait_for(lambda: port_open(port), 60, "the restarted SuperLink")
        nodes = {n["node-id"]: n["status"] for n in registrar.wait(60)}
        for site in SITES:
            assert registry[site]["node-id"] in nodes, (site, nodes)
            assert nodes[registry[site]["node-id"]] != "unregistered"
        assert _flwr_ls(base) == runs_before
        with Ledger.open(run_dir / "ledger.sqlite", read_only=True) as ledger:
            assert [e.event for e in ledger.events()] == events
    for _, proc in group.procs:
        assert proc.poll() is not None

    # secrets are never logged
    texts = [p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")]
    texts += [*outputs, result.stdout, result.stderr]
    keys = [tls / "server.key", *(svc[s].host_path("/keys/site.key") for s in SITES)]
    keys.append(svc["pki"].host_path("/pki/ca/ca.key"))  # only the pki step mounts `pki`
    secret_lines = [line for key in keys for line in _key_material(key)]
    assert secret_lines
    for text in texts:
        assert not any(line in text for line in secret_lines)
        assert not re.search(r"PRIVATE KEY-----", text)
