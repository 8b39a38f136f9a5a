"""What happened in one round (``server.strategy.rounds.RoundSummary``): its checkpoint
form."""

from __future__ import annotations

import json

from server.strategy.rounds import RoundSummary


def test_a_round_summary_survives_its_checkpoint_form_and_an_old_one_gets_the_defaults() -> None:
    """``from_dict(vars(s))`` gives back every field of a summary in which none is at its
    default; a checkpoint written before the later fields existed reads with those defaults."""
    full = RoundSummary(
        server_round=3,
        sent=4,
        accepted=["site-a"],
        refused=["site-b"],
        rejected=[("site-c", "norm too large")],
        applied=True,
        rejected_by_reason={"norm": 1},
        discarded="non-finite",
        refusal_codes={"site-b": "4003"},
        unconfirmed=["site-d"],
    )
    assert RoundSummary.from_dict(json.loads(json.dumps(vars(full)))) == full
    old = {"server_round": 2, "sent": 1, "accepted": [], "refused": [], "rejected": []}
    assert RoundSummary.from_dict({**old, "applied": False}) == RoundSummary(server_round=2, sent=1)
