"""Mutation testing of the privacy-critical modules with mutmut, each against its own tests.

``make mutation`` (not part of ``make test``; CI does not run it) calls this script. For every
module named on the command line (default: all of ``MODULES``, in that order) it makes a fresh
working copy ``.mutation/<name>/`` of the packages, the tests and ``pyproject.toml``, writes a
``setup.cfg`` whose ``[mutmut]`` section mutates that one module and selects that module's own
fast test files, runs ``mutmut run`` there (one worker by default: the machine is shared), and
prints one summary line per module (mutants, killed, survived, not covered, timeouts, run time).
The diff of every mutant that was not killed goes to ``.mutation/<name>/survivors.txt``, and the
numbers to ``.mutation/<name>/summary.json``.

A surviving mutant is either a missing test (write one that asserts a real property) or an
equivalent mutant (same behaviour as the original); ``EQUIVALENT`` lists the equivalent ones
with the reason. Mutants that only change the
case of a string or wrap it in ``XX`` (error-message text that keeps every word) are counted
apart as "message text". The script exits 1 when any other mutant survived.

Usage: ``python tests/mutation.py [--jobs N] [--resume] [NAME ...]`` with NAME from ``MODULES``, or
``NAME:FILE`` to mutate one file of a package target (``strategy:charges.py``) against the same
tests, in its own working copy ``.mutation/NAME-FILE/`` (a long run can be done file by file).
``--resume`` continues a stopped run in its working copy; ``--recheck TEST_FILE ...`` applies
each unexplained survivor of a finished run and runs those test files against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"
MUTMUT = Path(sys.executable).parent / "mutmut"
PACKAGES = ("prism_core", "prism_runtime", "client", "server", "deploy")
COPIED = (*PACKAGES, "bench", "tests", "pyproject.toml")
RECHECK_TIMEOUT_S = 300
"""``--recheck``: the longest one mutant's test run may take (a hang counts as not killed)."""
NOT_KILLED = ("survived", "no tests", "timeout", "suspicious", "segfault", "skipped")


@dataclass(frozen=True)
class Target:
    """One module to mutate and the test files that are its own."""

    source: str
    tests: tuple[str, ...]


MODULES: dict[str, Target] = {
    "mechanism": Target("prism_core/mechanism.py", ("tests/prism_core/test_mechanism.py",)),
    "accounting": Target("prism_core/accounting.py", ("tests/prism_core/test_accounting.py",)),
    "policy": Target("client/policy.py", ("tests/client/test_policy.py",)),
    "site_ledger": Target("client/site_ledger.py", ("tests/client/test_site_ledger.py",)),
    "aggregation": Target("prism_core/aggregation.py", ("tests/prism_core/test_aggregation.py",)),
    "strategy": Target(
        "server/strategy/*.py",
        (
            "tests/server/test_strategy.py",  # the whole strategy, with the hostile-reply fuzz
            # one test module per product module of the strategy
            "tests/server/strategy/test_aggregator.py",
            "tests/server/strategy/test_binding.py",
            "tests/server/strategy/test_bounds.py",
            "tests/server/strategy/test_charges.py",
            "tests/server/strategy/test_core.py",
            "tests/server/strategy/test_intake.py",
            "tests/server/strategy/test_loop.py",
            "tests/server/strategy/test_replies.py",
            "tests/server/strategy/test_rounds.py",
            "tests/server/strategy/test_selection.py",
            "tests/server/strategy/test_transport.py",
            # the strategy's other fast test files (not test_resume.py, whose SIGKILL test
            # takes a minute)
            "tests/server/test_federation.py",
            "tests/server/test_report.py",  # a reproducible-rng site through the strategy
        ),
    ),
    "ledger": Target(
        "server/ledger/*.py",
        (
            "tests/server/ledger/test_budget.py",
            "tests/server/ledger/test_checks.py",
            "tests/server/ledger/test_events.py",
            "tests/server/ledger/test_schema.py",
            "tests/server/ledger/test_store.py",
            "tests/runtime/test_faults.py",  # the ledger-write crash point
        ),
    ),
}

