"""Two demos on one machine each get their own local SuperLink (``server.demo.demo_env``).

``flwr run . local`` starts a local SuperLink on fixed ports unless told others; a second demo
from another checkout then found the first one's SuperLink and ran in its simulation process and
Python environment. Here two environments as the demo makes them each start a real SuperLink
(``flwr ls`` on the ``local`` connection starts one, as ``flwr run`` does): two processes on two
port pairs, each stopped by its own ``FLWR_HOME``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server.demo import LOCAL_PORTS, demo_env, stop_local_superlinks

FLWR = Path(sys.executable).parent / "flwr"


def test_two_demo_environments_start_two_superlinks_on_their_own_ports(tmp_path):
    homes = [tmp_path / "checkout-a" / ".flwr", tmp_path / "checkout-b" / ".flwr"]
    envs = [demo_env(home) for home in homes]
    ports = [tuple(env[name] for name in LOCAL_PORTS) for env in envs]
    assert len({p for pair in ports for p in pair}) == 4  # four distinct ports
    started: list[list[int]] = []
    try:
        for env in envs:
            done = subprocess.run(
                [str(FLWR), "ls"], env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    finally:
        started = [stop_local_superlinks(home) for home in homes]
    assert all(len(pids) == 1 for pids in started), started  # one SuperLink each
    assert started[0] != started[1]
    for home in homes:  # each kept its own state under its own FLWR_HOME
        assert (home / "local-superlink" / "state.db").exists()
