"""A site's reply as the coordinator reads it (``server.strategy.replies``): its accounting
facts, every range at its edges from both sides, the code and the message of each
rejection, and the run's terms (``RunTerms``) including a private clip estimate's; the
text of an error reply (a code and its fixed text, never the site's own words) and the
fixed summation order of replies. Each threshold is tested on both sides and each message
is checked for what it names, since both are what an operator reads.

Through ``PrismStrategy.aggregate_train`` with real Flower messages and a real SQLite
ledger: an error reply's ``Error.reason`` (free text) is never logged or stored; facts
that do not match the configuration (steps, mechanism, sampling, adjacency, rng, sigma,
delta, refusal reason, a private clip or its estimate) are rejected and charged
unconfirmed; valid refusals and a non-DP run pass."""

from __future__ import annotations

import json
import logging
import math

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from reply_facts import honest_facts

from prism_core.bounds import FLOAT32_SLACK
from prism_core.records import PRIVACY_UNITS, SKELLAM_MECHANISM, SkellamShare
from prism_runtime.protocol import (
    ACCOUNTING,
    MAX_EXAMPLES,
    REFUSAL_REASONS,
    RNG_MODES,
    SITE_ERROR_CODES,
    UPDATE,
)
from prism_runtime.ranges import SIGMA_MAX, SIGMA_MIN
from server.checkpoint import Checkpoint, save_checkpoint
from server.errors import ReplyError
from server.ledger import Ledger
from server.report import build_report
from server.report_files import write_reports
from server.strategy.bounds import AutoClip
from server.strategy.replies import (
    RunTerms,
    error_reply,
    error_reply_text,
    facts_of,
    in_order,
    read_facts,
    unconfirmed_code,
)
from strategy import clip_estimate, three_sites

pytestmark = pytest.mark.usefixtures("flower_identity")


MECHANISM = "prism-tangent-gaussian"
AUTO = AutoClip(low=0.02, high=0.5, steps=3, noise_multiplier=6.4)
ESTIMATE = {"quantile_sigma": 6.4, "quantile_q": 0.05, "quantile_steps": 3}


def _read(facts: dict) -> dict:
    """The record ``read_facts`` accepts, back in wire form (its round trip)."""
    return read_facts(facts).to_record()


def _rejected(facts: dict, code: str = "facts") -> str:
    with pytest.raises(ReplyError) as info:
        read_facts(facts)
    assert info.value.code == code, str(info.value)
    return str(info.value)


def _terms(**changes) -> RunTerms:
    values = {
        "mechanism": MECHANISM,
        "dp": True,
        "local_steps": 1,
        "delta": 1e-5,
        "max_norm": 0.05,
        "expected_batch_size": 16.0,
    }
    values.update(changes)
    return RunTerms(**values)


def _mismatch(terms: RunTerms, facts: dict, code: str = "facts-mismatch") -> str:
    with pytest.raises(ReplyError) as info:
        terms.check(read_facts(facts))
    assert info.value.code == code, str(info.value)
    return str(info.value)


def test_honest_facts_pass_and_come_back_as_given():
    facts = honest_facts("a", server_round=0, num_examples=1)
    assert _read(dict(facts)) == facts


def test_unknown_facts_are_named_three_at_most():
    message = _rejected(honest_facts("a", aaa=1, bbb=2, ccc=3, ddd=4))
    assert "['aaa', 'bbb', 'ccc']" in message and "ddd" not in message


@pytest.mark.parametrize("name", ["site-id", "status", "sigma", "q", "steps"])
def test_a_missing_required_fact_is_named(name):
    facts = honest_facts("a")
    del facts[name]
    assert f"lack {name!r}" in _rejected(facts)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"sigma": "1.0"}, "accounting fact sigma='1.0' is not a number"),
        ({"q": True}, "accounting fact q=True is not a number"),
        ({"sigma": math.inf}, "accounting fact sigma=inf is not finite"),
        ({"delta": math.nan}, "accounting fact delta=nan is not finite"),
        ({"max_norm": math.inf}, "accounting fact max-norm=inf is not finite"),
        ({"steps": 1.5}, "accounting fact steps=1.5 is not an integer"),
        ({"num_examples": True}, "accounting fact num-examples=True is not an integer"),
        ({"site-id": 7}, "accounting fact site-id=7 is not a string"),
        ({"reason": 3}, "accounting fact reason=3 is not a string"),
        ({"reason": "x" * 1001}, "accounting fact reason is too long or has control characters"),
        ({"rng": "os\ncsprng"}, "accounting fact rng is too long or has control characters"),
    ],
)
def test_a_fact_of_the_wrong_type_is_named_with_its_value(change, says):
    facts = honest_facts("a")
    facts.update({k.replace("_", "-"): v for k, v in change.items()})
    assert _rejected(facts) == says


