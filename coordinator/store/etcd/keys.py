"""The etcd key layout. Every id component is percent-encoded, so no id can leave its place in a key.

Under the deployment prefix P:

    P m/<mailbox>/s/<kind>/<id>     the subject: its claim or reply record (fencing token = create revision)
    P m/<mailbox>/e/<kind>/<id>     why the subject was last freed by a call (short-lived)
    P d/<mailbox>/<notification>    a delivery record (delivery dedup)
    P x/s/<mailbox>/<kind>/<id>     a SENDING subject (no lease), for the IN_DOUBT sweeper
    P x/l/<mailbox>/<kind>/<id>     its send marker, on an etcd lease of the send timeout: when etcd has
                                    expired it while the subject is still SENDING, the send is IN_DOUBT
    P t/<mailbox>/<thread>/s/<kind>/<id>   a subject claimed for a message of the thread, and when that
                                    message was received (for replies written outside the coordinator)
    P t/<mailbox>/<thread>/r        the latest reply written outside the coordinator in the thread
    P c/<mailbox>/<name>            a cursor (docs/design.md#cursors): its value and position
    P c/<mailbox>/<name>/r          its range in progress, on an etcd lease of the range's TTL
    P g/<mailbox>/t/<thread>/s/<token>/<kind>/<id>   an agent's send counted in the thread's reply budget
                                    (docs/design.md#reply-storms), on an etcd lease of the budget's window
    P g/<mailbox>/t/<thread>/i      the thread's newest inbound message (moved on?)
    P g/<mailbox>/c/<address>/s/<token>/<kind>/<id>  an agent's send counted in the correspondent's budget, the same way
    P g/<mailbox>/a/<kind>/<id>     why agents leave this message (RecordIncoming's automated reason)

One thread's keys share the prefix ``P t/<mailbox>/<thread>/``: RecordOutgoing reads them with one range and
compares that range unchanged when it writes.

One mailbox's subjects and end marks share the prefix ``P m/<mailbox>/``, so one etcd watch sees a
deletion and the reason for it in the same revision.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from coordinator.core.domain import Subject, SubjectKind
from coordinator.core.storage import subject_order

# The key families, relative to the deployment prefix. Nothing else spells them.
_MAILBOXES = b"m/"
_DELIVERIES = b"d/"
_SENDING_FAMILY = b"x/"
_SENDING_INDEX = _SENDING_FAMILY + b"s/"
_SEND_MARKERS = _SENDING_FAMILY + b"l/"
_THREADS = b"t/"
_CURSORS = b"c/"
_GUARDS = b"g/"

# The families counted for operators (the etcd_keys metric, docs/operations.md). "sending" counts the SENDING
# index (one key per send begun and not settled), not the send markers beside it.
COUNTED_FAMILIES = {"subjects": _MAILBOXES, "deliveries": _DELIVERIES, "sending": _SENDING_INDEX, "threads": _THREADS}


def _enc(component: str) -> str:
    # quote() with no safe characters leaves only [A-Za-z0-9_.~-]: '/' and '%' become %2F and %25.
    return quote(component, safe="")


# <mailbox>/<kind>/<id>, encoded as the stores' listing order is: so etcd's key order is that order.
_subject_path = subject_order


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Keys:
    def __init__(self, prefix: str) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self.prefix = prefix
        self._root = prefix.encode()

    def mailbox(self, mailbox: str) -> bytes:
        return self._root + _MAILBOXES + f"{_enc(mailbox)}/".encode()

    def mailboxes(self) -> bytes:
        """The prefix of every mailbox's subjects and end marks."""
        return self._root + _MAILBOXES

    def is_subject(self, key: bytes) -> bool:
        """Whether a key under ``mailboxes()`` is a subject (not an end mark)."""
        parts = key[len(self.mailboxes()) :].split(b"/")
        return len(parts) == 4 and parts[1] == b"s"

    def subjects(self, mailbox: str) -> bytes:
        return self.mailbox(mailbox) + b"s/"

    def subject(self, subject: Subject) -> bytes:
        return self.mailbox(subject.mailbox) + f"s/{subject.kind.value}/{_enc(subject.id)}".encode()

    def end_marks(self, mailbox: str) -> bytes:
        return self.mailbox(mailbox) + b"e/"

    def end_mark(self, subject: Subject) -> bytes:
        return self.mailbox(subject.mailbox) + f"e/{subject.kind.value}/{_enc(subject.id)}".encode()

    def delivery(self, mailbox: str, notification_id: str) -> bytes:
        return self._root + _DELIVERIES + f"{_enc(mailbox)}/{_enc(notification_id)}".encode()

    def thread(self, mailbox: str, thread_id: str) -> bytes:
        """The prefix of one thread's keys: its claimed subjects and its latest outside reply."""
        return self._root + _THREADS + f"{_enc(mailbox)}/{_enc(thread_id)}/".encode()

    def thread_mark(self, mailbox: str, thread_id: str) -> bytes:
        return self.thread(mailbox, thread_id) + b"r"

    def thread_entry(self, thread_id: str, subject: Subject) -> bytes:
        return self.thread(subject.mailbox, thread_id) + f"s/{subject.kind.value}/{_enc(subject.id)}".encode()

    def parse_thread_entry(self, mailbox: str, thread_id: str, key: bytes) -> Subject | None:
        """The subject of a key under ``thread(mailbox, thread_id)``; None for the thread's mark."""
        parts = key[len(self.thread(mailbox, thread_id)) :].decode().split("/")
        if len(parts) != 3 or parts[0] != "s":
            return None
        return Subject(mailbox, SubjectKind(parts[1]), unquote(parts[2]))

    def automated(self, subject: Subject) -> bytes:
        return self._root + _GUARDS + f"{_enc(subject.mailbox)}/a/{subject.kind.value}/{_enc(subject.id)}".encode()

    def stopped_all(self, mailbox: str) -> bytes:
        return self._root + _GUARDS + f"{_enc(mailbox)}/x/".encode()

    def stopped(self, subject: Subject, thread_id: str) -> bytes:
        """One per thread; a message with no thread is its own conversation."""
        where = f"t/{_enc(thread_id)}" if thread_id else f"s/{subject.kind.value}/{_enc(subject.id)}"
        return self.stopped_all(subject.mailbox) + where.encode()

    def thread_sends(self, mailbox: str, thread_id: str) -> bytes:
        return self._root + _GUARDS + f"{_enc(mailbox)}/t/{_enc(thread_id)}/s/".encode()

    def thread_inbound(self, mailbox: str, thread_id: str) -> bytes:
        return self._root + _GUARDS + f"{_enc(mailbox)}/t/{_enc(thread_id)}/i".encode()

    def correspondent_sends(self, mailbox: str, correspondent: str) -> bytes:
        return self._root + _GUARDS + f"{_enc(mailbox)}/c/{_enc(correspondent)}/s/".encode()

    @staticmethod
    def counted_send(sends: bytes, token: int, subject: Subject) -> bytes:
        """One send's key under a ``thread_sends`` or ``correspondent_sends`` prefix: its token and its subject,
        since claims granted in one group commit share their token (two sends would be one key, counted once)."""
        return sends + f"{token}/{subject.kind.value}/{_enc(subject.id)}".encode()

    @staticmethod
    def counted_token(sends: bytes, key: bytes) -> int:
        return int(key[len(sends) :].split(b"/", 1)[0])

    def cursor(self, mailbox: str, name: str) -> bytes:
        return self._root + _CURSORS + f"{_enc(mailbox)}/{_enc(name)}".encode()

    def cursor_range(self, mailbox: str, name: str) -> bytes:
        return self.cursor(mailbox, name) + b"/r"

    def deliveries(self, mailbox: str) -> bytes:
        """The prefix of one mailbox's delivery records."""
        return self._root + _DELIVERIES + f"{_enc(mailbox)}/".encode()

    def delivery_notification_id(self, mailbox: str, key: bytes) -> str:
        """The notification id of a key under :meth:`deliveries`."""
        return unquote(key[len(self.deliveries(mailbox)) :].decode())

    def counted_families(self) -> dict[str, bytes]:
        """The prefix of each family counted for operators (``Store.count_records``)."""
        return {family: self._root + relative for family, relative in COUNTED_FAMILIES.items()}

    def sending_family(self) -> bytes:
        return self._root + _SENDING_FAMILY

    def sending_index(self) -> bytes:
        return self._root + _SENDING_INDEX

    def send_markers(self) -> bytes:
        return self._root + _SEND_MARKERS

    def sending(self, subject: Subject) -> bytes:
        return self.sending_index() + _subject_path(subject)

    def send_marker(self, subject: Subject) -> bytes:
        return self.send_markers() + _subject_path(subject)

    def parse_sending(self, family: bytes, key: bytes) -> Subject:
        """The subject of a key under ``sending_index()`` or ``send_markers()``."""
        mailbox, kind, subject_id = key[len(family) :].decode().split("/")
        return Subject(unquote(mailbox), SubjectKind(kind), unquote(subject_id))

    def parse_mailbox_key(self, mailbox: str, key: bytes) -> tuple[str, Subject] | None:
        """For a key under ``mailbox(mailbox)``: ("s" or "e", the subject); None for anything else."""
        rest = key[len(self.mailbox(mailbox)) :].decode()
        parts = rest.split("/")
        if len(parts) != 3 or parts[0] not in ("s", "e"):
            return None
        return parts[0], Subject(mailbox, SubjectKind(parts[1]), unquote(parts[2]))
