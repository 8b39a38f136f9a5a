"""The site's warm ClientApp worker: ``python -m client.worker -- flower-supernode ARGS...``.

Flower 1.42's SuperNode hands each message to an executor (its SuperExec), which starts a FRESH
``flwr-clientapp`` process per message: Python itself, the imports of torch, transformers, peft
and opacus, and the site's set-up, about 5-6 s at every round of every site against a local
round of about 1.1 s at the demo settings (docs/benchmarks.md, "The site's start per message").

This worker is the site's executor instead. It starts the SuperNode it is given with
``--isolation process`` as its child and then, in ONE long-lived process, acquires each ClientApp
task from the SuperNode's Runtime API (loopback; every ``AcquireTask`` is signed with a secret
made for this start, so no other local process can take the site's tasks) and runs it
in-process: pull the message, call the site's ClientApp, push the reply. The imports happen once
per worker, and ``client.site.get_site`` keeps the site's model, tokenised shard and trainer
from one round of a run to the next, as in Flower's simulation engine. Nothing else changes:
every round is checked, charged to the durable ledger and trained exactly as before, and the
ledger, the caches and every refusal live on disk, so a worker that dies loses nothing a fresh
process would have kept.

**The site runs its own code.** The ClientApp is the INSTALLED one (``client.app.app``, the
reviewed release in the site's image); the app bundle (FAB) the coordinator submitted with
``flwr run`` is never installed or executed here, so the coordinator cannot change the site's
training code. A task of a run whose app is not prism-fl (the FAB's ``fab_id``) gets an error
reply with code 4001 and its fixed text; another prism-fl version is logged as a warning and
served by the installed code (the coordinator validates every reply). As in ``client.app``, a
failure is replied as a code with a fixed text, never the exception's text (Flower's own
``flwr-clientapp`` sends the exception text).

Environment: ``PRISM_WORKER_POLL`` (seconds between ``AcquireTask`` calls when idle; default
0.05, between 0.01 and 5). Exit code: the SuperNode's when it ends, 0 on SIGTERM/SIGINT (the
SuperNode is stopped first), 2 on a usage error.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from flwr.app import Context, Error, Message
from flwr.common.constant import SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node
from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullAppMessagesRequest, PullTaskInputRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import RetryInvoker, exponential
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from prism_runtime.logs import setup_logging
from prism_runtime.protocol import APP_ID, SITE_ERROR_CODES

__all__ = [
    "DEFAULT_POLL_S",
    "POLL_ENV",
    "PULL_BACKOFF_S",
    "TaskTimes",
    "main",
    "poll_seconds",
    "pull_task_input",
    "run_task",
    "runtime_address",
    "serve",
    "supernode_command",
]

log = logging.getLogger("client.worker")  # also when run as __main__

POLL_ENV = "PRISM_WORKER_POLL"
DEFAULT_POLL_S = 0.05
_POLL_RANGE = (0.01, 5.0)
_CONFIG_ERROR, _INTERNAL_ERROR = 4001, 4003
_STOP_GRACE_S = 15.0
_RETRY_S = 60.0


App = Callable[..., Message]


def poll_seconds(env: dict[str, str] | None = None) -> float:
    """``PRISM_WORKER_POLL`` as seconds (default 0.05); an unusable value is an error."""
    raw = (os.environ if env is None else env).get(POLL_ENV, "")
    if not raw:
        return DEFAULT_POLL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    low, high = _POLL_RANGE
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{POLL_ENV}={raw!r}: give seconds between {low} and {high}")
    return value


def runtime_address(supernode: Sequence[str]) -> str:
    """The Runtime API address of a ``flower-supernode`` command line (its ``--host`` and
    ``--port``, Flower's defaults 127.0.0.1 and 9094)."""

    def flag(name: str, default: str) -> str:
        for i, arg in enumerate(supernode):
            if arg == name and i + 1 < len(supernode):
                return supernode[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return default

    return f"{flag('--host', '127.0.0.1')}:{flag('--port', '9094')}"


def supernode_command(supernode: Sequence[str], secret_file: Path) -> list[str]:
    """The SuperNode's command line with process isolation and the executor secret.

    An ``--isolation`` already given is refused: the worker IS the executor.
    """
    if any(a == "--isolation" or a.startswith("--isolation=") for a in supernode):
        raise ValueError("give no --isolation: the worker runs the SuperNode in process mode")
    return [
        *supernode,
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        str(secret_file),
    ]


class TaskTimes:
    """Seconds of one task: pulling its input, the ClientApp, pushing the reply and output."""

    __slots__ = ("app", "pull", "push", "total")

    def __init__(self) -> None:
        self.pull = self.app = self.push = self.total = 0.0


def _retry() -> RetryInvoker:
    """Retry a Runtime API call on transport errors (the SuperNode starting or busy) for up to
    a minute; an HTTP error status is raised at once. Flower's own invoker answers a 401 by
    sending SIGINT to its process, which here would stop the whole site, not one task."""
    return RetryInvoker(
        wait_gen_factory=lambda: exponential(max_delay=2),
        recoverable_exceptions=(httpx.TransportError,),
        max_tries=None,
        max_time=_RETRY_S,
    )


PULL_BACKOFF_S = (0.01, 0.2)
"""First and largest wait (s) between tries to pull an object of the task's message that the
SuperNode has not stored yet (Flower's ``flwr-clientapp`` waits 1 s, then up to 10 s)."""


def pull_task_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run, Fab]:
    """The task's message, context, run and app bundle, as Flower's ``pull_task_input`` (same
    calls, same order) with a short pull backoff.

    The SuperNode makes the task before it has pulled the message's objects from the
    SuperLink; Flower's own executor starts a process (seconds) before asking for them, while
    this worker asks within ``PULL_BACKOFF_S``: with Flower's 1 s first backoff every round
    waited about a second for objects that arrive in milliseconds (docs/benchmarks.md).
    """
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    first, cap = PULL_BACKOFF_S
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
        return_type=Message,
        initial_backoff=first,
        backoff_cap=cap,
        max_tries_per_object=None,  # bounded by Flower's PULL_MAX_TIME: a large adapter on a
    )  # slow link may take the SuperNode far more than 500 short tries to fetch
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower sets it
    return message, context, run, fab


