"""Which clock wrote the claims of an embedded etcd, so that after ``serve`` and its etcd stopped and started again
their time is judged on that clock, never on another (docs/design.md#leases-and-expiry, "Across an outage or a
restart").

A claim's ``expires_ms`` is the wall clock of the serve that wrote it. A serve started later may run under another
clock (set by hand, or by libfaketime, as the clock-skew tests do), and comparing one clock's stamp with another's
would free claims early by the difference. So each serve run keeps a *frame* in the data dir: the etcd revision
from which on it wrote (every record it writes has a greater mod revision), and a moment of its clocks, renewed
while it runs: its wall clock, and the kernel's time since boot with the boot's id. A later run judges a record by
the frame of the run that wrote it: how long that claim had left at the frame's last moment (a difference of two
readings of one wall clock), less the time that has passed since, read from the kernel's uptime (``/proc/uptime``,
one clock for every process of one boot, which libfaketime does not reach). So no offset of either run's wall clock
moves the answer. Across a reboot (another boot id) the uptime says nothing; the wall clock's difference is used,
never below zero: a clock set ahead while the machine was down frees early by that much (docs say so).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ClockFrames", "Frame", "clock_now"]

CLOCK_FILE = "clock.json"
# The last runs' frames kept: a claim written more restarts ago than this is left to etcd's lease (later, never
# earlier than its time).
KEPT_FRAMES = 4
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_UPTIME = Path("/proc/uptime")


@dataclass(frozen=True)
class Frame:
    """One serve run's clock: records with a mod revision of ``from_revision`` or more were written by it (until
    the next frame's), and at its last moment its wall clock read ``wall_ms`` while the boot ``boot_id`` was
    ``uptime_s`` old."""

    from_revision: int
    wall_ms: int
    boot_id: str
    uptime_s: float


def clock_now() -> tuple[int, str, float]:
    """(wall ms, boot id, uptime s) now; the boot id is empty where /proc does not say (not Linux)."""
    wall_ms = time.time_ns() // 1_000_000
    try:
        boot_id = _BOOT_ID.read_text().strip()
        uptime_s = float(_UPTIME.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return wall_ms, "", 0.0
    return wall_ms, boot_id, uptime_s


def seconds_since(frame: Frame) -> float:
    """Seconds since the frame's last moment: by the kernel's uptime within one boot, else by the wall clock."""
    wall_ms, boot_id, uptime_s = clock_now()
    if boot_id and boot_id == frame.boot_id:
        return max(uptime_s - frame.uptime_s, 0.0)
    return max((wall_ms - frame.wall_ms) / 1000, 0.0)


class ClockFrames:
    """The data dir's frames: those of the runs before this one (read at start), and this run's, written once
    it knows its etcd revision and renewed by ``touch``."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / CLOCK_FILE
        self.before = self._read()
        self._mine: Frame | None = None

    def _read(self) -> list[Frame]:
        try:
            document = json.loads(self.path.read_text())
            frames = [Frame(**frame) for frame in document["frames"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return sorted(frames, key=lambda frame: frame.from_revision)

    def begin(self, from_revision: int) -> None:
        """This run writes its records from ``from_revision`` on."""
        wall_ms, boot_id, uptime_s = clock_now()
        self._mine = Frame(from_revision, wall_ms, boot_id, uptime_s)
        self._write()

    def touch(self) -> None:
        """Renews this run's frame's moment (the later it is, the less a stop right after it costs)."""
        if self._mine is None:
            return
        wall_ms, boot_id, uptime_s = clock_now()
        self._mine = Frame(self._mine.from_revision, wall_ms, boot_id, uptime_s)
        self._write()

    def _write(self) -> None:
        frames = [*self.before, *([self._mine] if self._mine is not None else [])][-KEPT_FRAMES:]
        temporary = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # a full disk costs precision, not service: etcd's leases still end
            temporary.write_text(json.dumps({"frames": [asdict(frame) for frame in frames]}))
            temporary.replace(self.path)

    def seconds_left(self, expires_ms: int, mod_revision: int) -> float | None:
        """How long a claim written at ``mod_revision`` with ``expires_ms`` has left now, on the clock of the run
        that wrote it; None when no frame of a run before this one covers it (left to etcd's lease), or this run
        wrote it (its own clock ends it)."""
        if self._mine is not None and mod_revision >= self._mine.from_revision:
            return None
        frame = next((f for f in reversed(self.before) if f.from_revision <= mod_revision), None)
        if frame is None:
            return None
        return (expires_ms - frame.wall_ms) / 1000 - seconds_since(frame)
