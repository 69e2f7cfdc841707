"""Logging set-up: one JSON object per line for machines, or plain lines for a terminal.

Structured fields travel in ``extra={"fields": {...}}``; both formats print them (JSON as keys of the
object, text as ``key=value`` after the message).

Records are written by a thread of their own, through a bounded queue: a slow or blocked log sink (a full
pipe nobody reads) must never stall the event loop that serves claims. When the queue is full, records are
dropped and counted (``dropped()``, exported as ``inbox_coordinator_log_records_dropped_total``).

The writer takes what has queued up at most every ``WRITE_PAUSE_S`` and writes it with one flush: woken for each
record, it handed the GIL back and forth with the event loop on every call, which cost a coordinator ~130 µs of
CPU per access-log line (docs/performance.md, "Per-call cost"); batched, a line costs ~15 µs.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import Any, TextIO

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            data.setdefault(key, value)
        if record.exc_info or record.exc_text:
            data["exc"] = record.exc_text or self.formatException(record.exc_info)  # type: ignore[arg-type]
        return json.dumps(data, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extras = " ".join(f"{key}={_text_value(value)}" for key, value in fields_of(record).items() if value != "")
        if extras:
            line += " " + extras
        if record.exc_info or record.exc_text:
            line += "\n" + (record.exc_text or self.formatException(record.exc_info))  # type: ignore[arg-type]
        return line


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if not text or any(c in text for c in ' "=\n') else text


def resolve_format(log_format: str, stream: TextIO) -> str:
    """``auto`` is text on a terminal and JSON anywhere else (a container, systemd's journal, a file)."""
    if log_format != "auto":
        return log_format
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


QUEUE_SIZE = 10_000
_dropped = 0
_dropped_lock = threading.Lock()


def dropped() -> int:
    """Records dropped so far because the log sink did not keep up."""
    return _dropped


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # The message is made here (its arguments may change later); the format is the writer's job.
        record = copy.copy(record)
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        global _dropped
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with _dropped_lock:
                _dropped += 1


WRITE_PAUSE_S = 0.05  # how long a log line may wait to be written: at most 20 writer wake-ups a second
_MAX_BATCH = 1_000


class _UnflushedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that leaves flushing to the writer, once per batch instead of once per record."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
        except Exception:
            self.handleError(record)


class _Writer(threading.Thread):
    def __init__(self, records: queue.Queue[logging.LogRecord | None], handler: logging.Handler) -> None:
        super().__init__(name="log writer", daemon=True)
        self._records = records
        self._handler = handler

    def run(self) -> None:
        while True:
            batch = [self._records.get()]
            while len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._records.get_nowait())
                except queue.Empty:
                    break
            for record in batch:
                if record is None:
                    self._handler.flush()
                    return
                self._handler.handle(record)
            self._handler.flush()
            time.sleep(WRITE_PAUSE_S)  # records that arrive meanwhile queue up without waking this thread

    def stop(self, timeout: float = 2.0) -> None:
        """Writes out what is queued, within ``timeout`` (a sink that stays blocked is given up on)."""
        try:
            self._records.put(None, timeout=timeout)
        except queue.Full:
            return
        self.join(timeout)


_writer: _Writer | None = None


def setup(level: str = "info", log_format: str = "auto", stream: TextIO | None = None) -> str:
    """Sends every log record to ``stream`` (stderr) in the format asked for; returns the format used."""
    global _writer
    # Neither format prints the caller's file and line, thread or process: logging's documented switches
    # ("Optimization" in its HOWTO) skip collecting them for every record, a stack walk among them.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    stream = stream or sys.stderr
    chosen = resolve_format(log_format, stream)
    handler = _UnflushedStreamHandler(stream)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    shutdown()
    records: queue.Queue[logging.LogRecord | None] = queue.Queue(QUEUE_SIZE)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(_DroppingQueueHandler(records))
    root.setLevel(_LEVELS[level])
    _writer = _Writer(records, handler)
    _writer.start()
    return chosen


@atexit.register
def shutdown() -> None:
    """Writes out what is queued and stops the writer thread (at exit, or before a new set-up)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None