def _runtime_client(address: str, *interceptors: Any) -> RuntimeHttpClient:
    """A plain-HTTP client of the SuperNode's loopback Runtime API with ``_retry``."""
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=True,
        root_certificates=None,
        interceptors=list(interceptors),
        retry_invoker=_retry(),
    )


def _error(message: Message, code: int) -> Message:
    return Message(Error(code=code, reason=SITE_ERROR_CODES[code]), reply_to=message)


def _installed_version() -> str:
    try:
        return metadata.version("prism-fl")
    except metadata.PackageNotFoundError:  # a source checkout that was not installed
        return ""


def _answer(app: App, message: Message, context: Context, fab_id: str, fab_version: str) -> Message:
    """The site's reply to one task: the installed ClientApp's, or a coded error."""
    if fab_id != APP_ID:
        log.error(
            "refusing a task of run %d: its app is %r, this site runs %r only; replying with "
            "error %d",
            context.run_id,
            fab_id,
            APP_ID,
            _CONFIG_ERROR,
        )
        return _error(message, _CONFIG_ERROR)
    installed = _installed_version()
    if installed and fab_version != installed:
        log.warning(
            "run %d was submitted as %s %s; this site serves it with its installed %s",
            context.run_id,
            APP_ID,
            fab_version,
            installed,
        )
    try:
        return app(message=message, context=context)
    except Exception:  # the site's app replies with codes itself; this is a last guard
        log.error("the ClientApp raised; replying with error %d", _INTERNAL_ERROR, exc_info=True)
        return _error(message, _INTERNAL_ERROR)