def test_the_sites_own_epsilon_may_be_infinite_and_a_1000_character_text_is_accepted():
    facts = honest_facts("a", epsilon=math.inf, reason="x" * 1000)
    assert _read(facts)["epsilon"] == math.inf


def test_site_id_from_one_to_128_characters():
    assert _read(honest_facts("s" * 128))["site-id"] == "s" * 128
    long_id = "".join(chr(ord("a") + i % 26) for i in range(129))
    message = _rejected(honest_facts(long_id))
    assert message == f"site-id {long_id[:20]!r} is empty or too long"
    assert _rejected(honest_facts("")) == "site-id '' is empty or too long"


def test_an_unknown_status_shows_its_first_20_characters():
    status = "".join(chr(ord("a") + i) for i in range(25))
    assert _rejected(honest_facts("a", status=status)) == f"unknown status {status[:20]!r}"


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({"sigma": 0.0}, True),
        ({"sigma": 1e4}, True),
        ({"sigma": 1e4 * (1 + 1e-12)}, False),
        ({"sigma": -1e-9}, False),
        ({"q": 1.0}, True),
        ({"q": 0.0}, False),
        ({"q": 1.0 + 1e-12}, False),
        ({"q": 1.5}, False),
        ({"steps": 0}, True),
        ({"steps": 10**6}, True),
        ({"steps": 10**6 + 1}, False),
        ({"steps": -1}, False),
    ],
)
def test_mechanism_parameters_at_the_edges_of_their_ranges(change, ok):
    facts = honest_facts("a", **change)
    if ok:
        assert _read(facts)
    else:
        message = _rejected(facts)
        assert message.startswith("impossible mechanism parameters sigma=")
        name, value = next(iter(change.items()))
        assert f"{name}={float(value) if name != 'steps' else value}" in message


@pytest.mark.parametrize("status", ["ok", "refused"])
def test_a_noise_multiplier_is_zero_or_in_the_range_a_site_runs(status):
    """0 (no noise: a refusal, or a non-DP method) or ``[SIGMA_MIN, SIGMA_MAX]``, whatever the
    status: a positive sigma below ``SIGMA_MIN`` is no multiplier any site runs."""
    for sigma in (0.0, SIGMA_MIN, 1.0, SIGMA_MAX):
        assert _read(honest_facts("a", status=status, sigma=sigma))["sigma"] == sigma
    for sigma in (SIGMA_MIN * (1 - 1e-12), 0.5 * SIGMA_MIN, 1e-9, 5e-324):
        assert _rejected(honest_facts("a", status=status, sigma=sigma)) == (
            f"sigma={sigma} is neither 0 (no noise) nor in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], the "
            "noise multipliers a site runs"
        )


@pytest.mark.parametrize(
    ("name", "good", "bad", "says"),
    [
        ("delta", [1e-12, 0.5, 1 - 1e-12], [0.0, 1.0, 1.5, -0.1], "is not in (0, 1)"),
        ("max_norm", [1e-12, 1e9], [0.0, -1.0, 1e9 * (1 + 1e-12)], "is not in (0, 1e+09]"),
        ("expected_batch_size", [1e-12, 1e9], [0.0, 1e9 * (1 + 1e-12)], "is not in (0, 1e+09]"),
        ("num_examples", [1, MAX_EXAMPLES], [0, MAX_EXAMPLES + 1], "is not in [1, 1e12]"),
        ("server_round", [0, 1], [-1], "is negative"),
    ],
)
def test_optional_facts_at_the_edges_of_their_ranges(name, good, bad, says):
    fact = name.replace("_", "-")
    for value in good:
        assert _read(honest_facts("a", **{name: value}))[fact] == value
    for value in bad:
        assert _rejected(honest_facts("a", **{name: value})) == f"{fact}={value!r} {says}"


