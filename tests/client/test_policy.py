"""A site's policy (client.policy) on its own, without a model: what it refuses, at the edges.

The site-level behaviour (a refusal charges nothing, the reply carries the code) is in
``test_site.py``; here every rule of ``SitePolicy.refusal``, the reproducible-mode seeds and
``site_policy``'s defaults are checked at their boundaries (mutation testing, docs/testing.md).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from client.policy import (
    RNG_SECRET_ENV,
    SIMULATION_DELTA,
    SIMULATION_EPSILON_CAP,
    SitePolicy,
    delta_below_one_over_n,
    site_policy,
)
from prism_runtime.config import (
    DEFAULT_MAX_RECORDS_PER_USER,
    RunConfig,
    SiteConfig,
    parse_config,
)
from prism_runtime.errors import ConfigError
from prism_runtime.protocol import REFUSAL_REASONS, RNG_REPRODUCIBLE, RNG_SECURE
from prism_runtime.ranges import MAX_RECORDS_PER_USER_MAX

SECRET = "policy-test-secret"
N = 100  # the site's examples: a delta must be below 1/N = 0.01


def _policy(**overrides: object) -> SitePolicy:
    values: dict[str, object] = {
        "site_id": "site-a",
        "simulation": False,
        "epsilon_cap": 3.0,
        "delta": 1e-3,
        "state_dir": Path("/state"),
        "allow_nondp": False,
        "allow_nonprivate_metrics": False,
    }
    return SitePolicy(**{**values, **overrides})  # type: ignore[arg-type]


def _run(**values: object) -> RunConfig:
    values = {"batch-size": 64} | values  # an expected batch the site's N examples can give
    return parse_config(RunConfig, values, what="run config")  # type: ignore[no-any-return]


def _node(**values: object) -> SiteConfig:
    return parse_config(SiteConfig, values, what="node config")  # type: ignore[no-any-return]


# -- refusal: each rule at its boundary --------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"target-epsilon": 3.0, "delta": 1e-3}, None),  # exactly the site's values
        ({"target-epsilon": 3.0000001, "delta": 1e-3}, "epsilon-above-site-cap"),
        ({"target-epsilon": 3.0, "delta": 1.0001e-3}, "delta-above-site-policy"),
        ({"target-epsilon": 0.5, "delta": 1e-6}, None),  # stricter than the policy
    ],
)
def test_the_cap_and_delta_are_honoured_up_to_and_including_the_sites_values(request_, code):
    assert _policy().refusal(_run(**request_), N) == code
    assert code is None or code in REFUSAL_REASONS


def test_delta_must_be_strictly_below_one_over_n():
    lenient = _policy(delta=0.5)  # the site's own delta would allow it
    assert lenient.refusal(_run(delta=1.0 / N), N) == "delta-not-below-1/n"
    assert lenient.refusal(_run(delta=0.99 / N), N) is None
    assert lenient.refusal(_run(delta=0.99 / N), 102) == "delta-not-below-1/n"  # 1/102 < 0.0099


def test_the_site_and_prism_train_apply_one_delta_rule(monkeypatch, tmp_path, capsys):
    """``delta < 1/N`` is one function: the site's refusal and prism-train's error follow it."""
    import client.cli
    import client.policy

    assert not delta_below_one_over_n(1.0 / N, N) and delta_below_one_over_n(0.99 / N, N)
    run = _run(delta=0.99 / N)
    assert _policy(delta=0.5).refusal(run, N) is None
    monkeypatch.setattr(client.policy, "delta_below_one_over_n", lambda delta, n: False)
    monkeypatch.setattr(client.cli, "delta_below_one_over_n", lambda delta, n: False)
    assert _policy(delta=0.5).refusal(run, N) == "delta-not-below-1/n"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(f'{{"text": "t{i}", "label": {i % 2}}}\n' for i in range(N)))
    args = ["--model", "unused", "--data", str(train), "--epsilon", "3", "--delta", "1e-9"]
    assert client.cli.main(args) == client.cli.EXIT_CONFIG_ERROR
    assert "--delta=1e-09 is not below 1/N" in capsys.readouterr().err


def test_an_expected_batch_larger_than_the_sites_data_is_refused_whatever_the_method():
    assert _policy().refusal(_run(**{"batch-size": N}), N) is None  # q = 1: every example
    for method in ("prism", "nondp"):
        run = _run(method=method, **{"batch-size": N + 1})
        assert _policy(allow_nondp=True).refusal(run, N) == "batch-above-site-data"


def test_nondp_runs_only_where_the_site_allows_them_and_skip_the_dp_checks():
    nondp = _run(method="nondp", **{"target-epsilon": 1e6, "delta": 0.9})
    assert _policy().refusal(nondp, N) == "nondp-not-allowed"
    # allowed: no DP, so the epsilon and delta requests do not apply
    assert _policy(allow_nondp=True).refusal(nondp, N) is None


def test_nonprivate_metrics_are_refused_first_unless_allowed():
    asks = {"report-train-loss": True}
    assert _policy().refusal(_run(**asks), N) == "nonprivate-metrics-not-allowed"
    assert _policy(allow_nondp=True).refusal(_run(method="nondp", **asks), N) == (
        "nonprivate-metrics-not-allowed"
    )
    allowed = _policy(allow_nonprivate_metrics=True)
    assert allowed.refusal(_run(**asks), N) is None
    # allowing metrics allows nothing else
    assert allowed.refusal(_run(**asks, **{"target-epsilon": 4.0}), N) == "epsilon-above-site-cap"
    assert allowed.refusal(_run(method="nondp", **asks), N) == "nondp-not-allowed"


# -- randomness: the OS by default, seeds from the site's secret in reproducible mode ----------


def test_without_a_secret_every_release_draws_from_the_os():
    policy = _policy()
    assert policy.rng == RNG_SECURE
    assert policy.round_seed(1, 0) is None and policy.round_seed(7, 3) is None


def test_reproducible_seeds_are_the_documented_hmac_of_site_round_and_position():
    policy = _policy(rng_secret=SECRET.encode())
    assert policy.rng == RNG_REPRODUCIBLE
    seeds = {}
    for site in ("site-a", "site-b"):
        for server_round in (1, 2):
            for attempt in (0, 1):
                mac = hmac.new(
                    SECRET.encode(), f"{site}:{server_round}:{attempt}".encode(), hashlib.sha256
                ).digest()
                seed = _policy(site_id=site, rng_secret=SECRET.encode()).round_seed(
                    server_round, attempt
                )
                assert seed == int.from_bytes(mac[:8], "little") >> 1
                assert seed is not None and 0 <= seed < 2**63  # a non-negative int64
                seeds[(site, server_round, attempt)] = seed
    assert len(set(seeds.values())) == len(seeds)  # another site, round or charge: other draws
    other = _policy(rng_secret=b"another secret").round_seed(1, 0)
    assert other != seeds[("site-a", 1, 0)]


def test_the_secret_never_appears_in_the_policys_repr():
    assert SECRET not in repr(_policy(rng_secret=SECRET.encode()))


# -- site_policy: resolving the node config ----------------------------------------------------


def test_a_deployed_site_keeps_exactly_what_its_node_config_states(tmp_path):
    node = _node(
        **{
            "site-id": "hospital",
            "epsilon-cap": 2.5,
            "delta": 1e-7,
            "state-dir": str(tmp_path),
            "allow-nondp": True,
            "allow-nonprivate-metrics": True,
        }
    )
    policy = site_policy(node, run_dir="/ignored", run_id=5)
    assert policy.site_id == "hospital" and not policy.simulation
    assert (policy.epsilon_cap, policy.delta, policy.state_dir) == (2.5, 1e-7, tmp_path)
    assert policy.allow_nondp and policy.allow_nonprivate_metrics
    assert policy.rng_secret is None and policy.rng == RNG_SECURE


def test_a_simulated_site_gets_the_simulation_defaults_and_its_own_values_win(tmp_path):
    default = site_policy(_node(**{"partition-id": 2}), run_dir=str(tmp_path))
    assert default.simulation and default.site_id == "site-2"
    assert (default.epsilon_cap, default.delta) == (SIMULATION_EPSILON_CAP, SIMULATION_DELTA)
    assert default.state_dir == tmp_path / "sites" / "site-2"
    assert not default.allow_nondp and not default.allow_nonprivate_metrics
    own = site_policy(_node(**{"partition-id": 2, "epsilon-cap": 1.0, "delta": 1e-8}))
    assert (own.epsilon_cap, own.delta) == (1.0, 1e-8)
    assert own.state_dir == Path("runs") / "flwr-run-" / "sites" / "site-2"
    stated = site_policy(_node(**{"partition-id": 2, "state-dir": "/x"}), run_dir="/r")
    assert stated.state_dir == Path("/x")  # the node config's folder wins over the run-dir


def test_a_simulated_site_may_use_a_secret_the_node_config_one_first():
    node = _node(**{"partition-id": 0})
    assert site_policy(node, env_secret=SECRET).rng_secret == SECRET.encode()
    both = _node(**{"partition-id": 0, "rng-secret": "from-node"})
    assert site_policy(both, env_secret=SECRET).rng_secret == b"from-node"
    assert site_policy(node, env_secret="").rng_secret is None


@pytest.mark.parametrize(
    ("node", "env", "where"),
    [
        ({"partition-id": 0, "require-secure-rng": True}, SECRET, RNG_SECRET_ENV),
        (
            {"partition-id": 0, "require-secure-rng": True, "rng-secret": SECRET},
            "",
            "node config rng-secret",
        ),
    ],
)
def test_a_site_that_requires_secure_randomness_refuses_any_secret_and_says_where(node, env, where):
    with pytest.raises(ConfigError) as info:
        site_policy(_node(**node), env_secret=env)
    message = str(info.value)
    assert f"site 'site-0': {where} asks for reproducible randomness" in message
    assert f"remove the secret ({where})" in message and "require-secure-rng=false" in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("node", "missing"),
    [
        ({"site-id": "h"}, "epsilon-cap, delta, state-dir"),
        ({"site-id": "h", "epsilon-cap": 2.0, "delta": 1e-6}, "state-dir"),
        ({"site-id": "h", "epsilon-cap": 2.0, "state-dir": "/s"}, "delta"),
        ({"site-id": "h", "delta": 1e-6, "state-dir": "/s"}, "epsilon-cap"),
        # a data file makes a site deployed even with a partition id
        ({"partition-id": 0, "data-path": "/d.jsonl"}, "epsilon-cap, delta, state-dir"),
    ],
)
def test_a_deployed_site_without_its_cap_delta_or_state_dir_does_not_start(node, missing):
    with pytest.raises(ConfigError) as info:
        site_policy(_node(**node), run_dir="/run")
    message = str(info.value)
    name = node.get("site-id", "site-0")
    assert f"node config of deployed site '{name}' lacks {missing}: " in message
    assert "--node-config" in message  # and where to set them


def test_a_deployed_site_refuses_a_secret_by_default_and_only_an_explicit_opt_out_allows_it(
    tmp_path,
):
    deployed = {"site-id": "h", "epsilon-cap": 2.0, "delta": 1e-6, "state-dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="require-secure-rng is true"):
        site_policy(_node(**deployed), env_secret=SECRET)
    assert site_policy(_node(**deployed)).rng == RNG_SECURE  # no secret: fine
    opted_out = site_policy(_node(**deployed, **{"require-secure-rng": False}), env_secret=SECRET)
    assert opted_out.rng == RNG_REPRODUCIBLE and opted_out.rng_secret == SECRET.encode()


def test_the_cache_folder_is_the_node_configs_then_the_envs_then_under_the_state_dir(tmp_path):
    """The site's cache folder comes from its own settings, never from the run config."""
    state = {"site-id": "h", "epsilon-cap": 2.0, "delta": 1e-7, "state-dir": str(tmp_path)}
    stated = _node(**state, **{"cache-dir": "/node/cache"})
    assert site_policy(stated, env_cache_dir="/env/cache").cache_dir == Path("/node/cache")
    assert site_policy(_node(**state), env_cache_dir="/env/cache").cache_dir == Path("/env/cache")
    assert site_policy(_node(**state), run_dir="/run").cache_dir == tmp_path / "cache"


