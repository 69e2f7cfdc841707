"""The rules that end claims whose etcd lease was restarted (coordinator/store/etcd/lapses.py) and judge a
restarted serve's claims on the clock that wrote them (coordinator/store/etcd/clock_frames.py), on injected
clocks. The real processes are in tests/ops/test_claims_across_restarts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.core.domain import HolderKind, State, SubjectRecord
from coordinator.store.etcd import clock_frames
from coordinator.store.etcd.clock_frames import ClockFrames
from coordinator.store.etcd.lapses import ENDED_BY_ITS_LEASE_S, Lapsed, LapseKeeper

WALL_MS = 1_800_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _claim(ttl_s: int, expires_in_ms: int) -> SubjectRecord:
    return SubjectRecord(State.CLAIMED, "agent-a", HolderKind.AGENT, WALL_MS, ttl_s, expires_ms=WALL_MS + expires_in_ms)


def test_a_claim_written_before_a_new_term_is_due_once_its_ttl_passed_and_not_before() -> None:
    clock = Clock()
    keeper = LapseKeeper(clock)
    keeper.wrote(b"k", _claim(10, 10_400), revision=7, term=3, wall_now_ms=WALL_MS)
    clock.now += 10.39
    assert not keeper.overdue()
    assert keeper.due(term=4) == []  # its expires_at (10.4 s, rounded up) is later than its TTL: that decides
    clock.now += 0.02
    assert keeper.overdue()
    assert keeper.due(term=4) == [Lapsed(b"k", 7)]


def test_never_before_its_ttl_even_when_the_wall_clock_says_it_expired() -> None:
    """A wall clock stepped forward between the decision and the write says no time is left: its TTL still is."""
    clock = Clock()
    keeper = LapseKeeper(clock)
    keeper.wrote(b"k", _claim(10, -5_000), revision=7, term=3, wall_now_ms=WALL_MS)
    clock.now += 9.9
    assert keeper.due(term=4) == []
    clock.now += 0.2
    assert keeper.due(term=4) == [Lapsed(b"k", 7)]


def test_in_the_same_term_its_lease_ends_it_and_it_is_forgotten() -> None:
    clock = Clock()
    keeper = LapseKeeper(clock)
    keeper.wrote(b"k", _claim(10, 10_000), revision=7, term=3, wall_now_ms=WALL_MS)
    clock.now += 10.5
    assert keeper.due(term=3) == []
    assert len(keeper) == 1  # a new leader may still restart its lease before etcd expires it
    clock.now += ENDED_BY_ITS_LEASE_S
    assert keeper.due(term=3) == []
    assert len(keeper) == 0


def test_a_later_write_replaces_the_claim_and_an_ending_forgets_it() -> None:
    clock = Clock()
    keeper = LapseKeeper(clock)
    keeper.wrote(b"k", _claim(10, 10_000), revision=7, term=3, wall_now_ms=WALL_MS)
    clock.now += 8
    keeper.wrote(b"k", _claim(10, 10_000), revision=9, term=3, wall_now_ms=WALL_MS)  # renewed
    clock.now += 8
    assert keeper.due(term=4) == []
    clock.now += 3
    assert keeper.due(term=4) == [Lapsed(b"k", 9)]
    keeper.wrote(b"k", None, revision=0, term=4, wall_now_ms=WALL_MS)  # released
    assert keeper.due(term=5) == []
    sending = SubjectRecord(State.SENDING, "agent-a", HolderKind.AGENT, WALL_MS, 10, expires_ms=None)
    keeper.wrote(b"s", sending, revision=11, term=4, wall_now_ms=WALL_MS)
    assert len(keeper) == 0


def test_an_adopted_claim_is_due_when_its_time_passes_whatever_the_term() -> None:
    clock = Clock()
    keeper = LapseKeeper(clock)
    keeper.adopt(b"old", revision=3, left_s=-20.0)
    keeper.adopt(b"later", revision=4, left_s=5.0)
    assert keeper.due(term=1) == [Lapsed(b"old", 3)]
    clock.now += 5
    assert Lapsed(b"later", 4) in keeper.due(term=1)


def test_it_keeps_at_most_its_limit() -> None:
    keeper = LapseKeeper(Clock(), kept=2)
    for n in range(3):
        keeper.adopt(f"k{n}".encode(), revision=n, left_s=0)
    assert {lapsed.key for lapsed in keeper.due(term=1)} == {b"k1", b"k2"}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, float]]:
    """The machine's clocks as the frames read them: (wall ms, boot id, uptime s), set by the test."""
    now = [(WALL_MS, "boot-1", 1_000.0)]
    monkeypatch.setattr(clock_frames, "clock_now", lambda: now[0])
    return now


def test_a_restarted_run_judges_each_claim_on_the_clock_that_wrote_it(
    tmp_path: Path, machine: list[tuple[int, str, float]]
) -> None:
    first = ClockFrames(tmp_path)
    first.begin(from_revision=10)  # a run 5 minutes slow
    machine[0] = (WALL_MS - 300_000 + 4_000, "boot-1", 1_004.0)
    first.touch()  # its last moment: 4 s after it began, on its clock
    # The next run starts 6 s later (uptime), its wall clock 5 minutes fast.
    machine[0] = (WALL_MS + 300_000 + 10_000, "boot-1", 1_010.0)
    second = ClockFrames(tmp_path)
    second.begin(from_revision=50)
    # A claim the first run wrote expiring 20 s after its frame began (its clock): 20 - 4 - 6 = 10 s left.
    assert second.seconds_left(WALL_MS - 300_000 + 20_000, mod_revision=12) == pytest.approx(10.0)
    assert second.seconds_left(WALL_MS - 300_000 + 2_000, mod_revision=12) == pytest.approx(-8.0)
    assert second.seconds_left(WALL_MS, mod_revision=9) is None  # older than any frame: left to its lease
    assert second.seconds_left(WALL_MS, mod_revision=50) is None  # this run's own
    # After a reboot (another boot id) the uptime says nothing: the wall clocks' difference, never below 0.
    machine[0] = (WALL_MS - 600_000, "boot-2", 3.0)
    assert second.seconds_left(WALL_MS - 300_000 + 20_000, mod_revision=12) == pytest.approx(16.0)


def test_a_run_that_stopped_before_ending_the_claims_before_it_keeps_their_frame(
    tmp_path: Path, machine: list[tuple[int, str, float]]
) -> None:
    ClockFrames(tmp_path).begin(from_revision=10)
    machine[0] = (WALL_MS + 60_000, "boot-1", 1_060.0)
    ClockFrames(tmp_path).begin(from_revision=40)  # started, then stopped before the claims of revision 12 ended
    machine[0] = (WALL_MS + 61_000, "boot-1", 1_061.0)
    third = ClockFrames(tmp_path)
    assert [frame.from_revision for frame in third.before] == [10, 40]
    assert third.seconds_left(WALL_MS + 100_000, mod_revision=12) == pytest.approx(100 - 61)
    assert third.seconds_left(WALL_MS + 100_000, mod_revision=41) == pytest.approx(100 - 60 - 1)