def test_a_unit_is_optional_and_one_of_the_privacy_units():
    """Absent, the facts are per record (an older site); present, it must be a known unit."""
    assert "unit" not in _read(honest_facts("a"))
    for unit in PRIVACY_UNITS:
        assert _read(honest_facts("a", unit=unit))["unit"] == unit
    assert _rejected(honest_facts("a", unit="household")) == (
        "unit 'household' is not one of ['record', 'user']"
    )
    assert _rejected(honest_facts("a", unit="x" * 30)).startswith(f"unit {'x' * 20!r} is not")
    assert _rejected(honest_facts("a", unit=1)) == "accounting fact unit=1 is not a string"


def test_a_reply_without_a_server_round_is_valid():
    facts = honest_facts("a")
    assert "server-round" not in facts
    assert _read(facts) == facts


def test_clip_estimate_facts_come_all_three_or_none():
    assert _read(honest_facts("a", **ESTIMATE))
    for missing in ESTIMATE:
        partial = {k: v for k, v in ESTIMATE.items() if k != missing}
        given = [k.replace("_", "-") for k in ESTIMATE if k != missing]
        message = _rejected(honest_facts("a", **partial))
        assert message == f"clip-estimate facts {given} without the others"


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({"quantile_sigma": 0.5}, True),
        ({"quantile_sigma": SIGMA_MIN}, True),
        ({"quantile_sigma": SIGMA_MIN * (1 - 1e-12)}, False),
        ({"quantile_sigma": 1e-9}, False),
        ({"quantile_sigma": 1e8}, True),
        ({"quantile_sigma": 1e8 * (1 + 1e-12)}, False),
        ({"quantile_sigma": 0.0}, False),
        ({"quantile_q": 1.0}, True),
        ({"quantile_q": 0.0}, False),
        ({"quantile_q": 1.0 + 1e-12}, False),
        ({"quantile_q": 1.5}, False),
        ({"quantile_steps": 1}, True),
        ({"quantile_steps": 10**6}, True),
        ({"quantile_steps": 0}, False),
        ({"quantile_steps": 10**6 + 1}, False),
    ],
)
def test_clip_estimate_parameters_at_the_edges_of_their_ranges(change, ok):
    facts = honest_facts("a", **{**ESTIMATE, **change})
    if ok:
        assert _read(facts)
    else:
        sigma, q = float(facts["quantile-sigma"]), float(facts["quantile-q"])
        steps = facts["quantile-steps"]
        assert _rejected(facts) == (
            f"impossible clip-estimate parameters sigma={sigma}, q={q}, steps={steps}"
        )


SECURE = {"mechanism": SKELLAM_MECHANISM, "honest_sites": 3, "share_sigma": 0.5}
"""A secure-aggregation reply's facts (sigma 1.0 from ``honest_facts``)."""


def test_secure_facts_pass_with_the_skellam_mechanism_and_come_back_typed():
    facts = _read(honest_facts("a", **SECURE))
    assert (facts["honest-sites"], facts["share-sigma"]) == (3, 0.5)
    assert read_facts(honest_facts("a", **SECURE)).secure == SkellamShare(3, 0.5)


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({"honest_sites": 1}, True),
        ({"honest_sites": 10_000}, True),
        ({"honest_sites": 0}, False),
        ({"honest_sites": -2}, False),
        ({"honest_sites": 10_001}, False),
        ({"share_sigma": 0.0}, True),
        ({"share_sigma": 1.0}, True),  # the site's share alone carries all the noise: H = 1
        ({"share_sigma": 1.0 + 1e-12}, False),
        ({"share_sigma": -1e-12}, False),
        ({"share_sigma": 2.0, "sigma": 1.5}, False),
    ],
)
def test_secure_facts_at_the_edges_of_their_ranges(change, ok):
    facts = honest_facts("a", **{**SECURE, **change})
    if ok:
        assert _read(facts)
        return
    if "honest_sites" in change:
        assert _rejected(facts) == f"honest-sites={change['honest_sites']} is not in [1, 10000]"
    else:
        share, sigma = float(facts["share-sigma"]), float(facts["sigma"])
        assert _rejected(facts) == f"share-sigma={share} is not in [0, sigma={sigma}]"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"honest_sites": 2.0}, "accounting fact honest-sites=2.0 is not an integer"),
        ({"honest_sites": True}, "accounting fact honest-sites=True is not an integer"),
        ({"honest_sites": "3"}, "accounting fact honest-sites='3' is not an integer"),
        ({"share_sigma": "0.5"}, "accounting fact share-sigma='0.5' is not a number"),
        ({"share_sigma": math.inf}, "accounting fact share-sigma=inf is not finite"),
        ({"share_sigma": math.nan}, "accounting fact share-sigma=nan is not finite"),
        ({"share_sigma": False}, "accounting fact share-sigma=False is not a number"),
    ],
)
def test_secure_facts_of_the_wrong_type_are_named_with_their_value(change, says):
    assert _rejected(honest_facts("a", **{**SECURE, **change})) == says