EQUIVALENT: dict[str, dict[str, str]] = {
    "mechanism": {
        **{
            f"prism_core.mechanism.x_{fn}__mutmut_{i}": "zip strict over sequences of equal "
            "length by construction (checked just before, or the groups, stacked frames and "
            "points of one StepFrames, or the fields of one moments tuple)"
            for fn, numbers in (
                ("_check_grads", (6, 9, 10)),
                ("per_example_norms_sq", (14, 17, 18)),
                ("_min_norm_modules", (5, 8, 9)),
                ("_module_noise", (6, 10, 11)),
                ("retract_modules", (7, 10, 11)),
                ("_chunks", (4, 8, 9)),
            )
            for i in numbers
        },
        **{
            f"prism_core.mechanism.x_{fn}__mutmut_{i}": "the frame recomputed from the same "
            "stacked point: the same values (point_frame is deterministic), only slower"
            for fn, numbers in (("_module_noise", (16, 20)), ("clip_and_sum_grads", (65, 70)))
            for i in numbers
        },
        **{
            f"prism_core.mechanism.x_{fn}__mutmut_{i}": "a cast to the dtype the tensor already "
            "has: alpha is computed from the points and gradients, so its dtype is already "
            "the promotion of all of them"
            for fn, numbers in (("clip_and_sum", (21, 22, 25)),)
            for i in numbers
        },
        **{
            f"prism_core.mechanism.x_privatize__mutmut_{i}": "noise drawn at sigma = 0 and "
            "multiplied by 0: the same release (only the generator advances)"
            for i in (20, 27, 54)
        },
        **{
            f"prism_core.mechanism.x_{fn}__mutmut_{i}": "device=None is the CPU: the same "
            "here; on CUDA the gpu-marked tests run the head and tangent noise"
            for fn, numbers in (("privatize", (62,)), ("tangent_noise", (16, 26)))
            for i in numbers
        },
        **{
            f"prism_core.mechanism.x_tangent_noise__mutmut_{i}": "a cast of the frame to the "
            "dtype it already has: point_frame(A, B) is built in work_dtype(A, B)"
            for i in (33, 37, 39)
        },
        "prism_core.mechanism.x__chunks__mutmut_31": "a stack's size is a multiple of 4 bytes, "
        "so max(size, 1) and max(size, 2) differ only at size 0 (no examples), where both "
        "widths exceed any group",
        "prism_core.mechanism.x__accumulate__mutmut_49": "without Euclidean tensors the "
        "coefficients are (alpha, alpha): the same count",
        "prism_core.mechanism.x_clip_coefficients__mutmut_6": "list() of an (L, b) tensor "
        "unbinds its rows and torch.stack rebuilds the same tensor",
        "prism_core.mechanism.x_privatize__mutmut_68": "the head noise subtracted: the "
        "Gaussian is symmetric, the same mechanism",
        "prism_core.mechanism.x_privatize__mutmut_80": "mechanism= dropped: the record's "
        "default is the same name (DEFAULT_MECHANISM)",
    },
    "aggregation": {
        **{
            f"prism_core.aggregation.x_aggregate_noise_std__mutmut_{i}": "zip strict after an "
            "explicit length check"
            for i in (10, 13, 14)
        },
        "prism_core.aggregation.x_aggregation_weights__mutmut_64": "precision 2/s^2 for 1/s^2: "
        "normalised away, exactly (a power-of-two factor)",
    },
    "ledger": {
        **{
            f"server.ledger.budget.x_epsilon_points__mutmut_{i}": "None for False: the same "
            "falsy start of a round"
            for i in (3, 27)
        },
        **{
            f"server.ledger.checks.x_check_header__mutmut_{i}": "int.from_bytes defaults to "
            "big-endian (Python >= 3.11)"
            for i in (29, 41)
        },
        "server.ledger.checks.x_check_header__mutmut_5": "the whole file read instead of its "
        "first 100 bytes: only those are sliced",
        **{
            f"server.ledger.checks.x_{fn}__mutmut_{i}": "the uri flag: this SQLite "
            "(SQLITE_USE_URI) reads a file: name as a URI whatever the flag"
            for fn, numbers in (("connect", (22, 24, 25, 34, 38, 42)), ("table_names", (3, 5, 6)))
            for i in numbers
        },
        "server.ledger.checks.x_connect__mutmut_16": "an empty WAL holds no frames: 'ro' and "
        "'ro&immutable=1' read the same pages",
        "server.ledger.checks.x_connect__mutmut_17": "a WAL file is empty or at least its "
        "32-byte header: never 1 byte",
        "server.ledger.checks.x_connect__mutmut_39": "the read-only connection never writes: "
        "its isolation level only shapes implicit write transactions",
        "server.ledger.checks.x_connect__mutmut_49": "every write opens its own BEGIN "
        "IMMEDIATE: Python's implicit transactions never start",
        **{
            f"server.ledger.{mod}.x_{fn}__mutmut_{i}": "zip strict over a SELECT of exactly "
            "those columns: equal length by construction"
            for mod, fn, numbers in (
                ("checks", "validate_rows", (57, 60, 63)),
                ("schema", "event_from_row", (5, 8, 9)),
            )
            for i in numbers
        },
        "server.ledger.schema.x_create_ledger__mutmut_12": "isolation_level left at Python's "
        "legacy default: the one transaction is an explicit BEGIN IMMEDIATE, inside which no "
        "implicit BEGIN is added, and the two PRAGMAs run before it, outside any transaction",
        "server.ledger.checks.x_validate_rows__mutmut_47": "not reached: the "
        "SELECT could fail before its first row only on a missing column, which "
        "validate_ledger now refuses before validate_rows runs",
        **{
            f"server.ledger.checks.x_connect__mutmut_{i}": "not reached here: PRAGMA "
            "journal_mode = WAL failing or answering another mode needs a file system without "
            "shared memory or a lock held past the 30 s busy time-out (root reads every file)"
            for i in (64, 69, 70, 71, 72, 73, 74)
        },
        "server.ledger.store.xǁLedgerǁrecord_run__mutmut_8": "allow_nan=None is falsy: json "
        "still refuses NaN",
        "server.ledger.store.xǁLedgerǁ__init____mutmut_7": "None for False: the same falsy "
        "'not closed'",
    },
    "strategy": {
        **{
            f"server.strategy.aggregator.xǁStreamingAggregatorǁ__init____mutmut_{i}": "an "
            "initial value (broadcast, sums, noise list None) that begin_round replaces before "
            "anything reads it: the strategy begins every round before adding a reply"
            for i in (8, 9, 12)
        },
        "server.strategy.aggregator.xǁStreamingAggregatorǁ_apply_checked__mutmut_1": "reason "
        "None for '': only its truth value is read before a reason is set",
        **{
            f"server.strategy.aggregator.xǁStreamingAggregatorǁ_apply_checked__mutmut_{i}": "qr "
            "without mode='r': the reduced mode's R (the [1] taken) is the same matrix; 'r' "
            "only skips computing Q"
            for i in (50, 58)
        },
        "server.strategy.aggregator.xǁStreamingAggregatorǁ_apply_checked__mutmut_68": ">= for "
        "> in s_r > 1e-6 s_1: differs only when s_r equals 1e-6 s_1 exactly in float64",
        **{
            f"server.strategy.aggregator.xǁStreamingAggregatorǁweight__mutmut_{i}": "2 for 1 "
            "(uniform, or non-DP) or 2 / s^2 for 1 / s^2: every weight of a round is scaled "
            "alike, and the sums are divided by the total weight (exact: a factor of two)"
            for i in (4, 13, 17)
        },
        **{
            f"server.strategy.transport.x__push__mutmut_{i}": "the default of node.get (None, "
            "none or 1 for 0) is never used: every id push_messages returns is the message_id "
            "the grid set on one of the pushed messages"
            for i in (21, 23, 24)
        },
        **{
            f"server.strategy.transport.x_stream_replies__mutmut_{i}": "arrived = 1, -= 1 or += 2 "
            "for += 1: the count is read only as a truth value (did this pass find a reply)"
            for i in (42, 43, 44)
        },
        **{
            f"server.strategy.binding.xǁSiteBindingǁ__init____mutmut_{i}": "an initial value "
            "(the nonce None, the connected set None) that ask() replaces before check_origin "
            "can read it: check_origin refuses every node as not-asked until ask() ran"
            for i in (3, 5)
        },
        **{
            f"server.strategy.replies.xǁRunTermsǁ_check_clip__mutmut_{i}": "the default of "
            "max-norm's lookup (nan -> None or none): a DP reply without max-norm is rejected "
            "by check() before _check_clip, and the coordinator makes an AutoClip for DP "
            "methods only (AutoClip.for_run)"
            for i in (41, 43)
        },
        "server.strategy.bounds.xǁUpdateBoundǁfor_sites__mutmut_16": "bias_correction= dropped: "
        "the sites' transform always corrects its moments (AdaptiveSettings has no switch), "
        "the field's default",
        "server.strategy.bounds.xǁUpdateBoundǁfor_sites__mutmut_18": "head_betas= dropped: the "
        "field's default is the same ADAMW_BETAS",
        "server.strategy.bounds.xǁUpdateCheckerǁsgd_bound__mutmut_44": "None for [] as the "
        "points of round_update_norm_bound's sgd branch, which never reads them",
        **{
            f"server.strategy.bounds.xǁUpdateCheckerǁcheck_norm__mutmut_{i}": ">= for > at a "
            "float64 threshold (bound x (1 + slack) + slack) that no float32 update's norm "
            "equals but by chance: the verdicts differ on a set of measure zero"
            for i in (14, 87, 106)
        },
        **{
            f"server.strategy.bounds.xǁUpdateCheckerǁ{fn}__mutmut_{i}": "zip strict over "
            "sequences of equal length by construction (two 2-tuples; the modules and their "
            "bounds)"
            for fn, numbers in (
                ("expected_update_keys", (20, 23, 28)),
                ("_set_bounds", (114, 117, 118)),
            )
            for i in numbers
        },
        **{
            f"server.strategy.bounds.xǁUpdateCheckerǁ__init____mutmut_{i}": "an initial value "
            "begin_round overwrites before any read (validate and check_norm need a round)"
            for i in (3, 4, 5)
        },
        "server.strategy.bounds.xǁUpdateCheckerǁ_set_bounds__mutmut_30": "None for 0 as an SGD "
        "head's size: both falsy wherever it is read",
        "server.strategy.bounds.xǁUpdateCheckerǁ_set_bounds__mutmut_133": "an SGD head's AdamW "
        "bound in factor-average mode: check_norm replaces it by the head's own SGD bound",
    },
    "accounting": {
        "prism_core.accounting.x_max_steps__mutmut_15": "< for <= against the target: differs "
        "only at exact float equality of two PRV estimates, which no input was found to produce",
        "prism_core.accounting.x_calibrate_noise_multiplier__mutmut_41": "simplefilter('ignore')"
        " for every warning class, not only UserWarning: only warnings, inside that call",
        "prism_core.accounting.x_calibrate_noise_multiplier__mutmut_58": "eps_error not passed: "
        "Opacus' PRV default is the same 0.01",
    },
    "site_ledger": {
        **{
            f"client.site_ledger.xǁSiteLedgerǁ_parse__mutmut_{i}": "the unterminated flag of a "
            "torn file is never read (a torn last line is truncated, not completed)"
            for i in (22, 26, 35, 39)
        },
    },
}
"""Per module, surviving mutants that are equivalent (same behaviour), with the reason. Mutmut
names mutants by function and position, so a change of
the module renumbers them: rerun and re-check after editing a module."""


