"""``stop_local_superlinks``: nothing it finds is still running when it returns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from server.demo import stop_local_superlinks


def _fake_superlink(tmp_path, home, *, ignore_term):
    """A process whose argv ends in ``flower-superlink``, as ``flwr run . local`` starts it."""
    script = tmp_path / "flower-superlink"
    handler = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else ""
    script.write_text(
        textwrap.dedent(f"""
            import signal, sys, time
            {handler}
            print("ready", flush=True)
            time.sleep(60)
        """)
    )
    env = {**os.environ, "FLWR_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def test_a_superlink_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    home = tmp_path / "flwr"
    proc = _fake_superlink(tmp_path, home, ignore_term=True)
    try:
        started = time.monotonic()
        assert stop_local_superlinks(home, grace=1.0) == [proc.pid]
        assert proc.wait(timeout=5) == -9  # SIGKILL, after the grace
        assert time.monotonic() - started >= 1.0
    finally:
        proc.kill()


def test_a_superlink_that_exits_on_sigterm_is_not_killed(tmp_path):
    home = tmp_path / "flwr"
    proc = _fake_superlink(tmp_path, home, ignore_term=False)
    other = _fake_superlink(tmp_path, tmp_path / "someone-else", ignore_term=False)
    try:
        assert stop_local_superlinks(home, grace=10.0) == [proc.pid]
        assert proc.wait(timeout=5) == -15  # SIGTERM
        assert other.poll() is None  # another FLWR_HOME's SuperLink is left alone
        assert stop_local_superlinks(home) == []
    finally:
        proc.kill()
        other.kill()
        other.wait()