# -- secure aggregation: the site's own H and policy -------------------------------------------


SECURE = {"secure-aggregation": True, "min-honest-sites": 4, "sites-per-round": 8}


@pytest.mark.parametrize(
    ("simulation", "own", "expected"),
    [
        (False, None, 1),  # a deployed site that sets nothing counts on itself alone
        (False, 2, 2),  # never more than its own H, whatever the run asks
        (False, 6, 4),  # nor more than the run asks
        (True, None, 4),  # a simulated site that sets nothing follows the run
        (True, 3, 3),
    ],
)
def test_a_site_counts_on_at_most_its_own_honest_sites(
    simulation: bool, own: int | None, expected: int
) -> None:
    policy = _policy(simulation=simulation, min_honest_sites=own)
    assert policy.honest_sites(_run(**SECURE)) == expected


@pytest.mark.parametrize(
    ("simulation", "own", "run_graph", "expected"),
    [
        (False, None, "sparse", False),  # deployed: complete unless its node config says sparse
        (False, "sparse", "sparse", True),
        (False, "sparse", "complete", True),  # accepts one; a complete run sends none
        (True, None, "sparse", True),  # simulated: the run's
        (True, None, "complete", False),
        (True, "complete", "sparse", False),  # its own node config wins
    ],
)
def test_a_site_accepts_a_sparse_masking_graph_only_if_its_node_config_says_so(
    simulation: bool, own: str | None, run_graph: str, expected: bool
) -> None:
    policy = _policy(simulation=simulation, secure_graph=own)
    assert policy.sparse_graph(_run(**SECURE, **{"secure-graph": run_graph})) is expected


