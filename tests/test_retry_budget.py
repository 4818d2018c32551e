"""
The budget of a last write (`engine.retry.Budget`), on trio's clock: a write
that retries through an outage goes on while the lane runs, and once the lane
closes it begins no try after one `cleanup_timeout` more; the try under way
then ends within its own bound, and no try follows. Unit tests of timer logic:
the "outage" is an operation (or a store) that fails after a wait, no database.
"""

from __future__ import annotations

import math
import types
from typing import Any, cast

import pytest
import trio
import trio.testing

from nasiko_queue.config import QueueConfig
from nasiko_queue.engine.completer import Completer
from nasiko_queue.engine.retry import Budget, RetryPolicy
from nasiko_queue.engine.state import Finish
from nasiko_queue.errors import NotWithinTheStopsBound

BOUND = 5.0
POLICY = RetryPolicy(QueueConfig(cleanup_timeout=BOUND, retry_initial_delay=0.5,
                                 retry_max_delay=30.0))


class Outage:
    """Each try waits its whole bound, then fails as a dropped connection would;
    after `lands_at` tries (if given) a try lands."""

    def __init__(self, lands_at: int | None = None) -> None:
        self.tries: list[float] = []
        self.lands_at = lands_at

    async def __call__(self) -> int:
        self.tries.append(trio.current_time())
        await trio.sleep(BOUND)
        if self.lands_at is not None and len(self.tries) >= self.lands_at:
            return 7
        raise ConnectionResetError("no answer (injected)")


async def test_an_unlimited_budget_retries_until_the_write_lands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outage = Outage(lands_at=12)
    assert await POLICY.final("give-back", outage, budget=Budget()) == 7
    assert len(outage.tries) == 12  # through pauses of up to 30 s: no bound while running


@pytest.mark.parametrize("close_after", [0.0, 3.0, 40.0, 50.0, 62.0])
async def test_a_closed_budget_ends_two_bounds_after_the_close_at_most(
    autojump_clock: trio.testing.MockClock, close_after: float,
) -> None:
    """Closed at entry (0), during a try (3), near the end of a pause (40: the
    pauses are 0.5, 1, 2, 4, 8, 16, 30 s), early in the 16 s pause (50, which
    the close must cut short), and between: the write raises
    `NotWithinTheStopsBound` within 2 × BOUND of the close, begins no try after
    BOUND, and makes no try after the budget is spent."""
    outage = Outage()
    budget = Budget()
    start = trio.current_time()
    ended = math.inf

    async def write() -> None:
        nonlocal ended
        with pytest.raises(NotWithinTheStopsBound):
            await POLICY.final("give-back", outage, budget=budget)
        ended = trio.current_time()

    with trio.fail_after(1000):  # trio's clock: a write that never ends fails here
        async with trio.open_nursery() as nursery:
            if close_after == 0.0:
                budget.close_in(BOUND)
            nursery.start_soon(write)
            if close_after:
                await trio.sleep(close_after)
                budget.close_in(BOUND)
    closed = start + close_after
    assert outage.tries, "a closed budget still makes its first try"
    assert ended <= closed + 2 * BOUND
    assert all(at <= closed + BOUND for at in outage.tries), outage.tries


async def test_a_hard_stop_during_the_pause_makes_one_last_try(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The outer cancel (a hard stop) is not the budget: the pause it cuts is
    followed by one last, shielded try, then the cancel goes on."""
    outage = Outage()
    with trio.move_on_after(BOUND + 0.1):  # during the first pause
        await POLICY.final("give-back", outage, budget=Budget())
    assert len(outage.tries) == 2


class RefusedThenOutage:
    """A store whose batch of finishes is refused on its merits (a trigger, say),
    and whose finishes alone then meet an outage that lasts an hour."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    async def finish_many_and_claim(self, finishing: Any, want: int, starts: Any = ()) -> Any:
        self.calls.append((trio.current_time(), len(finishing)))
        await trio.sleep(0.1)
        if len(finishing) > 1:
            raise ValueError("refused on its merits (injected)")
        if trio.current_time() < 3600:
            raise ConnectionResetError("no answer (injected)")
        return {f[0].id: None for f in finishing}, []

    async def discard_unrecorded(self, job: Any, why: str) -> bool:
        return True


async def test_the_fallback_of_a_refused_batch_keeps_to_the_same_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The wind-down's last finishes: the batch is refused, so each finish is
    sent alone, and those meet an outage. They used to retry on their own,
    shielded, until the outage ended (an hour here), whatever the budget; they
    now stop with it, two bounds after the close at most."""
    store = RefusedThenOutage()
    stats = types.SimpleNamespace(finishing=2, done=0, failed=0, marked_building=0)
    state = types.SimpleNamespace(stats=stats, kick=lambda: None)
    config = QueueConfig(cleanup_timeout=BOUND, retry_initial_delay=0.5, retry_max_delay=30.0,
                         terminalize_tries=1)
    completer = Completer(cast(Any, state), cast(Any, store), RetryPolicy(config),
                          lambda exc: None)
    batch = [Finish(cast(Any, types.SimpleNamespace(id=n)), None, "done") for n in (1, 2)]
    budget = Budget()
    budget.close_in(BOUND)  # the wind-down: closing already
    with trio.fail_after(1000), pytest.raises(NotWithinTheStopsBound):
        await completer.send(batch, 0, budget=budget)
    assert trio.current_time() <= 2 * BOUND
    assert all(at <= BOUND for at, _ in store.calls), store.calls
