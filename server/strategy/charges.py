"""The coordinator's charges to its ledger: a valid reply's facts as CONFIRMED, and a site asked
to run a round that gave no valid answer as UNCONFIRMED.

An unconfirmed charge is the round's steps at the site's last confirmed parameters
(``Ledger.last_confirmed``), or, for a site with none, with unknown parameters (accounted as
epsilon inf): the site may have charged itself before failing; the report counts these charges
in the site's worst-case epsilon. A private clip estimate (``max-norm = auto``) is its own row of
mechanism ``QUANTILE_MECHANISM`` beside the training row. A secure-aggregation charge
(``SKELLAM_MECHANISM``) records the reply's ``honest-sites`` and ``share-sigma`` facts; an
unconfirmed one repeats the site's last confirmed values, or, with unknown parameters, counts on
the site alone (``UNKNOWN_HONEST_SITES``) with a share sigma of 0.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from prism_core.errors import PrivacyParameterError
from prism_core.quantile import QUANTILE_MECHANISM
from prism_core.records import SKELLAM_MECHANISM, PrivacyEvent, SkellamShare
from prism_runtime.facts import ReplyFacts
from server.errors import InvalidEventError, LedgerConflictError, LedgerError, ReplyError
from server.ledger import UNKNOWN_HONEST_SITES, UNKNOWN_Q, UNKNOWN_SIGMA, Ledger, LedgerEvent
from server.strategy.bounds import AutoClip
from server.strategy.rounds import RoundSummary

__all__ = ["Charges"]

log = logging.getLogger("server.strategy")


class Charges:
    """Writes a run's charges to the coordinator's ledger.

    Args:
        ledger: the coordinator's privacy ledger.
        run_id: this run's id in the ledger.
        target_epsilon: the cap recorded when a reply states none.
        delta: the run's delta (an unconfirmed charge of unknown parameters is recorded at it).
        mechanism: the run's mechanism (that of an unconfirmed charge of unknown parameters).
        auto_clip: set for a run with ``max-norm = auto`` (an unconfirmed estimate row too).
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        run_id: str,
        target_epsilon: float,
        delta: float,
        mechanism: str,
        auto_clip: AutoClip | None,
    ) -> None:
        self.ledger, self.run_id = ledger, run_id
        self.target_epsilon, self.delta = target_epsilon, delta
        self.mechanism, self.auto_clip = mechanism, auto_clip

    def confirmed(self, server_round: int, facts: ReplyFacts) -> None:
        """Charge a reply's cross-checked facts to the ledger as CONFIRMED (with a
        secure-aggregation reply's ``honest-sites`` and ``share-sigma``).

        Raises:
            ReplyError: ``facts`` if the ledger refuses the values, ``ledger-conflict`` if the
                site already has a different confirmed record of this round (the stored one is
                kept), ``ledger-error`` if the ledger cannot be written.
        """
        if facts.steps <= 0:
            return
        if facts.delta is None:  # RunTerms.check refuses such a reply before any charge
            raise ReplyError("accounting facts lack 'delta'", "facts")
        cap = self.target_epsilon if facts.epsilon_cap is None else facts.epsilon_cap
        try:
            released = facts.event()
            event = LedgerEvent(
                run_id=self.run_id,
                round=server_round,
                site_id=facts.site_id,
                event=released,
                delta=facts.delta,
                epsilon_cap=cap if cap > 0 else None,
                rng=str(facts.rng),
            )
            events = [event]
            estimate = facts.quantile
            if estimate is not None:  # a private clip estimate ran before the steps
                quantile = replace(
                    released,
                    mechanism=QUANTILE_MECHANISM,
                    noise_multiplier=estimate.noise_multiplier,
                    sample_rate=estimate.sample_rate,
                    steps=estimate.steps,
                    secure=None,
                )
                events.insert(0, replace(event, event=quantile))
        except (PrivacyParameterError, InvalidEventError) as exc:
            raise ReplyError(f"accounting facts refused by the ledger: {exc}", "facts") from exc
        try:
            self.ledger.append_many(events)  # all of the round's charges, or none
        except InvalidEventError as exc:
            raise ReplyError(f"accounting facts refused by the ledger: {exc}", "facts") from exc
        except LedgerConflictError as exc:
            raise ReplyError(
                f"the ledger already holds a different record of this round ({exc})",
                "ledger-conflict",
            ) from exc
        except LedgerError as exc:
            log.error("round %d: ledger write failed: %s", server_round, exc)
            raise ReplyError(
                f"the ledger cannot record the charge ({exc})", "ledger-error"
            ) from exc

    def unconfirmed(
        self, server_round: int, site: str, code: str, steps: int, summary: RoundSummary
    ) -> None:
        """Record ``steps`` unconfirmed steps of ``site`` in this round (see the module doc).

        At the site's last confirmed parameters (sigma, q, delta, cap, mechanism, rng); a site
        with none (never seen, or a node never bound to a site: ``node-<id>``) is recorded with
        unknown parameters, accounted as sigma 0 (epsilon inf, the worst case); with
        ``max-norm = auto`` and no confirmed clip estimate of the site in this run, plus an
        unconfirmed estimate (``_estimate``). Idempotent: the ledger keeps one
        unconfirmed charge per (run, round, site, mechanism) and none once confirmed
        (a re-run round whose charge is already confirmed adds nothing, and is not listed in
        ``summary.unconfirmed``).
        """
        if any(
            e.round == server_round and e.confirmed
            for e in self.ledger.events(site_id=site, run_id=self.run_id)
        ):
            log.info(
                "round %d: %s gave no valid answer this time (%s), but the ledger already holds "
                "its confirmed charge of this round (a re-run round): nothing to add",
                server_round,
                site,
                code,
            )
            return
        last = self.ledger.last_confirmed(site)
        if last is None:
            event = LedgerEvent(
                run_id=self.run_id,
                round=server_round,
                site_id=site,
                event=self._unknown(steps),
                delta=self.delta,
                confirmed=False,
                params_known=False,
                code=code,
            )
        else:
            event = LedgerEvent(
                run_id=self.run_id,
                round=server_round,
                site_id=site,
                event=replace(last.event, steps=steps),
                delta=last.delta,
                epsilon_cap=last.epsilon_cap,
                rng=last.rng,
                confirmed=False,
                code=code,
            )
        summary.unconfirmed.append(site)
        try:
            self.ledger.append_many([*self._estimate(site, last, event), event])
        except LedgerError as exc:
            log.error(
                "round %d: the unconfirmed charge of %s could NOT be recorded: %s",
                server_round,
                site,
                exc,
            )
            return
        log.warning(
            "round %d: %s charged %d steps as UNCONFIRMED (%s), %s",
            server_round,
            site,
            steps,
            code,
            "parameters unknown: epsilon unknown (worst case)"
            if last is None
            else f"at its last confirmed sigma={last.sigma}, q={last.q}",
        )

    def _unknown(self, steps: int) -> PrivacyEvent:
        """``steps`` steps of the run's mechanism with unknown parameters (epsilon inf)."""
        secure = None
        if self.mechanism == SKELLAM_MECHANISM:
            secure = SkellamShare(UNKNOWN_HONEST_SITES, UNKNOWN_SIGMA)
        return PrivacyEvent(
            UNKNOWN_SIGMA, UNKNOWN_Q, steps, mechanism=self.mechanism, secure=secure
        )

    def _estimate(
        self, site: str, last: LedgerEvent | None, event: LedgerEvent
    ) -> list[LedgerEvent]:
        """With ``max-norm = auto``, a site without a confirmed clip estimate in this run may
        have estimated (and charged) one before failing: an unconfirmed estimate row too, at
        the run's K and sigma_b and the site's last confirmed q (none for unknown parameters:
        the training row is already accounted as epsilon inf)."""
        auto = self.auto_clip
        if auto is None or last is None:
            return []
        estimated = any(
            e.mechanism == QUANTILE_MECHANISM and e.confirmed
            for e in self.ledger.events(site_id=site, run_id=self.run_id)
        )
        if estimated:
            return []
        quantile = replace(
            event.event,
            mechanism=QUANTILE_MECHANISM,
            noise_multiplier=auto.noise_multiplier,
            steps=auto.steps,
            secure=None,
        )
        return [replace(event, event=quantile)]
