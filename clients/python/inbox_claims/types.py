"""The client's value types: what every call answers (results, statuses, watch items) and its enums.

A guarded agent needs only the few at the top level (``Subject``, ``SubjectState``, ``SubjectStatus``,
``RetryPolicy``); tools that make the calls themselves (``coord.claim``, ``coord.watch``...) find the rest here.
"""

from ._options import DEFAULT_TARGET
from ._types import *  # noqa: F403  (every value type; _types.__all__ lists them)
from ._types import __all__ as _value_types

__all__ = ["DEFAULT_TARGET", *_value_types]