@pytest.mark.parametrize("missing", ["honest_sites", "share_sigma"])
def test_secure_facts_come_both_or_none(missing):
    other = "share-sigma" if missing == "honest_sites" else "honest-sites"
    for status in ("ok", "refused"):
        facts = honest_facts("a", status=status, **{**SECURE, missing: None})
        assert _rejected(facts) == f"secure-aggregation facts {[other]} without the others"


def test_secure_facts_are_present_exactly_on_a_skellam_reply_a_refusal_may_omit_them():
    """An ok reply of the Skellam mechanism must state both; a reply of any other mechanism
    (or of none) may state neither; a refusal of a secure run may omit both (nothing ran)."""
    without = {"mechanism": SKELLAM_MECHANISM}
    assert _rejected(honest_facts("a", **without)) == (
        f"a {SKELLAM_MECHANISM} reply without its facts ['honest-sites', 'share-sigma']"
    )
    refused = honest_facts("a", status="refused", reason="cap-exhausted", steps=0, **without)
    assert _read(refused)
    stated = {**SECURE, "share_sigma": 0.0}  # a refusal that states them, with sigma 0
    assert _read(honest_facts("a", status="refused", steps=0, sigma=0.0, **stated))
    for mechanism in (MECHANISM, None):
        facts = honest_facts("a", **{**SECURE, "mechanism": mechanism})
        assert _rejected(facts) == (
            "secure-aggregation facts ['honest-sites', 'share-sigma'] on a reply whose "
            f"mechanism is not {SKELLAM_MECHANISM}"
        )
    assert "honest-sites" not in _read(honest_facts("a"))  # a plain reply


def test_facts_of_a_reply_without_its_record_is_a_facts_rejection():
    msg = Message(RecordDict({"other": ConfigRecord({"x": 1})}), 1, "train")
    with pytest.raises(ReplyError) as info:
        facts_of(msg)
    assert info.value.code == "facts"
    assert str(info.value) == "reply has no accounting facts record"
    ok = Message(RecordDict({ACCOUNTING: ConfigRecord(honest_facts("a"))}), 1, "train")
    assert facts_of(ok).site_id == "a"


def test_the_unconfirmed_code_names_the_error_code_only_for_an_error_reply():
    sent = Message(RecordDict({"config": ConfigRecord({"x": 1})}), 1, "train")
    error = Message(Error(code=4002, reason="x"), reply_to=sent)
    ok = Message(RecordDict({ACCOUNTING: ConfigRecord(honest_facts("a"))}), reply_to=sent)
    assert unconfirmed_code(ReplyError("e", "error-reply"), error) == "error-reply-4002"
    assert unconfirmed_code(ReplyError("e", "error-reply"), ok) == "error-reply"
    assert unconfirmed_code(ReplyError("e", "facts"), error) == "facts"


def test_a_refusal_needs_a_known_reason_code():
    facts = honest_facts("a", status="refused", reason="because", steps=0, sigma=0.0)
    message = _mismatch(_terms(), facts, code="refusal-reason")
    assert message == (
        "refused reply without a known reason code (prism_runtime.protocol.REFUSAL_REASONS)"
    )
    valid = honest_facts("a", status="refused", reason=next(iter(REFUSAL_REASONS)), steps=0)
    _terms().check(read_facts(valid))


@pytest.mark.parametrize(
    ("name", "value", "wanted"),
    [
        ("mechanism", "gaussian", MECHANISM),
        ("sampling", "shuffle", "poisson"),
        ("adjacency", "replace-one", "add-remove"),
    ],
)
def test_another_mechanism_sampling_or_adjacency_is_named(name, value, wanted):
    message = _mismatch(_terms(), honest_facts("a", **{name: value}))
    assert message == f"fact {name} is not the run's {wanted!r}"


def test_an_unknown_randomness_mode_lists_the_known_ones():
    assert _mismatch(_terms(), honest_facts("a", rng="lava-lamp")) == (
        f"fact rng is not one of {list(RNG_MODES)}"
    )


def test_steps_other_than_the_rounds_are_named():
    assert _mismatch(_terms(local_steps=2), honest_facts("a", steps=1)) == (
        "reply ran 1 steps, the round asked for 2"
    )