@pytest.mark.parametrize(
    ("own", "dropouts", "code"),
    [
        (4, 3, None),  # D = H - 1: the largest D a round at H = 4 allows
        (4, 4, "secure-dropouts-not-below-honest-sites"),  # refused by the config model too
        (6, 4, "secure-dropouts-not-below-honest-sites"),  # the run's H = 4 caps the site's 6
        (None, 1, "secure-dropouts-not-below-honest-sites"),  # deployed default H = 1
    ],
)
def test_a_site_tolerates_fewer_dropouts_than_the_honest_sites_it_counts_on(
    own: int | None, dropouts: int, code: str | None
) -> None:
    policy = _policy(min_honest_sites=own, secure_max_dropouts=dropouts, secure_peers=Path("/p"))
    run = _run(**SECURE)
    assert policy.refusal(run, N) == code
    if code is None:
        trust = policy.round_trust(run)
        assert (trust.honest, trust.dropouts, trust.share_divisor) == (4, 3, 1)
    else:
        assert code in REFUSAL_REASONS
        with pytest.raises(ConfigError, match="keep D below H"):
            policy.round_trust(run)


@pytest.mark.parametrize(
    ("node", "allowed"),
    [
        ({"secure-max-dropouts": 1, "min-honest-sites": 2}, True),
        ({"secure-max-dropouts": 2, "min-honest-sites": 2}, False),
        ({"secure-max-dropouts": 1, "state-dir": "/s"}, False),  # deployed: H defaults to 1
        ({"secure-max-dropouts": 1, "partition-id": 0}, True),  # simulated: the run's H
        ({}, True),
    ],
)
def test_the_node_config_refuses_dropouts_not_below_its_honest_sites(
    node: dict[str, object], allowed: bool
) -> None:
    if allowed:
        config = _node(**{"partition-id": 0, **node})
        assert site_policy(config).secure_max_dropouts == node.get("secure-max-dropouts", 0)
    else:
        with pytest.raises(ConfigError, match=r"secure-max-dropouts=.* is not below"):
            _node(**node)


