"""Watch feeds: one etcd watch per mailbox, fanned out to every watcher of it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from coordinator.core.errors import StoreUnavailable
from coordinator.core.storage import Change, FeedLost, FeedQueue

log = logging.getLogger(__name__)


@dataclass
class _Feed:
    """One etcd watch of one mailbox, fanned out to every subscriber's queue."""

    mailbox: str
    subscribers: set[FeedQueue] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


# A subscriber this many batches behind is cut off (it re-subscribes and gets a fresh snapshot) rather
# than let one slow reader grow the coordinator's memory without bound. The batches are shared by every
# subscriber of the mailbox, so a queue costs 8 bytes a slot; what a stuck one can pin is at most this many
# batches of the mailbox's changes. The Watch handler's drain timeout usually ends a stuck stream first.
SUBSCRIBER_BACKLOG = 4096
# How long a feed keeps trying to resume its watch while etcd is unreachable before giving up.
FEED_RESUME_SECONDS = 10.0


class FeedHub:
    """Shares one etcd watch per mailbox among all of its watchers."""

    def __init__(
        self,
        current_revision: Callable[[], Awaitable[int]],
        watch: Callable[[str, int], AsyncIterator[list[Change]]],
    ) -> None:
        self._current_revision = current_revision
        self._watch = watch
        self._feeds: dict[str, _Feed] = {}
        self._lock = asyncio.Lock()

    @property
    def mailboxes(self) -> int:
        return len(self._feeds)

    @property
    def subscribers(self) -> int:
        return sum(len(feed.subscribers) for feed in self._feeds.values())

    @contextlib.asynccontextmanager
    async def subscribe(self, mailbox: str) -> AsyncIterator[FeedQueue]:
        queue: FeedQueue = asyncio.Queue(SUBSCRIBER_BACKLOG)
        async with self._lock:
            feed = self._feeds.get(mailbox)
            if feed is None:
                # Start at the current revision: every later change reaches the queue, and the
                # subscriber's snapshot (read after this) tells it which of them it already knows.
                start = await self._current_revision() + 1
                feed = _Feed(mailbox)
                feed.task = asyncio.create_task(self._run(feed, start), name=f"watch {mailbox}")
                self._feeds[mailbox] = feed
            feed.subscribers.add(queue)
        try:
            yield queue
        finally:
            feed.subscribers.discard(queue)
            if not feed.subscribers and self._feeds.get(mailbox) is feed:
                del self._feeds[mailbox]
                if feed.task is not None:
                    feed.task.cancel()

    async def _run(self, feed: _Feed, start_revision: int) -> None:
        next_revision = start_revision
        failing_since: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    async for changes in self._watch(feed.mailbox, next_revision):
                        failing_since = None
                        next_revision = changes[-1].revision + 1 if changes else next_revision
                        self._deliver(feed, changes)
                except StoreUnavailable as error:
                    # etcd keeps history: resuming from the next revision loses nothing.
                    failing_since = failing_since or loop.time()
                    if loop.time() - failing_since > FEED_RESUME_SECONDS:
                        raise FeedLost(str(error)) from error
                    await asyncio.sleep(0.2)
        except FeedLost as lost:
            self._end(feed, lost)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # pragma: no cover - defensive: never leave watchers hanging
            log.exception("mailbox watch failed")
            self._end(feed, FeedLost(f"mailbox watch failed: {error}"))

    def _deliver(self, feed: _Feed, changes: list[Change]) -> None:
        if not changes:
            return
        for queue in list(feed.subscribers):
            try:
                queue.put_nowait(changes)
            except asyncio.QueueFull:
                feed.subscribers.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait(
                    FeedLost(
                        f"this watcher fell {SUBSCRIBER_BACKLOG} batches of changes behind; "
                        "watch again for a fresh snapshot",
                        slow_subscriber=True,
                    )
                )

    def _end(self, feed: _Feed, lost: FeedLost) -> None:
        if self._feeds.get(feed.mailbox) is feed:
            del self._feeds[feed.mailbox]
        for queue in list(feed.subscribers):
            with contextlib.suppress(asyncio.QueueEmpty):
                while queue.full():
                    queue.get_nowait()
            queue.put_nowait(lost)

    async def close(self) -> None:
        for feed in list(self._feeds.values()):
            self._end(feed, FeedLost("the coordinator is shutting down"))
            if feed.task is not None:
                feed.task.cancel()
        self._feeds.clear()
