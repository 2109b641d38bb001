"""temper.common.retry: backoff, deadline, what is retried and the hook between attempts, on a fake
clock (its sleep only moves the clock: no real waiting, nothing timed)."""

from __future__ import annotations

import asyncio

import pytest

from temper.common.errors import InvalidArgument, Unavailable
from temper.common.retry import retry


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def failing(errors: list[BaseException], result="ok", clock: FakeClock | None = None, takes: float = 0.0):
    """An attempt that raises ``errors`` in turn (each attempt taking ``takes`` seconds), then returns ``result``."""
    calls = []

    async def attempt():
        calls.append(clock() if clock else None)
        if clock:
            clock.now += takes
        if errors:
            raise errors.pop(0)
        return result

    return attempt, calls


def run(coro):
    return asyncio.run(coro)


def test_backs_off_exponentially_up_to_the_cap_and_returns_the_answer():
    clock = FakeClock()
    attempt, calls = failing([Unavailable(f"down {i}") for i in range(6)], clock=clock)
    result = run(retry(attempt, seconds=None, first_delay=0.1, max_delay=0.5, jitter=0.0, clock=clock, sleep=clock.sleep))
    assert result == "ok" and len(calls) == 7
    assert clock.pauses == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])


def test_jitter_stretches_each_pause_by_at_most_its_fraction():
    clock = FakeClock()
    attempt, _ = failing([Unavailable("down")] * 3, clock=clock)
    draws = iter([0.0, 0.5, 1.0])
    run(retry(attempt, seconds=None, first_delay=1.0, max_delay=10.0, jitter=0.5, clock=clock, sleep=clock.sleep,
              rand=lambda: next(draws)))
    assert clock.pauses == pytest.approx([1.0, 2.0 * 1.25, 4.0 * 1.5])


def test_no_attempt_starts_after_the_deadline_and_the_last_error_is_raised():
    clock = FakeClock()
    errors = [Unavailable(f"down {i}") for i in range(20)]
    attempt, calls = failing(errors, clock=clock)
    with pytest.raises(Unavailable) as raised:
        run(retry(attempt, seconds=1.0, first_delay=0.2, max_delay=5.0, jitter=0.0, clock=clock, sleep=clock.sleep))
    # attempts at 0, 0.2, 0.6; the next would start at 1.4 > 1.0
    assert [c - 100.0 for c in calls] == pytest.approx([0.0, 0.2, 0.6])
    assert raised.value.message == "down 2"
    assert all(c <= 101.0 for c in calls)


def test_the_deadline_counts_from_the_first_attempt_unless_from_the_first_failure():
    # an attempt that waits 5 s before it fails (a long queue): past a 2 s deadline already
    clock = FakeClock()
    attempt, calls = failing([Unavailable("down"), Unavailable("down")], clock=clock, takes=5.0)
    with pytest.raises(Unavailable):
        run(retry(attempt, seconds=2.0, jitter=0.0, clock=clock, sleep=clock.sleep))
    assert len(calls) == 1

    clock = FakeClock()
    attempt, calls = failing([Unavailable("down")], clock=clock, takes=5.0)
    assert run(retry(attempt, seconds=2.0, jitter=0.0, from_first_failure=True, clock=clock, sleep=clock.sleep)) == "ok"
    assert len(calls) == 2


def test_other_errors_are_raised_at_once():
    clock = FakeClock()
    attempt, calls = failing([InvalidArgument("bad"), Unavailable("down")], clock=clock)
    with pytest.raises(InvalidArgument):
        run(retry(attempt, seconds=None, clock=clock, sleep=clock.sleep))
    assert len(calls) == 1 and clock.pauses == []


def test_what_is_retryable_is_the_callers_choice_by_type_or_predicate():
    clock = FakeClock()
    for retryable in [(KeyError, Unavailable), lambda exc: isinstance(exc, KeyError)]:
        attempt, calls = failing([KeyError("k"), KeyError("k")], clock=clock)
        assert run(retry(attempt, seconds=None, retryable=retryable, clock=clock, sleep=clock.sleep)) == "ok"
        assert len(calls) == 3
    attempt, calls = failing([Unavailable("down")], clock=clock)
    with pytest.raises(Unavailable):  # the predicate names KeyError only
        run(retry(attempt, seconds=None, retryable=lambda exc: isinstance(exc, KeyError), clock=clock, sleep=clock.sleep))
    assert len(calls) == 1


def test_the_hook_runs_between_attempts_with_the_error_and_may_change_the_next_attempt():
    clock = FakeClock()
    workers = ["a", "b", "c"]
    tried, seen = [], []

    async def attempt():
        tried.append(workers[0])
        if workers[0] != "c":
            raise Unavailable(f"{workers[0]} is down")
        return workers[0]

    async def repick(exc, pause):
        seen.append((exc.message, pause))
        workers.pop(0)

    assert run(retry(attempt, seconds=10.0, jitter=0.0, between=repick, clock=clock, sleep=clock.sleep)) == "c"
    assert tried == ["a", "b", "c"]
    assert seen == [("a is down", 0.2), ("b is down", 0.4)]


def test_a_hook_is_not_run_when_the_deadline_ends_the_retries():
    clock = FakeClock()
    attempt, _ = failing([Unavailable("down")] * 5, clock=clock)
    hooked = []
    with pytest.raises(Unavailable):
        run(retry(attempt, seconds=0.1, jitter=0.0, between=lambda exc, pause: hooked.append(pause), clock=clock,
                  sleep=clock.sleep))
    assert hooked == []


def test_with_real_sleep_tiny_delays_retry_and_cancellation_is_not_retried():
    attempt, calls = failing([Unavailable("down")] * 2)
    assert run(retry(attempt, seconds=5.0, first_delay=0.001, max_delay=0.002)) == "ok"
    assert len(calls) == 3

    async def cancelled():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        run(retry(cancelled, seconds=None, retryable=BaseException))