@pytest.mark.parametrize(
    ("setting", "secure_run", "peers", "code"),
    [
        ("allow", True, Path("/peers"), None),
        ("allow", False, None, None),
        ("off", True, Path("/peers"), "secure-aggregation-off"),
        ("off", False, None, None),
        ("require", False, Path("/peers"), "secure-aggregation-required"),
        ("require", True, Path("/peers"), None),
        ("allow", True, None, "secure-aggregation-not-configured"),  # deployed, nothing pinned
    ],
)
def test_the_site_decides_whether_it_takes_part_in_secure_aggregation(
    setting: str, secure_run: bool, peers: Path | None, code: str | None
) -> None:
    policy = _policy(secure_aggregation=setting, secure_peers=peers)
    run = _run(**(SECURE if secure_run else {}))
    assert policy.refusal(run, N) == code
    assert code is None or code in REFUSAL_REASONS


# -- the records of one person per step: the site's bound --------------------------------------


@pytest.mark.parametrize(
    ("simulation", "own", "asked", "k"),
    [
        (False, None, 50, DEFAULT_MAX_RECORDS_PER_USER),  # deployed, none set: the default bounds
        (False, None, 2, 2),  # the run may lower it
        (False, 8, 20, 8),  # the site's own bound
        (False, 8, 8, 8),
        (False, 8, 3, 3),
        (True, None, 50, 50),  # simulated, none set: follows the run
        (True, 6, 50, 6),
    ],
)
def test_the_run_may_lower_a_persons_records_per_step_never_raise_them(simulation, own, asked, k):
    policy = _policy(simulation=simulation, max_records_per_user=own)
    assert policy.records_per_user(_run(**{"max-records-per-user": asked})) == k


def test_the_node_config_sets_the_sites_bound_within_the_accepted_range():
    config = _node(**{"partition-id": 0, "num-partitions": 1, "max-records-per-user": 7})
    assert site_policy(config).max_records_per_user == 7
    for bad in (0, MAX_RECORDS_PER_USER_MAX + 1):
        with pytest.raises(ConfigError, match="max-records-per-user"):
            _node(**{"max-records-per-user": bad})
