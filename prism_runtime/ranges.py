"""The accepted range of every number the coordinator sends a site, in one place.

A site treats the run config, the round number and the broadcast adapter as hostile input:
each number is checked against these ranges BEFORE anything is charged, so an extreme value is
an answer with a code (a run-config error 4001, or a refusal ``bad-round`` / ``bad-broadcast``)
that depends on no private data, never a crash, a hang or a charge for nothing. The run config's
model (``prism_runtime.config.RunConfig``) enforces the run-config ranges on both sides, the
site's broadcast check (``client.broadcast``) the adapter's, and ``prism-fl audit`` checks a
finished run's facts against them (docs/security.md, "Numbers from the coordinator").

Why each bound holds what it holds:

- the noise multiplier is at least ``SIGMA_MIN``, where the PRV accountant is valid and bounded
  in memory (``prism_core.accounting``);
- the clip C lies in ``[MAX_NORM_MIN, MAX_NORM_MAX]``: far above float32's subnormal range, so a
  clip coefficient ``C / s`` keeps full precision, and small enough that a step of noise
  ``sigma C / b`` stays finite through the adaptive transform and the retraction;
- steps and rounds are bounded so that an accountant call (PRV at most ``PRV_STEPS_MAX`` steps)
  and a round end in bounded time;
- the broadcast factors and head are bounded relative to the site's own model (its pretrained
  weights and its own public start), and PRISM's factors are well conditioned, so the lift,
  its norm and the min-norm release are accurate in float32.
"""

from __future__ import annotations

from prism_core.accounting import PRV_STEPS_MAX, SIGMA_MIN

__all__ = [
    "BROADCAST_SCALE_MAX",
    "FACTOR_COND_MAX",
    "HEAD_LR_MAX",
    "LOCAL_STEPS_MAX",
    "LR_MAX",
    "MAX_NORM_MAX",
    "MAX_NORM_MIN",
    "MAX_RECORDS_PER_USER_MAX",
    "NUM_ROUNDS_MAX",
    "QUANTILE_STEPS_MAX",
    "SERVER_ROUND_MAX",
    "SIGMA_MAX",
    "SIGMA_MIN",
    "SITE_STEPS_MAX",
]

MAX_NORM_MIN = 1e-6
"""Smallest clip C (and head share, and auto-clip start or estimate) a site runs."""
MAX_NORM_MAX = 1e4
"""Largest clip C a site runs."""

SIGMA_MAX = 1e4
"""Largest noise multiplier a site runs (more noise than any use; keeps the noise finite)."""

LR_MAX = 10.0
"""Largest local learning rate (PRISM's LoRA step, the baselines' AdamW)."""
HEAD_LR_MAX = 1000.0
"""Largest learning rate of the DP head."""

MAX_RECORDS_PER_USER_MAX = 1_000
"""Most records of one person in a person-level batch (``max-records-per-user``): a larger k
costs no privacy, only memory and time per sampled person."""

LOCAL_STEPS_MAX = 10_000
"""Most local steps per round."""
NUM_ROUNDS_MAX = 100_000
"""Most rounds of a run."""
SITE_STEPS_MAX = PRV_STEPS_MAX
"""Most steps a site may run in one run (rounds x local steps): the accountant's PRV bound."""
QUANTILE_STEPS_MAX = 1_000
"""Most steps of a private clip estimate."""

SERVER_ROUND_MAX = 10**9
"""Largest round number a site accepts (a positive integer)."""

BROADCAST_SCALE_MAX = 100.0
"""A broadcast factor's spectral norm is at most this times ``1 + sqrt(||W||_F / s)`` (W the
module's pretrained weight, s the LoRA scaling), and a head tensor's largest entry at most this
times ``1 +`` the largest entry of the site's own public start of it."""

FACTOR_COND_MAX = 1e3
"""PRISM's broadcast factors must have ``s_1 / s_r <= FACTOR_COND_MAX`` (full rank r, well
conditioned: the lift and its norm lose at most about ``1e-4`` relative in float32)."""