def test_sigma_zero_in_a_dp_run_is_a_mismatch_and_fine_in_a_non_dp_run():
    facts = honest_facts("a", sigma=0.0)
    assert _mismatch(_terms(), facts) == "sigma = 0 for a differentially private method"
    nondp = honest_facts("a", sigma=0.0, max_norm=None, expected_batch_size=None)
    _terms(dp=False, max_norm=None, expected_batch_size=None).check(read_facts(nondp))


def test_a_fixed_noise_multiplier_is_matched_to_one_part_in_a_million():
    terms = _terms(noise_multiplier=2.0)
    for sigma in (2.0, 2.0 * (1 + 5e-7), 2.0 * (1 - 5e-7)):
        terms.check(read_facts(honest_facts("a", sigma=sigma)))
    for sigma in (1.0, 2.0 * (1 + 5e-6), 2.0 * (1 - 5e-6), 4.0):  # 1.0: half the run's sigma
        assert _mismatch(terms, honest_facts("a", sigma=sigma)) == (
            f"fact sigma {sigma!r} is not the run's noise-multiplier 2.0"
        )


def test_a_calibrated_noise_multiplier_is_any_sigma_a_site_runs():
    """Each site calibrates its own sigma: any in ``[SIGMA_MIN, SIGMA_MAX]`` matches the run,
    and one below ``SIGMA_MIN`` never reaches the terms (``read_facts`` refuses it)."""
    terms = _terms()
    assert terms.noise_multiplier is None
    for sigma in (SIGMA_MIN, 0.8, 37.0, SIGMA_MAX):
        terms.check(read_facts(honest_facts("a", sigma=sigma)))
    for sigma in (SIGMA_MIN * (1 - 1e-9), 0.1):
        message = _rejected(honest_facts("a", sigma=sigma))
        assert message.startswith(f"sigma={sigma} is neither 0 (no noise) nor in [0.3, 10000]")


def test_a_fixed_noise_multiplier_binds_no_refusal_and_no_non_dp_reply():
    refusal = honest_facts("a", status="refused", reason=next(iter(REFUSAL_REASONS)), steps=0)
    _terms(noise_multiplier=2.0).check(read_facts({**refusal, "sigma": 0.0}))
    nondp = honest_facts("a", sigma=0.0, max_norm=None, expected_batch_size=None)
    _terms(dp=False, noise_multiplier=2.0, max_norm=None, expected_batch_size=None).check(
        read_facts(nondp)
    )
    assert _mismatch(_terms(noise_multiplier=2.0), honest_facts("a", sigma=0.0)) == (
        "sigma = 0 for a differentially private method"
    )


def test_the_runs_clip_and_batch_are_matched_to_one_part_in_a_million():
    terms = _terms()
    terms.check(
        read_facts(
            honest_facts("a", max_norm=0.05 * (1 + 5e-7), expected_batch_size=16 * (1 - 5e-7))
        )
    )
    for name, value in (("max_norm", 0.05 * (1 + 5e-6)), ("expected_batch_size", 16.1)):
        fact, wanted = name.replace("_", "-"), 0.05 if name == "max_norm" else 16.0
        message = _mismatch(terms, honest_facts("a", **{name: value}))
        assert message == f"fact {fact} is missing or not the run's {wanted!r}"
    assert _mismatch(terms, honest_facts("a", max_norm=None)) == (
        "fact max-norm is missing or not the run's 0.05"
    )


def test_a_runs_one_sample_rate_binds_q_and_leaves_each_sites_batch_its_own():
    """Secure aggregation with ``sample-rate``: every DP reply states the run's q (to one part
    in a million); its expected batch is its own q N_k, so the run fixes none."""
    terms = _terms(expected_batch_size=None, sample_rate=0.05)
    terms.check(read_facts(honest_facts("a", q=0.05 * (1 + 5e-7), expected_batch_size=3.0)))
    terms.check(read_facts(honest_facts("b", q=0.05, expected_batch_size=400.0)))
    assert _mismatch(terms, honest_facts("a", q=0.05 * (1 + 5e-6))) == (
        "fact q is not the run's sample-rate 0.05"
    )
    refusal = honest_facts("a", status="refused", reason=next(iter(REFUSAL_REASONS)), steps=0)
    terms.check(
        read_facts({**refusal, "q": 0.5, "sigma": 0.0})
    )  # a refusal ran nothing: its q binds nothing


