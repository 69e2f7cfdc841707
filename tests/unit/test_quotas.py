"""The per-principal token buckets (call rate and Watch write budget): bounded memory, answers unchanged."""

from __future__ import annotations

from coordinator.api.quotas import _BUCKETS_KEPT, RateLimiter


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buckets_of_principals_gone_quiet_are_forgotten() -> None:
    clock = _Clock()
    limiter = RateLimiter(rate=10, burst=10, clock=clock)
    most = 0
    for n in range(3 * _BUCKETS_KEPT):  # without auth, principals are whatever names callers send
        clock.now += 1.0  # every earlier bucket is full again: it answers as a new one would
        assert limiter.acquire(f"caller-{n}") == 0
        most = max(most, limiter.buckets)
    assert most <= _BUCKETS_KEPT


def test_a_principal_over_its_rate_stays_held_however_many_others_come() -> None:
    clock = _Clock()
    limiter = RateLimiter(rate=10, burst=10, clock=clock)
    for _ in range(10):
        assert limiter.acquire("busy") == 0
    for n in range(3 * _BUCKETS_KEPT):  # all at the same moment: none of their buckets is full
        assert limiter.acquire(f"caller-{n}") == 0
    assert limiter.buckets == 3 * _BUCKETS_KEPT + 1  # each still owes its token: none forgotten
    assert limiter.acquire("busy") == 0.1  # one token at 10/s
    clock.now += 0.1
    assert limiter.acquire("busy") == 0
