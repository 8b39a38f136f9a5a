"""Secure-by-default launcher of Flower's SuperLink and SuperNode (``python -m deploy.launch``).

``python -m deploy.launch superlink|supernode [EXTRA FLOWER ARGS...]`` reads its settings from
the environment (the compose files and the site kit's ``site.env`` set them), checks them, and
replaces itself with ``flower-superlink`` / ``flower-supernode``:

- TLS and SuperNode authentication are on. Running without TLS needs ``PRISM_ALLOW_INSECURE=1``
  and prints a warning; passing ``--insecure`` without it is refused.
- Private keys must not be readable by group or others (the error says which ``chmod`` to run).
- A secrets folder holds its owner's files only: a SuperLink or SuperNode that sees another
  party's files next to its key (a sub-folder such as ``sites/``, or a ``*.key`` that is not its
  own, e.g. ``ca.key``) refuses to start and names the fix. That is the whole-volume layout: an
  old compose file's ``volume.subpath``, which Docker Engines before 26 silently ignore.
- The SuperLink never installs dependencies at run time
  (``--disable-runtime-dependency-installation``): the image carries them.
- A site's node config (``PRISM_SITE_ID``, ``PRISM_DATA_PATH``, ``PRISM_EPSILON_CAP``, ...) is
  validated with ``prism_runtime.config.SiteConfig`` before the SuperNode starts, and a site is
  refused without its privacy policy and ledger folder (``PRISM_EPSILON_CAP``, ``PRISM_DELTA``,
  ``PRISM_STATE_DIR``) or with a reproducible-randomness secret (``PRISM_FL_RNG_SECRET``) while it
  requires secure randomness (the default).
- Secure aggregation (the coordinator learns only the sum of the sites' updates): the site's
  identity key (``PRISM_SECURE_IDENTITY``, ECDSA P-256, made by ``deploy.pki site-key``) must be
  a private key that group and others cannot read. Unless the site is ``off``, its peers folder
  (``PRISM_SECURE_PEERS``) must hold only public keys, each a P-256 ``<site-id>.pem``, with the
  site's own matching its identity key; an empty peers folder is left out of the node config
  with a warning (the site then refuses secure rounds), and ``require`` without pinned keys is
  refused (it would refuse every round).
- Only file paths are printed, never the contents of a key.

Environment of ``superlink``: ``PRISM_TLS_DIR`` (``ca.crt``, ``server.crt``, ``server.key``),
``PRISM_DATABASE`` (SuperLink state; put it on a volume), ``PRISM_HOST`` (default ``0.0.0.0``),
``PRISM_PORT`` (default 8000).
Environment of ``supernode``: ``PRISM_SUPERLINK`` (host:port), ``PRISM_CA_CERT``,
``PRISM_SITE_KEY``, ``PRISM_SITE_ID``, ``PRISM_DATA_PATH``, ``PRISM_STATE_DIR``,
``PRISM_EPSILON_CAP``, ``PRISM_DELTA`` (these three required), ``PRISM_SHARE_NUM_EXAMPLES``,
``PRISM_ALLOW_NONDP``, ``PRISM_ALLOW_NONPRIVATE_METRICS``, ``PRISM_REQUIRE_SECURE_RNG`` (default
true), ``PRISM_PRIVACY_UNIT`` (``user``: one epsilon per person with all their records, or
``record``; default ``record``) with ``PRISM_USER_FIELD`` (the data field naming the person,
required with ``user``), ``PRISM_PARTITION_ID`` and ``PRISM_NUM_PARTITIONS`` (one-host demo only),
``PRISM_SECURE_AGGREGATION`` (``off``, ``allow`` (default) or ``require``),
``PRISM_MIN_HONEST_SITES`` (H: the most honest sites, this one included, the site counts on;
default 1), ``PRISM_SECURE_MAX_DROPOUTS`` (D: the most sites of a round it tolerates missing;
below H, default 0), ``PRISM_SECURE_GRAPH`` (``complete``, the default, or ``sparse``: also
accept a sparse masking graph within the site's own bound), ``PRISM_SECURE_PEERS`` (the folder of
pinned identity public keys, one ``<site-id>.pem`` per site, writable by its owner only; their
fingerprints are logged at start; a site without it refuses secure rounds),
``PRISM_SECURE_IDENTITY`` (the site's identity private key file, e.g. ``KEYS_DIR/identity.pem``),
``PRISM_CLIENTAPP_PORT`` (default 9094), ``PRISM_SITE_EXECUTOR`` (``worker``, the default: the
SuperNode runs under the site's warm worker ``client.worker``, one long-lived process that runs
every message with the site's installed ClientApp; ``flower``: Flower's own executor, a fresh
``flwr-clientapp`` process per message running the app bundle the coordinator submitted).
Exit code 2: refused, with the reason on stderr; otherwise Flower's own exit code.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from deploy.errors import DeployError, InsecureSetupError
from deploy.identity import check_peers, fingerprint, load_identity, pinned_keys

__all__ = [
    "ALLOW_INSECURE",
    "check_own_folder",
    "check_private_key",
    "main",
    "site_command",
    "superlink_args",
    "supernode_args",
]

log = logging.getLogger(__name__)

ALLOW_INSECURE = "PRISM_ALLOW_INSECURE"
WARNING = (
    "WARNING: prism-fl is running WITHOUT TLS and WITHOUT SuperNode authentication "
    f"({ALLOW_INSECURE}=1). Anyone who can reach the port can read the updates and join the "
    "federation. Use this on loopback for tests only."
)
# SiteConfig field -> environment variable of the site kit
_NODE_ENV = {
    "site-id": "PRISM_SITE_ID",
    "data-path": "PRISM_DATA_PATH",
    "state-dir": "PRISM_STATE_DIR",
    "epsilon-cap": "PRISM_EPSILON_CAP",
    "delta": "PRISM_DELTA",
    "share-num-examples": "PRISM_SHARE_NUM_EXAMPLES",
    "allow-nondp": "PRISM_ALLOW_NONDP",
    "allow-nonprivate-metrics": "PRISM_ALLOW_NONPRIVATE_METRICS",
    "require-secure-rng": "PRISM_REQUIRE_SECURE_RNG",
    "privacy-unit": "PRISM_PRIVACY_UNIT",
    "user-field": "PRISM_USER_FIELD",
    "max-records-per-user": "PRISM_MAX_RECORDS_PER_USER",
    "partition-id": "PRISM_PARTITION_ID",
    "num-partitions": "PRISM_NUM_PARTITIONS",
    "secure-aggregation": "PRISM_SECURE_AGGREGATION",
    "min-honest-sites": "PRISM_MIN_HONEST_SITES",
    "secure-max-dropouts": "PRISM_SECURE_MAX_DROPOUTS",
    "secure-graph": "PRISM_SECURE_GRAPH",
    "secure-peers": "PRISM_SECURE_PEERS",
    "secure-identity": "PRISM_SECURE_IDENTITY",
}
_NUMERIC = {
    "epsilon-cap",
    "delta",
    "partition-id",
    "num-partitions",
    "max-records-per-user",
    "min-honest-sites",
    "secure-max-dropouts",
}
_BOOLEAN = {
    "share-num-examples",
    "allow-nondp",
    "allow-nonprivate-metrics",
    "require-secure-rng",
}
_REQUIRED = ("epsilon-cap", "delta", "state-dir")
"""A site kit never starts without its own privacy policy and its ledger folder."""
SECURE_MODES = ("off", "allow", "require")


def _insecure_allowed(env: Mapping[str, str]) -> bool:
    return env.get(ALLOW_INSECURE, "").strip().lower() in {"1", "true", "yes"}


def _existing_file(path: str, what: str, variable: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise DeployError(
            f"{what} {file} ({variable}) does not exist or is not a file: create it with "
            "`python -m deploy.pki` or fix the path"
        )
    return file


def check_private_key(path: str, what: str, variable: str) -> Path:
    """``path`` must be a file that neither group nor others can read or write."""
    key = _existing_file(path, what, variable)
    mode = stat.S_IMODE(key.stat().st_mode)
    if mode & 0o077:
        raise InsecureSetupError(
            f"{what} {key} is accessible by group/others (mode {mode:04o}); "
            f"run `chmod 600 {key}` (and keep it owned by the user that runs prism-fl)"
        )
    return key


def check_own_folder(folder: Path, own_key: str, who: str, variable: str) -> None:
    """``folder`` (where ``who`` keeps its private key ``own_key``) holds no one else's files.

    Refused: any sub-folder, and any ``*.key`` other than ``own_key``. Ignored: hidden entries
    and ``lost+found`` (a platform's or file system's own bookkeeping).

    Raises:
        InsecureSetupError: the folder shows another party's files (the whole-volume layout).
    """
    if not folder.is_dir():
        return  # the missing-file check names the path
    foreign = sorted(
        f"{entry.name}/" if entry.is_dir() else entry.name
        for entry in folder.iterdir()
        if not entry.name.startswith(".")
        and entry.name != "lost+found"
        and (entry.is_dir() or (entry.suffix == ".key" and entry.name != own_key))
    )
    if foreign:
        raise InsecureSetupError(
            f"refusing to start: {folder} ({variable}) holds files that are not the {who}'s own "
            f"({', '.join(foreign)}): this is the whole key volume, with the CA key or other "
            f"parties' keys, not the {who}'s own folder. Docker Engines before 26 silently "
            "ignore `volume.subpath`, which older prism-fl compose files used. Fix: use this "
            "version's docker-compose.yml (one volume per secret holder, no subpath) and run "
            f"`docker compose up -d` again; outside compose, mount only the {who}'s own folder"
        )


def _plain_text(env: Mapping[str, str], extra: Sequence[str], tls_configured: bool) -> bool:
    """True if the process will run without TLS; refuses unless explicitly allowed."""
    if "--insecure" in extra or not tls_configured:
        if not _insecure_allowed(env):
            reason = "--insecure was passed" if "--insecure" in extra else "no TLS is configured"
            raise InsecureSetupError(
                f"refusing to start: {reason}. Configure TLS (see deploy/README.md), or set "
                f"{ALLOW_INSECURE}=1 to run in plain text on a trusted loopback network"
            )
        return True
    return False


def superlink_args(env: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """The ``flower-superlink`` command line for ``env`` (after the security checks)."""
    tls_dir = env.get("PRISM_TLS_DIR", "")
    command = [
        "flower-superlink",
        "--disable-runtime-dependency-installation",
        "--host",
        env.get("PRISM_HOST", "0.0.0.0"),
        "--port",
        env.get("PRISM_PORT", "8000"),
    ]
    if env.get("PRISM_DATABASE"):
        command += ["--database", env["PRISM_DATABASE"]]
    if _plain_text(env, extra, bool(tls_dir)):
        command.append("--insecure")
    else:
        folder = Path(tls_dir)
        check_own_folder(folder, "server.key", "SuperLink", "PRISM_TLS_DIR")
        ca = _existing_file(str(folder / "ca.crt"), "CA certificate", "PRISM_TLS_DIR")
        cert = _existing_file(str(folder / "server.crt"), "server certificate", "PRISM_TLS_DIR")
        key = check_private_key(str(folder / "server.key"), "server private key", "PRISM_TLS_DIR")
        command += [
            "--ssl-ca-certfile",
            str(ca),
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
            "--enable-supernode-auth",
        ]
    return command + [a for a in extra if a != "--insecure"]


def _node_config(env: Mapping[str, str]) -> str:
    """``--node-config`` from the site's environment, validated by ``SiteConfig``."""
    from client.policy import RNG_SECRET_ENV, site_policy
    from prism_runtime.config import SiteConfig, parse_config

    values: dict[str, object] = {}
    for key, variable in _NODE_ENV.items():
        raw = env.get(variable, "").strip()
        if not raw:
            continue
        if key in _NUMERIC:
            try:
                values[key] = float(raw) if key in {"epsilon-cap", "delta"} else int(raw)
            except ValueError:
                raise DeployError(f"{variable}={raw!r} is not a number") from None
        elif key in _BOOLEAN:
            values[key] = raw.lower() in {"1", "true", "yes"}
        elif key == "secure-aggregation":
            values[key] = raw.lower()
            if values[key] not in SECURE_MODES:
                raise DeployError(
                    f"{variable}={raw!r}: use off (refuse secure-aggregation rounds), allow (the "
                    "default) or require (refuse every round that is not securely aggregated)"
                )
        else:
            values[key] = raw
    values.setdefault("require-secure-rng", True)  # a kit site is a real site: secure by default
    missing = [_NODE_ENV[key] for key in _REQUIRED if key not in values]
    if missing:
        raise DeployError(
            f"refusing to start: {', '.join(missing)} not set. A site states its own privacy "
            "policy (PRISM_EPSILON_CAP: the most epsilon it will ever spend; PRISM_DELTA: the "
            "largest delta it accepts, well below 1/N) and keeps its privacy ledger in "
            "PRISM_STATE_DIR (a volume that survives restarts); the coordinator cannot set them"
        )
    try:
        site = parse_config(SiteConfig, values, what="site setting")
        site_policy(site, env_secret=env.get(RNG_SECRET_ENV, ""))
    except ValueError as exc:
        raise DeployError(f"{exc} (set the PRISM_* variables of the site kit)") from exc
    values = _secure_settings(values)
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={str(value).lower()}")
        elif isinstance(value, str):
            if "'" in value or '"' in value:
                raise DeployError(f"{key}={value!r}: quotes are not allowed in this setting")
            parts.append(f"{key}='{value}'")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _secure_settings(values: dict[str, object]) -> dict[str, object]:
    """The node config ``values`` (validated) after checking its secure-aggregation files.

    The identity key (``secure-identity``, if set) must be a P-256 private key that neither
    group nor others can read. Unless the site is ``off``, the peers folder (``secure-peers``)
    must hold the federation's pinned public keys with this site's own matching its identity
    key; an empty one is left out of the returned node config with a warning (the site then
    refuses secure rounds with ``secure-aggregation-not-configured``); ``require`` needs it
    filled.
    """
    mode = values.get("secure-aggregation", "allow")
    identity = values.get("secure-identity")
    if isinstance(identity, str):
        if not Path(identity).is_file():
            raise DeployError(
                f"the secure-aggregation identity key {identity} (PRISM_SECURE_IDENTITY) does not "
                "exist: make it with ./make-site-key.sh (site kit) or `python -m deploy.pki "
                "site-key --out KEYS_DIR`, which keep an existing site key and add identity.pem"
            )
        what = "secure-aggregation identity key"
        load_identity(check_private_key(identity, what, "PRISM_SECURE_IDENTITY"))
    if mode == "off":
        return values
    peers = values.get("secure-peers")
    pinned = 0
    if isinstance(peers, str):
        pinned = check_peers(
            Path(peers),
            site_id=str(values["site-id"]),
            identity=Path(identity) if isinstance(identity, str) else None,
            variable="PRISM_SECURE_PEERS",
        )
    if pinned:
        for site, pem in sorted(
            pinned_keys(Path(str(peers)), variable="PRISM_SECURE_PEERS").items()
        ):
            log.info("pinned identity key of %s: %s", site, fingerprint(pem))
        return values
    if mode == "require":
        raise DeployError(
            "refusing to start: PRISM_SECURE_AGGREGATION=require, but "
            + (f"the peers folder {peers} is empty" if peers else "PRISM_SECURE_PEERS is not set")
            + ": this site would refuse every round. Put the federation's identity public keys "
            "(one <site-id>.pem per site, this site's own included, from the federation's "
            "registry) into the peers folder, or set PRISM_SECURE_AGGREGATION=allow"
        )
    if peers:
        log.warning(
            "the peers folder %s (PRISM_SECURE_PEERS) pins no identity keys yet: this site "
            "takes part in plain rounds only and refuses securely aggregated ones "
            "(secure-aggregation-not-configured) until the federation's keys are installed",
            peers,
        )
    return {key: value for key, value in values.items() if key != "secure-peers"}