def _setup_cfg(target: Target) -> str:
    def block(values: tuple[str, ...]) -> str:
        return "".join(f"\n    {v}" for v in values)

    return (
        "[mutmut]\n"
        f"source_paths ={block(PACKAGES)}\n"
        f"only_mutate ={block((target.source,))}\n"
        f"pytest_add_cli_args_test_selection ={block(target.tests)}\n"
        "also_copy =\n    bench\n"
        # torch is not fork-safe after pytest ran: fork each worker from a clean server
        "process_isolation = forkserver\n"
        "use_git_change_detection = false\n"
    )


def _prepare(name: str, target: Target) -> Path:
    """A fresh working copy for one module (any earlier one is removed)."""
    work = WORK / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for item in COPIED:
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, work / item, ignore=ignore)
        else:
            shutil.copy2(source, work / item)
    (work / "setup.cfg").write_text(_setup_cfg(target))
    return work


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the mutated copy, never the checkout, must be imported
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
    )
    return env


def _mutmut(work: Path, *args: str, log: Path | None = None) -> str:
    """Run one mutmut command in ``work``; its output (also written to ``log``)."""
    done = subprocess.run(
        [str(MUTMUT), *args],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    output = done.stdout + done.stderr
    if log is not None:
        log.write_text(output)
    if done.returncode != 0:
        raise SystemExit(f"mutmut {' '.join(args)} failed in {work} ({done.returncode}):\n{output}")
    return output


def _statuses(work: Path) -> dict[str, str]:
    """Every mutant's status, from ``mutmut results --all true``."""
    line = re.compile(r"^\s*(\S+): (.+)$")
    out = _mutmut(work, "results", "--all", "true")
    return {m[1]: m[2].strip() for m in map(line.match, out.splitlines()) if m}


def _changed_lines(diff: str) -> tuple[list[str], list[str]]:
    lines = diff.splitlines()
    minus = [x[1:] for x in lines if x.startswith("-") and not x.startswith("---")]
    plus = [x[1:] for x in lines if x.startswith("+") and not x.startswith("+++")]
    return minus, plus


def is_message_text(diff: str) -> bool:
    """A mutant that only re-cases a string or wraps it in ``XX`` (an error message keeps
    every word: the tests assert what a message names, not its letters' case)."""
    minus, plus = _changed_lines(diff)
    return (
        bool(minus)
        and len(minus) == len(plus)
        and all(p.replace("XX", "").lower() == m.lower() for m, p in zip(minus, plus, strict=True))
    )


def target_of(name: str) -> Target:
    """The target of ``NAME`` or of ``NAME:FILE`` (one file of a package target's glob).

    Raises:
        KeyError: for a name not in ``MODULES``, or a file not under its target's folder.
    """
    base, _, file = name.partition(":")
    target = MODULES[base]
    if not file:
        return target
    folder = Path(target.source).parent
    if "*" not in target.source or "/" in file or not (ROOT / folder / file).is_file():
        raise KeyError(name)
    return Target(str(folder / file), target.tests)


def run_module(name: str, jobs: int, *, resume: bool = False) -> dict[str, object]:
    """Mutate one module against its own tests; its summary (also in ``summary.json``).

    ``resume``: keep the working copy of a stopped run (mutmut skips every mutant it already
    has a result for) instead of making a fresh one; ``seconds`` is then this part's time.
    """
    target = target_of(name)
    base = name.partition(":")[0]
    name = name.replace(":", "-").removesuffix(".py")
    work = WORK / name
    if not (resume and (work / "setup.cfg").is_file()):
        work = _prepare(name, target)
    elif (work / "setup.cfg").read_text() != _setup_cfg(target):
        raise SystemExit(f"{work} was made for other tests: run again without --resume")
    else:
        print(f"[{name}] resuming the run in {work}", flush=True)
    print(f"[{name}] mutmut run: {target.source} against {', '.join(target.tests)}", flush=True)
    start = time.monotonic()
    _mutmut(work, "run", "--max-children", str(jobs), log=work / "run.log")
    seconds = time.monotonic() - start
    statuses = _statuses(work)
    not_killed = sorted(k for k, v in statuses.items() if v in NOT_KILLED)
    diffs = {k: _mutmut(work, "show", k) for k in not_killed}
    message_text = [k for k in not_killed if is_message_text(diffs[k])]
    equivalent = EQUIVALENT.get(base, {})
    unexplained = [k for k in not_killed if k not in message_text and k not in equivalent]
    with (work / "survivors.txt").open("w") as out:
        for mutant in unexplained:
            out.write(diffs[mutant] + "\n")
        for mutant in sorted(equivalent.keys() & set(not_killed)):
            out.write(f"# equivalent: {equivalent[mutant]}\n{diffs[mutant]}\n")
        for mutant in message_text:
            out.write(f"# message text only\n{diffs[mutant]}\n")
    summary: dict[str, object] = {
        "module": target.source,
        "tests": list(target.tests),
        "mutants": len(statuses),
        "killed": sum(v == "killed" for v in statuses.values()),
        "survived": sum(v == "survived" for v in statuses.values()),
        "no_tests": sum(v == "no tests" for v in statuses.values()),
        "timeout": sum(v == "timeout" for v in statuses.values()),
        "other": sorted({v for v in statuses.values()} - {"killed", "survived", "no tests"}),
        "not_killed": not_killed,
        "message_text": message_text,
        "equivalent": sorted(equivalent.keys() & set(not_killed)),
        "unexplained": unexplained,
        "seconds": round(seconds),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"[{name}] {summary['mutants']} mutants: {summary['killed']} killed, "
        f"{summary['survived']} survived, {summary['no_tests']} not covered, "
        f"{summary['timeout']} timeouts; {len(message_text)} message-text and "
        f"{len(summary['equivalent'])} equivalent (listed); {len(unexplained)} unexplained; "
        f"{seconds / 60:.1f} min (survivors: {work / 'survivors.txt'})",
        flush=True,
    )
    return summary


def recheck(name: str, tests: list[str], jobs: int) -> dict[str, bool]:
    """Apply every unexplained survivor of a finished run (``summary.json``) and run ``tests``
    against it in the run's mutated copy (mutmut's ``MUTANT_UNDER_TEST``), ``jobs`` at a time:
    how a test written for the survivors is checked without a new run. The test files are
    copied into the copy first. Returns (and writes to ``recheck.json``) mutant -> killed."""
    from concurrent.futures import ThreadPoolExecutor

    work = WORK / name.replace(":", "-").removesuffix(".py")
    mutants = work / "mutants"
    unexplained = json.loads((work / "summary.json").read_text())["unexplained"]
    for test in tests:
        shutil.copy2(ROOT / test, mutants / test)

    def killed(mutant: str) -> bool:
        try:
            done = subprocess.run(
                [
                    str(Path(sys.executable).parent / "pytest"),
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    *tests,
                ],
                cwd=mutants,
                env={**_env(), "MUTANT_UNDER_TEST": mutant, "PYTHONPATH": str(mutants)},
                capture_output=True,
                text=True,
                check=False,
                timeout=RECHECK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:  # a hang is not a failing test: not killed
            print(f"[{name}] recheck: {mutant} ran past {RECHECK_TIMEOUT_S} s", flush=True)
            return False
        return done.returncode not in (0, 5)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        result = dict(zip(unexplained, pool.map(killed, unexplained), strict=True))
    (work / "recheck.json").write_text(json.dumps({"tests": tests, "killed": result}, indent=1))
    alive = [m for m, k in result.items() if not k]
    print(f"[{name}] recheck: {len(result) - len(alive)} of {len(result)} killed; alive: {alive}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the named modules one after the other; 1 if any mutant survived unexplained."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", metavar="NAME", help=f"of {', '.join(MODULES)}")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1)")
    parser.add_argument(
        "--recheck",
        nargs="+",
        metavar="TEST_FILE",
        help="apply each unexplained survivor of the named module's last run and run these "
        "test files against it (a test written for the survivors, checked without a new run)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run in its working copy (.mutation/NAME) instead of a fresh one",
    )
    args = parser.parse_args(argv)
    if not MUTMUT.exists():
        parser.error(f"{MUTMUT} not found: install the dev extra (pip install -e '.[dev]')")
    unknown = []
    for n in args.modules:
        try:
            target_of(n)
        except KeyError:
            unknown.append(n)
    if unknown:
        parser.error(
            f"unknown module {', '.join(unknown)}; valid: {', '.join(MODULES)}, or "
            "NAME:FILE for a file of strategy or ledger (strategy:charges.py)"
        )
    names = args.modules or list(MODULES)
    if args.recheck:
        results = [recheck(name, args.recheck, args.jobs) for name in names]
        return 1 if any(not k for r in results for k in r.values()) else 0
    summaries = [run_module(name, args.jobs, resume=args.resume) for name in names]
    return 1 if any(s["unexplained"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
