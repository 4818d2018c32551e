"""
Adaptive look-ahead (`QueueConfig.prefetch="auto"`, the default of plain queues).

A fixed look-ahead makes a short job wait behind a long one; none makes every
short job pay a round trip in series. So a lane with "auto" claims ahead only
as many jobs as its recent run times say will start soon: with `t` the median
of its last `WINDOW` run times and `c` its slots, the k-th job claimed ahead
starts after about ``k * t / c`` seconds, so it claims ahead

    floor(wait * c / t), at most `PER_SLOT` * c and `MOST`,

jobs, where `wait` is `QueueConfig.prefetch_auto_wait` (50 ms): none before
its first run, and none while `t` is `wait` or more (a lane whose jobs run for
seconds claims nothing ahead). The median, not a mean: one long job among many
short ones does not take the short ones' look-ahead away, and the TTL
(`QueueConfig.prefetch_auto_ttl`, 1 s) bounds what a job claimed ahead of a run
that turns long can wait: then it goes back for another slot or replica.
"""

from __future__ import annotations

import collections
import math

import attrs

#: Run times a lane remembers; the look-ahead follows their median.
WINDOW = 16
#: Jobs claimed ahead per slot, at most.
PER_SLOT = 4
#: Jobs claimed ahead by one lane, at most, however many slots it has.
MOST = 256


@attrs.define(eq=False)
class LookAhead:
    """
    One lane's look-ahead: fed each job's time in a slot (`observe`), it
    keeps `size` (jobs to claim ahead of the free slots) up to date, so that
    reading it, which every claim does, costs nothing.
    """

    #: The lane's slots.
    concurrency: int
    #: The expected wait of the last job claimed ahead, at most (seconds).
    wait: float
    #: Jobs to claim ahead now.
    size: int = 0
    #: The median run time the size follows (None before the first run).
    typical: float | None = None
    _times: collections.deque[float] = attrs.field(
        factory=lambda: collections.deque(maxlen=WINDOW), alias="_times")

    @property
    def cap(self) -> int:
        return min(PER_SLOT * self.concurrency, MOST)

    def observe(self, seconds: float) -> None:
        """A job spent `seconds` in a slot: the size follows."""
        self._times.append(seconds)
        ordered = sorted(self._times)
        middle = len(ordered) // 2
        if len(ordered) % 2:
            self.typical = ordered[middle]
        else:
            self.typical = (ordered[middle - 1] + ordered[middle]) / 2
        self.size = sized(self.typical, self.concurrency, self.wait, self.cap)


def sized(typical: float, concurrency: int, wait: float, cap: int) -> int:
    """Jobs to claim ahead when a job typically runs `typical` seconds."""
    if typical >= wait:
        return 0
    if typical <= 0:
        return cap
    return min(cap, math.floor(wait * concurrency / typical))