def supernode_args(env: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """The ``flower-supernode`` command line for ``env`` (after the security checks)."""
    superlink = env.get("PRISM_SUPERLINK", "")
    if not superlink:
        raise DeployError("PRISM_SUPERLINK is not set: give the coordinator as host:port")
    command = [
        "flower-supernode",
        "--superlink",
        superlink,
        "--port",
        env.get("PRISM_CLIENTAPP_PORT", "9094"),
        "--node-config",
        _node_config(env),
    ]
    tls_configured = bool(env.get("PRISM_CA_CERT") or env.get("PRISM_SITE_KEY"))
    if _plain_text(env, extra, tls_configured):
        command.append("--insecure")
    else:
        if not env.get("PRISM_CA_CERT") or not env.get("PRISM_SITE_KEY"):
            raise InsecureSetupError(
                "PRISM_CA_CERT (the coordinator's CA certificate) and PRISM_SITE_KEY (this "
                "site's private key) must both be set"
            )
        site_key = Path(env["PRISM_SITE_KEY"])
        check_own_folder(site_key.parent, site_key.name, "site", "PRISM_SITE_KEY")
        ca = _existing_file(env["PRISM_CA_CERT"], "CA certificate", "PRISM_CA_CERT")
        key = check_private_key(env["PRISM_SITE_KEY"], "site private key", "PRISM_SITE_KEY")
        command += ["--root-certificates", str(ca), "--auth-supernode-private-key", str(key)]
    return command + [a for a in extra if a != "--insecure"]


EXECUTORS = ("worker", "flower")


def site_command(env: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """The site's command line: ``supernode_args`` under the warm worker (``python -m
    client.worker -- flower-supernode ...``), or alone with ``PRISM_SITE_EXECUTOR=flower``."""
    executor = env.get("PRISM_SITE_EXECUTOR", "worker").strip().lower() or "worker"
    if executor not in EXECUTORS:
        raise DeployError(
            f"PRISM_SITE_EXECUTOR={executor!r}: use 'worker' (the default: one warm process "
            "runs the site's installed ClientApp) or 'flower' (a process per message)"
        )
    command = supernode_args(env, extra)
    if executor == "flower":
        return command
    binary = Path(sys.executable).parent / command[0]
    if binary.exists():
        command[0] = str(binary)
    return [sys.executable, "-m", "client.worker", "--", *command]


def main(argv: Sequence[str] | None = None) -> int:
    """Check the settings, then exec Flower; returns 2 when refused (exec does not return)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in {"superlink", "supernode"}:
        print(
            "usage: python -m deploy.launch superlink|supernode [FLOWER ARGS...]", file=sys.stderr
        )
        return 2
    logging.basicConfig(format="prism-fl launch: %(levelname)s: %(message)s", level=logging.WARNING)
    env = dict(os.environ)
    env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    try:
        build = superlink_args if args[0] == "superlink" else site_command
        command = build(env, args[1:])
    except DeployError as exc:
        print(f"prism-fl launch: {exc}", file=sys.stderr)
        return 2
    if "--database" in command:  # the SuperLink's state folder (a volume in compose)
        Path(command[command.index("--database") + 1]).parent.mkdir(parents=True, exist_ok=True)
    elif command[0] == "flower-superlink":
        print(
            "WARNING: PRISM_DATABASE is not set: the SuperLink keeps registered sites and runs "
            "in memory and loses them on restart",
            file=sys.stderr,
        )
    if "--insecure" in command:
        print(WARNING, file=sys.stderr)
    print(f"prism-fl launch: {' '.join(command)}", file=sys.stderr, flush=True)
    binary = Path(sys.executable).parent / command[0]
    os.execvpe(str(binary) if binary.exists() else command[0], command, env)
    return 0  # pragma: no cover  (exec does not return)


if __name__ == "__main__":
    raise SystemExit(main())