def test_a_delta_above_the_runs_or_missing_is_named():
    assert _mismatch(_terms(), honest_facts("a", delta=2e-5)) == (
        "delta 2e-05 is missing or above the run's 1e-05"
    )
    assert _mismatch(_terms(), honest_facts("a", delta=None)) == (
        "delta None is missing or above the run's 1e-05"
    )
    _terms().check(read_facts(honest_facts("a", delta=1e-6)))


def test_an_auto_clip_reply_with_its_estimate_and_a_clip_in_range_passes():
    terms = _terms(max_norm=None, auto_clip=AUTO)
    terms.check(read_facts(honest_facts("a", max_norm=0.1, **ESTIMATE)))  # round 1: the estimate
    terms.check(read_facts(honest_facts("a", max_norm=0.1)))  # later rounds: the stored estimate


def test_estimate_facts_on_a_refusal_or_without_auto_clip_are_a_mismatch():
    says = "clip-estimate facts on a refusal or in a run without max-norm = auto"
    assert _mismatch(_terms(), honest_facts("a", **ESTIMATE)) == says
    refusal = honest_facts(
        "a", status="refused", reason=next(iter(REFUSAL_REASONS)), steps=0, **ESTIMATE
    )
    assert _mismatch(_terms(max_norm=None, auto_clip=AUTO), refusal) == says


def test_an_estimate_of_other_steps_than_the_runs_is_named():
    terms = _terms(max_norm=None, auto_clip=AUTO)
    facts = honest_facts("a", max_norm=0.1, **{**ESTIMATE, "quantile_steps": 4})
    assert _mismatch(terms, facts) == "the clip estimate ran 4 steps, the run asks 3"


def test_an_auto_clip_at_the_edges_of_its_public_range():
    terms = _terms(max_norm=None, auto_clip=AUTO)
    low, high = AUTO.low * (1 - FLOAT32_SLACK), AUTO.high * (1 + FLOAT32_SLACK)
    for clip in (low, AUTO.low, AUTO.high, high):
        terms.check(read_facts(honest_facts("a", max_norm=clip)))
    for clip in (low * (1 - 1e-9), high * (1 + 1e-9), AUTO.low * 0.99, AUTO.high * 1.01):
        message = _mismatch(terms, honest_facts("a", max_norm=clip))
        assert message == (
            f"max-norm {clip!r} is missing or outside [0.02, 0.5], the clips a private "
            "estimate of this run can give"
        )


def test_a_refusal_in_an_auto_clip_run_states_no_clip():
    refusal = honest_facts(
        "a", status="refused", reason=next(iter(REFUSAL_REASONS)), steps=0, max_norm=None
    )
    _terms(max_norm=None, auto_clip=AUTO).check(read_facts(refusal))


# -- error replies: a code and its fixed text, never the site's own words ----------------------


def _request(node: int) -> Message:
    return Message(RecordDict(), dst_node_id=node, message_type="train")


def _error(code: object, node: int = 7) -> Message:
    error = Error(code=code, reason="Traceback: secret-row-17")  # type: ignore[arg-type]
    return Message(error, reply_to=_request(node))


@pytest.mark.parametrize("code", sorted(SITE_ERROR_CODES))
def test_a_site_error_reply_shows_its_code_and_fixed_text(code: int) -> None:
    error = error_reply(_error(code))
    assert str(error) == f"error reply {code}: {SITE_ERROR_CODES[code]}"
    assert error.code == "error-reply"
    assert unconfirmed_code(error, _error(code)) == f"error-reply-{code}"


def test_a_flower_error_reply_shows_flowers_name_and_an_unknown_code_says_so() -> None:
    raised = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert str(error_reply(_error(raised))) == (
        f"error reply {raised}: Flower error CLIENT_APP_RAISED_EXCEPTION "
        "(the site's ClientApp or node failed)"
    )
    assert str(error_reply(_error(777))) == "error reply 777: unknown site error code 777"
    assert "secret-row-17" not in str(error_reply(_error(4003)))


@pytest.mark.parametrize("code", [True, "4003", 4003.0, None])
def test_a_code_that_is_not_an_integer_is_named_so(code: object) -> None:
    assert error_reply_text(code) == "site error code is not an integer"


@pytest.mark.parametrize("code", [True, "4003"])  # a bool is an int to Python, not a code
def test_an_error_reply_whose_code_is_not_an_integer_shows_a_question_mark(code: object) -> None:
    message = _error(code)
    error = error_reply(message)
    assert str(error) == "error reply ?: site error code is not an integer"
    assert unconfirmed_code(error, message) == "error-reply"


