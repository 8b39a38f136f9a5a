"""The budget planner: the run settings the budget study found best for a compute budget.

A federation states its budget as public facts only: the passes over each site's data (or the
example-gradients per site) and about how many rows a site holds. ``plan_budget`` turns them into
the keys a run needs (expected batch, rounds, lr, the clip's split), by the rules of the budget
study (docs/benchmarks.md, "What does a larger compute budget buy?"):

- one local step per round, so every site's step is taken at the current global model (label
  skew then does not pull the aggregate toward one site);
- ``STEPS`` = 30 steps whatever the budget; the batch takes the budget, ``b = E / 30`` (at
  most N, then more steps of N; at least ``MIN_BATCH``, then fewer steps). The study: private
  runs peak within about 30 steps and then hold or decline, and 30 steps of 768 (one pass) came
  within 0.7 points of non-DP LoRA at the same budget on dev (Ponomareva et al. 2023: at a fixed
  epsilon, spend compute on the batch);
- PRISM's step grows with the batch (linear scaling, Li et al. 2022): ``lr = LR_PER_ROW x b``,
  at most ``MAX_LR``; the noise of a step's mean gradient falls as ``sigma C / b``;
- the clip, its head share and the head's step stay at the demo's (the study found none that
  moved held-out accuracy beyond one seed's noise);
- the coordinator takes PRISM's one adaptive step a round on the sites' mean (plain rounds at
  ``step-at = auto`` or ``coordinator``) or on their sum (secure aggregation), so the lr and
  clip are the study's runs of that step (``STEP_SETTINGS``), not the rule above, which holds
  for sites that step themselves (``step-at = site``: ``BudgetPlan.settings(site_step=True)``)
  and, in plain rounds, for budgets below ``STEP_SETTINGS_FROM_PASSES`` (at the demo's budget
  the coordinator's step does better at the demo's settings than at ``STEP_SETTINGS``);
  with secure aggregation every site samples at one public rate ``b / rows-per-site``.

``budget_report`` adds what a site's accountant makes of the plan: the sigma it calibrates for
the stated epsilon over the planned steps (the same call a site makes), the noise std of one
step's mean gradient in units of C, and the epsilon the run charges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_LR",
    "MIN_BATCH",
    "PLANNED_KEYS",
    "STEPS",
    "STEP_SETTINGS",
    "STEP_SETTINGS_FROM_PASSES",
    "BudgetPlan",
    "BudgetReport",
    "budget_report",
    "plan_budget",
]

STEPS = 30
"""The steps of every plan, one round each. The study: private runs peak within about 30 steps
and then hold or decline (120 steps of 371 ended below 30 steps of 768 at half the budget), so a
larger budget goes into the batch, which lowers the noise of each step (sigma / b)."""
MIN_BATCH = 32
"""The smallest expected batch a plan uses."""
LR_PER_ROW = 0.002 / 128
"""PRISM's LoRA lr per row of the expected batch: the demo's 0.002 at b = 128, scaled linearly."""
MAX_LR = 0.012
"""The largest LoRA lr a plan sets: one pass (b = 768) at 0.012 ended at 0.784 on SST-2 dev in
plain rounds, two passes (b = 1486) at 0.02 at 0.681 (each site's own adaptive step on its own
noisy mean; the earlier cap), at 0.012 at 0.721, at 0.006 at 0.748 (the selection split, which
the study chooses on, ends at 0.760 and 0.752 for these two: not separated)."""
MAX_PASSES = 100.0
"""The most passes a budget may state."""

PLANNED_KEYS = ("batch-size", "num-rounds", "local-steps", "lr")
"""The run-config keys every budget sets (a run config that also sets one must agree with it);
when the coordinator steps ``STEP_SETTINGS`` too, and with secure aggregation ``sample-rate``."""

STEP_SETTINGS: dict[str, float] = {
    "lr": 0.008,
    "max-norm": 0.5,
    "head-max-norm": 0.4,
    "head-lr": 10.0,
}
"""What a budget sets when the coordinator takes the step, instead of the plain rule's lr and the
demo's clip. The coordinator then takes ONE adaptive step on the sites' noisy mean (plain rounds)
or on the sum of their clipped sums (secure aggregation: a central step on the union's batch),
so its lr does not grow with a site's batch. Plain rounds at these settings on SST-2 at two
passes: 0.820 and 0.814 on dev (two seeds), against at most 0.762 for every plain run of site
steps. The study's secure runs on SST-2 (dev): at 0.92 passes lr 0.004 0.792, lr 0.008 0.815;
at two passes lr 0.004 0.815, lr 0.008 0.826 and 0.829 (two seeds), lr 0.016 0.797; the plain
rule's lr 0.02 at two passes ended at the majority class. Medical question pairs at two passes
(48 rows a site a step, a sum's noise 30 times SST-2's two-pass runs): lr 0.004 0.849 / 0.806 /
0.822, lr 0.008 0.839 / 0.793 / 0.819 (seeds 0 / 1 / 2; the selection split's last 0.833 /
0.813 / 0.798 and 0.837 / 0.797 / 0.794), level within a standard error; plain rounds with the
coordinator's step at lr 0.008 0.813 (seed 0)."""


STEP_SETTINGS_FROM_PASSES = 0.5
"""The smallest budget at which plain rounds with the coordinator's step take ``STEP_SETTINGS``;
below it they keep the plain rule's lr and the demo's clip, head share and head lr. SST-2, plain
rounds, the coordinator's step (dev): at the demo's budget (0.17 passes, b = 128) the demo's
settings 0.783 and 0.783 (two seeds), ``STEP_SETTINGS`` 0.756; at one pass (b = 743)
``STEP_SETTINGS`` 0.805, the demo's settings 0.761; at two passes ``STEP_SETTINGS``
0.820 and 0.814. The boundary lies between the measured budgets (0.17 and 1), at their
geometric middle, about 0.4, rounded up. Secure aggregation keeps ``STEP_SETTINGS`` at every
budget (its run at the demo's budget, 0.760, is the only one measured there)."""


@dataclass(frozen=True)
class BudgetPlan:
    """The run settings of a budget (``plan_budget``).

    Attributes:
        passes: the budget in passes over a site's ``rows_per_site`` rows.
        rows_per_site: the rows a site holds, as stated (public).
        batch_size: the expected Poisson batch b of a step.
        num_rounds: the rounds T (one local step each).
        lr: PRISM's LoRA step when the sites step (``step-at = site``; the coordinator's step
            takes ``STEP_SETTINGS``).
    """

    passes: float
    rows_per_site: int
    batch_size: int
    num_rounds: int
    lr: float
    local_steps: int = 1

    @property
    def sample_rate(self) -> float:
        """q = b / N of a site with ``rows_per_site`` rows."""
        return self.batch_size / self.rows_per_site

    @property
    def example_gradients(self) -> int:
        """Expected example-gradients per site: b x T x steps per round."""
        return self.batch_size * self.num_rounds * self.local_steps

    def settings(self, *, secure: bool = False, site_step: bool = False) -> dict[str, Any]:
        """The run-config keys the plan sets: ``PLANNED_KEYS`` and ``STEP_SETTINGS`` (its lr in
        place of the plain rule's), the keys of the coordinator's step; with ``site_step``
        (``step-at = site``, plain rounds), or in plain rounds below
        ``STEP_SETTINGS_FROM_PASSES``, the plain rule's lr and no others. With ``secure``
        aggregation also one public ``sample-rate = b / rows-per-site`` (every site samples at
        it, so all calibrate one sigma and each can add the others' noise share)."""
        planned = {
            "batch-size": self.batch_size,
            "num-rounds": self.num_rounds,
            "local-steps": self.local_steps,
            "lr": self.lr,
        }
        if not secure and (site_step or self.passes < STEP_SETTINGS_FROM_PASSES):
            return planned
        stepped = {**planned, **STEP_SETTINGS}
        return {**stepped, "sample-rate": self.sample_rate} if secure else stepped


def plan_budget(*, passes: float, rows_per_site: int) -> BudgetPlan:
    """The run settings for ``passes`` over each site's data of about ``rows_per_site`` rows.

    Raises:
        ValueError: passes not in (0, ``MAX_PASSES``], fewer than ``MIN_BATCH`` rows a site, or
            a budget of less than one step of ``MIN_BATCH`` rows (a budget too small for
            ``STEPS`` steps of ``MIN_BATCH`` rows takes fewer steps).
    """
    if not (isinstance(passes, int | float) and 0 < passes <= MAX_PASSES):
        raise ValueError(
            f"budget={passes!r}: the passes over each site's data must be a number in "
            f"(0, {MAX_PASSES:g}] (e.g. budget=2 for two passes)"
        )
    if not (isinstance(rows_per_site, int) and rows_per_site >= MIN_BATCH):
        raise ValueError(
            f"rows-per-site={rows_per_site!r}: a budget needs about how many rows a site holds "
            f"(a public figure, at least {MIN_BATCH}), e.g. rows-per-site=20000"
        )
    example_gradients = passes * rows_per_site
    if example_gradients < MIN_BATCH:
        raise ValueError(
            f"budget={passes:g} passes over {rows_per_site} rows is {example_gradients:.0f} "
            f"example-gradients a site: less than one step of {MIN_BATCH} rows. State a larger "
            "budget."
        )
    batch = min(rows_per_site, max(MIN_BATCH, round(example_gradients / STEPS)))
    steps = max(1, round(example_gradients / batch))
    lr = min(MAX_LR, LR_PER_ROW * batch)
    return BudgetPlan(
        passes=float(passes),
        rows_per_site=rows_per_site,
        batch_size=batch,
        num_rounds=steps,
        lr=float(f"{lr:.3g}"),
    )


@dataclass(frozen=True)
class BudgetReport:
    """What a site's accountant makes of a plan (``budget_report``).

    Attributes:
        plan: the plan.
        epsilon, delta: the budget the plan spends (calibrated for).
        sigma: the noise multiplier a site with ``plan.rows_per_site`` rows calibrates.
        step_noise: the noise std of one step's mean gradient, sigma / b, in units of C.
        charged: the epsilon a site with ``plan.rows_per_site`` rows charges over the run.
    """

    plan: BudgetPlan
    epsilon: float
    delta: float
    sigma: float
    step_noise: float
    charged: float


def budget_report(plan: BudgetPlan, *, epsilon: float, delta: float) -> BudgetReport:
    """Calibrate sigma for ``plan`` at (``epsilon``, ``delta``) as a site does
    (``prism_core.accounting.calibrate_noise_multiplier`` over its planned steps at q = b / N),
    and the epsilon that sigma charges.

    Raises:
        prism_core.errors.PrivacyParameterError: epsilon or delta out of range, or no sigma
            meets the budget.
    """
    from prism_core.accounting import PrivacyEvent, calibrate_noise_multiplier
    from prism_core.accounting import epsilon as charge

    steps = plan.num_rounds * plan.local_steps
    sigma = calibrate_noise_multiplier(
        target_epsilon=epsilon, delta=delta, sample_rate=plan.sample_rate, steps=steps
    )
    charged = charge([PrivacyEvent(sigma, plan.sample_rate, steps)], delta)
    return BudgetReport(
        plan=plan,
        epsilon=epsilon,
        delta=delta,
        sigma=sigma,
        step_noise=sigma / plan.batch_size,
        charged=charged,
    )