def run_task(address: str, token: str, app: App) -> TaskTimes:
    """Run one acquired ClientApp task in this process, as ``flwr-clientapp`` would in its own:
    heartbeat, pull the message, context and run, answer (``_answer``), push the reply and the
    task's output (status and context)."""
    times = TaskTimes()
    start = time.perf_counter()
    client = _runtime_client(
        address,
        RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
        RuntimeTokenHttpInterceptor(token),
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    context: Context | None = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        heartbeat.start()
        message, context, run, _fab = pull_task_input(client)
        times.pull = time.perf_counter() - start
        reply = _answer(app, message, context, run.fab_id, run.fab_version)
        times.app = time.perf_counter() - start - times.pull
        push_message(client, reply, context)
        if not reply.has_error():
            status, details = SubStatus.COMPLETED, ""
    except Exception:  # the Runtime API failed: nothing to reply to; the SuperNode times out
        log.error("task failed outside the ClientApp", exc_info=True)
    finally:
        try:
            push_task_output(client=client, context=context, sub_status=status, details=details)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
    times.total = time.perf_counter() - start
    times.push = times.total - times.pull - times.app
    return times


def serve(
    address: str,
    app: App,
    *,
    secret: bytes,
    poll: float = DEFAULT_POLL_S,
    stop: threading.Event | None = None,
    supernode: subprocess.Popen[bytes] | None = None,
    max_tasks: int | None = None,
) -> int:
    """Acquire ClientApp tasks from the Runtime API at ``address`` and run each in-process,
    until ``stop`` is set, ``supernode`` exits (its code is returned) or ``max_tasks`` ran."""
    stop = stop or threading.Event()
    client = _runtime_client(
        address,
        RuntimeVersionHttpInterceptor(component_name="SuperExec"),
        SuperExecAuthHttpInterceptor(
            master_secret=secret, protected_methods={"/flwr.proto.Runtime/AcquireTask"}
        ),
    )
    done = 0
    try:
        while not stop.is_set():
            if supernode is not None and supernode.poll() is not None:
                log.error("the SuperNode exited with code %d", supernode.returncode)
                return int(supernode.returncode)
            try:
                res = client.AcquireTask(
                    AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
                )
            except httpx.HTTPError as exc:  # SuperNode restarting: try again while it lives
                log.warning("AcquireTask failed (%s); retrying", type(exc).__name__)
                stop.wait(1.0)
                continue
            if not (res.HasField("task") and res.token):
                stop.wait(poll)
                continue
            times = run_task(address, res.token, app)
            done += 1
            log.info(
                "task %d of run %d: %.3f s (pull %.3f, ClientApp %.3f, push %.3f)",
                res.task.task_id,
                res.task.run_id,
                times.total,
                times.pull,
                times.app,
                times.push,
            )
            if max_tasks is not None and done >= max_tasks:
                break
    finally:
        client.close()
    return 0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the SuperNode gets SIGTERM if the worker dies (no orphaned SuperNode)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m client.worker -- flower-supernode ARGS...``: start the SuperNode in process
    isolation with a fresh executor secret, then serve its tasks (``serve``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or not re.search(r"flower-supernode$", args[0]):
        print("usage: python -m client.worker -- flower-supernode [ARGS...]", file=sys.stderr)
        return 2
    setup_logging()
    try:
        poll = poll_seconds()
    except ValueError as exc:
        print(f"prism-fl worker: {exc}", file=sys.stderr)
        return 2
    from client.app import app  # the installed ClientApp; imports torch & co. once, here

    secret = os.urandom(32)
    with tempfile.TemporaryDirectory(prefix="prism-worker-") as folder:  # mode 0700
        secret_file = Path(folder) / "superexec.secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        try:
            command = supernode_command(args, secret_file)
        except ValueError as exc:
            print(f"prism-fl worker: {exc}", file=sys.stderr)
            return 2
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> Any:
            del frame
            log.info("signal %d: stopping the SuperNode and the worker", signum)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        supernode = subprocess.Popen(command, preexec_fn=_die_with_parent)
        log.info("SuperNode started (pid %d); serving its ClientApp tasks here", supernode.pid)
        try:
            return serve(
                runtime_address(args), app, secret=secret, poll=poll, stop=stop, supernode=supernode
            )
        finally:
            _stop_process(supernode)


if __name__ == "__main__":
    sys.exit(main())