# -- the summation order: by claimed site id, then node, whatever the arrival order ------------


def _ok(node: int, facts: dict[str, str] | None) -> Message:
    content = RecordDict()
    if facts is not None:
        content[ACCOUNTING] = ConfigRecord(facts)
    return Message(content, reply_to=_request(node))


def test_replies_are_summed_in_the_order_of_their_site_id_then_node() -> None:
    replies = [
        _ok(3, {"site-id": "zed"}),
        _error(4003, node=9),
        _ok(7, {"site-id": "Alpha"}),
        _ok(2, {"status": "ok"}),  # facts without a site id: sorted as ""
        _ok(1, None),  # no facts at all: sorted as ""
        _ok(5, {"site-id": "zed"}),
    ]
    for arrival in (replies, replies[::-1], replies[2:] + replies[:2]):
        ordered = in_order(arrival)
        assert [m.metadata.src_node_id for m in ordered] == [1, 2, 9, 7, 3, 5]


# -- through the strategy: error replies, the facts' cross-check, a private clip ---------------


def test_an_error_reason_is_never_logged_or_stored(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = Ledger.open(run_dir / "ledger.sqlite")
    strategy = three_sites.new_strategy(ledger)
    three_sites.honest_round(strategy, 1)
    requests = three_sites.ask(strategy, 2)
    replies = [
        three_sites.error(requests[11], 4003),  # a site error code
        three_sites.error(
            requests[12], 2, reason=f"Exception: {three_sites.SECRET}\n  File ..."
        ),  # Flower's own
        three_sites.error(requests[13], 9999, reason=three_sites.SECRET),  # an unknown code
    ]
    with caplog.at_level(logging.DEBUG):
        strategy.aggregate_train(2, replies)
        requests = three_sites.ask(strategy, 3)
        refusal = three_sites.reply(
            requests[11], status="refused", steps=0, reason=three_sites.SECRET
        )
        strategy.aggregate_train(3, [refusal])
    texts = dict(strategy.summaries[1].rejected)
    assert texts["site-11"] == f"error reply 4003: {SITE_ERROR_CODES[4003]}"
    assert texts["site-12"].startswith("error reply 2: Flower error CLIENT_APP_RAISED_EXCEPTION")
    assert texts["site-13"] == "error reply 9999: unknown site error code 9999"
    assert {e.code for e in ledger.records() if not e.confirmed} >= {
        "error-reply-4003",
        "error-reply-2",
        "error-reply-9999",
        "refusal-reason",
    }

    summary = json.dumps({"rounds": [vars(s) for s in strategy.summaries]}, default=str)
    (run_dir / "summary.json").write_text(summary)
    save_checkpoint(
        run_dir,
        Checkpoint(
            server_round=3,
            arrays=three_sites.adapter(),
            run_config={},
            strategy=strategy.state_dict(),
            round_state={},
        ),
    )
    write_reports(build_report(ledger), run_dir)
    ledger.close()
    assert "error reply 4003" in caplog.text  # the rejections were logged, by code
    assert three_sites.SECRET not in caplog.text
    assert three_sites.SECRET.encode() not in b"".join(p.read_bytes() for p in run_dir.iterdir())
    assert {p.name for p in run_dir.iterdir()} >= {
        "summary.json",
        "checkpoint.safetensors",
        "ledger.sqlite",
        "report.json",
    }


MISMATCHES = [
    ({"steps": 3}, "facts-mismatch"),
    ({"steps": 1}, "facts-mismatch"),
    ({"mechanism": "factor-gaussian"}, "facts-mismatch"),
    ({"mechanism": None}, "facts-mismatch"),
    ({"sampling": "shuffle"}, "facts-mismatch"),
    ({"adjacency": "replace-one"}, "facts-mismatch"),
    ({"rng": "seeded"}, "facts-mismatch"),
    ({"rng": None}, "facts-mismatch"),
    ({"sigma": 0.0}, "facts-mismatch"),
    ({"delta": 1e-4}, "facts-mismatch"),
    ({"delta": None}, "facts-mismatch"),
    ({"status": "refused", "steps": 0, "reason": "cap reached"}, "refusal-reason"),
    ({"status": "refused", "steps": 0, "reason": ""}, "refusal-reason"),
    ({"status": "refused", "steps": three_sites.TAU, "reason": "cap-exhausted"}, "facts-mismatch"),
]


@pytest.mark.parametrize(("changes", "code"), MISMATCHES, ids=[str(c) for c, _ in MISMATCHES])
def test_facts_that_do_not_match_the_configuration_are_rejected_and_charged_unconfirmed(
    tmp_path, changes, code
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        three_sites.honest_round(strategy, 1)
        requests = three_sites.ask(strategy, 2)
        replies = [
            three_sites.reply(requests[11]),
            three_sites.reply(requests[12], **changes),
            three_sites.reply(requests[13]),
        ]
        new, metrics = strategy.aggregate_train(2, replies)
        assert new is not None and metrics["sites-accepted"] == 2
        assert metrics[f"rejected-{code}"] == 1 and metrics["replies-rejected"] == 1
        assert strategy.summaries[-1].rejected[0][0] == "site-12"
        last = ledger.records("site-12")[-1]
        steps = max(three_sites.TAU, changes.get("steps", three_sites.TAU))
        assert (last.round, last.confirmed, last.code, last.steps) == (2, False, code, steps)
        assert (last.sigma, last.q, last.rng) == (
            three_sites.SIGMA,
            three_sites.Q,
            "os-csprng",
        )  # last confirmed
        assert "site-12" not in strategy.summaries[-1].refused


def test_valid_refusals_and_a_non_dp_run_pass_the_cross_check(tmp_path):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = three_sites.new_strategy(ledger)
        three_sites.honest_round(strategy, 1)
        requests = three_sites.ask(strategy, 2)
        reason = sorted(REFUSAL_REASONS)[0]
        refusal = three_sites.reply(requests[12], status="refused", steps=0, reason=reason)
        _, metrics = strategy.aggregate_train(
            2, [three_sites.reply(requests[11]), refusal, three_sites.reply(requests[13])]
        )
        summary = strategy.summaries[-1]
        assert (metrics["sites-refused"], metrics["replies-rejected"]) == (1, 0)
        assert summary.refusal_codes == {"site-12": reason} and summary.unconfirmed == []
        assert [e.round for e in ledger.records("site-12")] == [1]  # a refusal charges nothing
    with Ledger.open(tmp_path / "nondp.sqlite") as ledger:
        strategy = three_sites.new_strategy(
            ledger, mode="factor-average", mechanism="none", dp=False
        )
        requests = three_sites.ask(strategy, 1)
        replies = [
            three_sites.reply(r, mechanism="none", sigma=0.0).content for r in requests.values()
        ]
        for content in replies:  # a factor-average reply carries end factors, not tangents
            content[UPDATE] = ArrayRecord(three_sites.adapter())
        _, metrics = strategy.aggregate_train(
            1,
            [Message(c, reply_to=r) for c, r in zip(replies, requests.values(), strict=True)],
        )
        assert metrics["sites-accepted"] == 3


@pytest.mark.parametrize(
    ("changes", "auto", "code"),
    [
        (
            {"max-norm": 1.5},
            clip_estimate.AUTO,
            "facts-mismatch",
        ),  # above every clip the estimate can give
        ({"max-norm": 0.001}, clip_estimate.AUTO, "facts-mismatch"),
        ({"max-norm": None}, clip_estimate.AUTO, "facts-mismatch"),
        (
            {**clip_estimate.ESTIMATED, "quantile-steps": clip_estimate.K + 1},
            clip_estimate.AUTO,
            "facts-mismatch",
        ),
        (
            {"quantile-sigma": 6.4, "quantile-steps": clip_estimate.K},
            clip_estimate.AUTO,
            "facts",
        ),  # q missing
        ({**clip_estimate.ESTIMATED, "quantile-sigma": 0.0}, clip_estimate.AUTO, "facts"),
        (
            {**clip_estimate.ESTIMATED, "max-norm": 0.05},
            None,
            "facts-mismatch",
        ),  # no estimate in this run
    ],
)
def test_a_reply_with_an_impossible_clip_or_estimate_is_rejected_and_charged(
    tmp_path, changes, auto, code
):
    with Ledger.open(tmp_path / "ledger.sqlite") as ledger:
        strategy = clip_estimate.new_strategy(ledger, auto)
        requests = clip_estimate.ask(strategy, 1, clip_estimate.adapter(), nodes=(11,))
        _, metrics = strategy.aggregate_train(1, [clip_estimate.reply(requests[11], **changes)])
        assert metrics["sites-accepted"] == 0 and metrics[f"rejected-{code}"] == 1
        assert metrics["sites-unconfirmed"] == 1
        assert not any(e.confirmed for e in ledger.records())
