"""What people read about reply storms, without a coordinator: inboxctl's lines for automated mail and for a
conversation agents stopped on (the contract's words), and the providers' verdict on a message's headers."""

from __future__ import annotations

from datetime import UTC, datetime

from inbox_claims.cli import status_lines
from inbox_claims.providers._seam import Automated
from inbox_claims.types import RefusalKind, SendRefusal, Subject, SubjectState, SubjectStatus

NOW = datetime(2026, 12, 2, 14, 3, tzinfo=UTC)
STOPPED = "agents stopped: 3 agent replies to this conversation in the last hour — a person should look"


def test_inboxctl_says_agents_leave_automated_mail_and_that_a_person_should_look() -> None:
    automated = SubjectStatus(Subject.message("grant-1", "m-1"), SubjectState.FREE, automated="List-Id")
    stopped = SubjectStatus(
        Subject.message("grant-1", "m-2"),
        SubjectState.CLAIMED,
        holder="agent-a",
        agents_stopped=SendRefusal(RefusalKind.REPLY_BUDGET_SPENT, STOPPED, scope="thread", limit=3, counted=3),
    )
    assert "  automated automated message (List-Id): agents leave it; you can still answer it" in status_lines(
        automated, NOW
    )
    assert f"  stopped   {STOPPED}" in status_lines(stopped, NOW)
    plain = status_lines(SubjectStatus(Subject.message("grant-1", "m-3"), SubjectState.FREE), NOW)
    assert not any("automated" in line or "stopped" in line for line in plain)


def test_a_providers_verdict_reads_the_first_header_of_each_name_without_case() -> None:
    assert Automated.of([("auto-submitted", "no"), ("Auto-Submitted", "auto-replied")], "bea@example.org") == (
        Automated(False, "")
    )
    assert Automated.of([("PRECEDENCE", "Bulk"), (None, "x"), ("X", None)], None) == Automated(True, "Precedence: bulk")
    assert Automated.of([], "MAILER-DAEMON@mx.example") == Automated(True, "delivery status notification")
