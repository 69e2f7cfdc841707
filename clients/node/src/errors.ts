// The client's errors, the same tree as the Python client's (inbox_claims._errors):
//
//   InboxClaimsError
//   ├── ClaimNotGranted            the claim was refused: do not reply (answer the webhook 200 and move on)
//   │   ├── DuplicateDelivery      this notification id was seen before
//   │   ├── ReplyHeld              someone else holds the subject now
//   │   ├── AlreadyReplied         a reply was sent, is being sent, or is in doubt
//   │   ├── OutgoingMessage        the message is one the mailbox sent: never answered (recorded instead)
//   │   └── AutomatedMessage       automated mail (an auto-reply, a list, a bounce): agents leave it (recorded for people)
//   ├── ClaimLost                  you held the claim and no longer do (fenced): never send
//   ├── ReplyRefused               BeginSend REFUSED: the mailbox's reply rules stop this send (the claim was released)
//   │   ├── ReplyBudgetSpent       the agents' reply budget of the thread or correspondent is spent: a person should look
//   │   └── ConversationMovedOn    the customer wrote again: draft again with the newest message
//   ├── SendRejected               thrown BY YOU from a send function: "the mail API refused, nothing went out"
//   ├── SendOutcomeUnknown         the send function threw something else: it may have gone out (IN_DOUBT)
//   ├── SentButUnconfirmed         the reply went out but the coordinator could not record it
//   └── CoordinatorError           a gRPC status from the coordinator (.code, .details)
//       ├── InvalidRequest, FailedPrecondition, PermissionDenied, Unauthenticated, QuotaExceeded
//       └── CoordinatorUnavailable UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED after every retry
import { describeMatch, type OutgoingMatch } from "./outgoing.js";
import {
  describe,
  type DeliveryRecord,
  type HolderKind,
  type IncomingResult,
  type LossReason,
  type OutgoingResult,
  type SendRefusal,
  type Subject,
  type SubjectState,
  type SubjectStatus,
} from "./types.js";

export class InboxClaimsError extends Error {
  override name = "InboxClaimsError";
}

/** The claim was refused: this agent must not reply. Nothing is held, nothing needs cleaning up. */
export class ClaimNotGranted extends InboxClaimsError {
  override name = "ClaimNotGranted";
  constructor(
    message: string,
    readonly subject: Subject,
  ) {
    super(message);
  }
}

/** The notification id was seen before (a webhook redelivery): drop it. `first` is its first sighting. */
export class DuplicateDelivery extends ClaimNotGranted {
  override name = "DuplicateDelivery";
  constructor(
    subject: Subject,
    readonly notificationId: string,
    readonly first: DeliveryRecord | undefined,
  ) {
    const by = first?.recordedAt ? ` by ${JSON.stringify(first.recordedBy)} at ${first.recordedAt.toISOString()}` : "";
    super(`notification ${JSON.stringify(notificationId)} was already delivered${by}; nothing was claimed`, subject);
  }
  get recordedBy(): string {
    return this.first?.recordedBy ?? "";
  }
}

/** Someone else holds the subject (`holder`, of `holderKind`, until `expiresAt`): do not reply. */
export class ReplyHeld extends ClaimNotGranted {
  override name = "ReplyHeld";
  constructor(readonly status: SubjectStatus) {
    const until = status.expiresAt ? ` until ${status.expiresAt.toISOString()}` : "";
    super(`${describe(status.subject)} is held by ${JSON.stringify(status.holder)} (${status.holderKind ?? "unknown"})${until}`, status.subject);
  }
  get holder(): string {
    return this.status.holder;
  }
  get holderKind(): HolderKind | undefined {
    return this.status.holderKind;
  }
  get expiresAt(): Date | undefined {
    return this.status.expiresAt;
  }
}

/** A reply was sent (REPLIED), is being sent (SENDING) or may have been sent (IN_DOUBT): do not reply. */
export class AlreadyReplied extends ClaimNotGranted {
  override name = "AlreadyReplied";
  constructor(readonly status: SubjectStatus) {
    const sent = status.sentMessageId ? ` (sent message ${JSON.stringify(status.sentMessageId)})` : "";
    super(`${describe(status.subject)} is ${status.state}: replied by ${JSON.stringify(status.holder)}${sent}`, status.subject);
  }
  get state(): SubjectState {
    return this.status.state;
  }
  get holder(): string {
    return this.status.holder;
  }
}

/**
 * The notification is about a message the mailbox sent (`why`: in a sent folder, or from one of its own
 * addresses): an agent never answers it. replyTo reported it to the coordinator (`result`: the mailbox's own
 * reply, or one written outside that ended the claims on what it answered; undefined when it could not be
 * reported, e.g. the notification carried no thread id or date).
 */
export class OutgoingMessage extends ClaimNotGranted {
  override name = "OutgoingMessage";
  constructor(
    subject: Subject,
    readonly notificationId: string,
    readonly why: OutgoingMatch,
    readonly result: OutgoingResult | undefined,
  ) {
    let recorded: string;
    if (result === undefined) recorded = "it was not recorded (the notification has no thread id or date)";
    else if (result.outcome === "OWN_REPLY") recorded = "the coordinator knows it as the mailbox's own reply";
    else if (result.outcome === "ANSWERED_OUTSIDE") {
      const ended = result.subjects.map((status) => `${status.subject.kind} ${JSON.stringify(status.subject.id)}`).join(", ");
      recorded = "recorded as a reply written outside the coordinator" + (ended ? `; it answered ${ended}` : "");
    } else recorded = "its notification was delivered before";
    super(`not answering ${describe(subject)} (notification ${JSON.stringify(notificationId)}): it is outgoing, ${describeMatch(why)}; ${recorded}`, subject);
  }
}

/**
 * The message is automated mail (`why`: the rule and value, "Auto-Submitted: auto-replied", "List-Id", "no-reply
 * sender noreply@shop.example"): agents never answer it (docs/design.md#reply-storms). replyTo recorded it for the
 * people watching the mailbox with RecordIncoming (`result`; undefined when it could not be recorded: no thread id
 * or date); a person can still claim and answer it.
 */
export class AutomatedMessage extends ClaimNotGranted {
  override name = "AutomatedMessage";
  constructor(
    subject: Subject,
    readonly notificationId: string,
    readonly why: string,
    readonly result: IncomingResult | undefined,
  ) {
    const recorded =
      result === undefined
        ? "it was not recorded (the notification has no thread id or date)"
        : result.outcome === "DUPLICATE_DELIVERY"
          ? "its notification was delivered before"
          : "recorded for the people watching the mailbox";
    super(`not answering ${describe(subject)} (notification ${JSON.stringify(notificationId)}): automated message (${why}): agents leave it; ${recorded}`, subject);
  }
}

const LOSS_DETAIL: Record<Exclude<LossReason, "answered_outside">, string> = {
  taken_over: "taken over",
  expired: "its TTL ran out before it was renewed",
  stale_token: "the coordinator refused its fencing token",
  renewal_failed: "the coordinator could not be reached to renew it before its TTL ran out",
};

function answeredOutside(status: SubjectStatus | undefined): string {
  const reply = status?.outsideReply;
  if (reply === undefined) return "someone answered it from the mailbox";
  const when = reply.sentAt ? ` at ${reply.sentAt.toISOString().slice(0, 16).replace("T", " ")}Z` : "";
  return `someone answered it from the mailbox: ${reply.sender || "the mailbox"}${when}`;
}

/**
 * You held the claim and no longer do: stop drafting and never send. `reason` says why; `status` is the
 * subject's state as last seen (undefined when the coordinator could not be reached).
 */
export class ClaimLost extends InboxClaimsError {
  override name = "ClaimLost";
  constructor(
    readonly subject: Subject,
    readonly token: bigint,
    readonly reason: LossReason,
    readonly status: SubjectStatus | undefined,
  ) {
    const detail =
      reason === "answered_outside"
        ? answeredOutside(status)
        : reason === "taken_over" && status
          ? `taken over by ${JSON.stringify(status.holder)}`
          : LOSS_DETAIL[reason];
    super(`claim ${token} on ${describe(subject)} was lost: ${detail}`);
  }
}

/**
 * BeginSend refused this agent's send (docs/design.md#reply-storms): nothing was sent or counted, the send function
 * was never called, and the claim was released (not redeliverable: a redelivery would be refused the same way).
 * `reason` is for a person, as the coordinator wrote it; the other fields are the SendRefusal's. Catch the base
 * class to handle both kinds alike.
 */
// The SendRefusal's fields (kind, reason, scope, limit, windowSeconds, counted, freesAt, newerMessageId,
// newerReceivedAt) are the error's own, copied in by the constructor: one list of them, types.ts's.
// eslint-disable-next-line @typescript-eslint/no-unsafe-declaration-merging, @typescript-eslint/no-empty-object-type
export interface ReplyRefused extends SendRefusal {}
// eslint-disable-next-line @typescript-eslint/no-unsafe-declaration-merging
export class ReplyRefused extends InboxClaimsError {
  override name = "ReplyRefused";
  constructor(
    readonly subject: Subject,
    readonly refusal: SendRefusal,
    readonly status: SubjectStatus | undefined,
  ) {
    super(`not sending the reply to ${describe(subject)}: ${refusal.reason || refusal.kind}`);
    Object.assign(this, refusal);
  }

  /** The error for a refusal of this kind. */
  static of(subject: Subject, refusal: SendRefusal, status: SubjectStatus | undefined): ReplyRefused {
    if (refusal.kind === "REPLY_BUDGET_SPENT") return new ReplyBudgetSpent(subject, refusal, status);
    if (refusal.kind === "CONVERSATION_MOVED_ON") return new ConversationMovedOn(subject, refusal, status);
    return new ReplyRefused(subject, refusal, status);
  }
}

/**
 * The agents' reply budget is spent: `scope` "thread" (this conversation) or "correspondent" (this sender), `limit`
 * replies in `windowSeconds`, `counted` so far; `freesAt` when the oldest leaves the window. Agents stop; a person
 * should look (the board lists the conversation).
 */
export class ReplyBudgetSpent extends ReplyRefused {
  override name = "ReplyBudgetSpent";
}

/**
 * The customer wrote again in the thread after the claim's message (`newerMessageId`, received `newerReceivedAt`):
 * this draft answers a conversation that moved on. The newer message has (or gets) its own notification and claim,
 * which drafts with the whole conversation: drop this draft (docs/node.md, "Reply storms").
 */
export class ConversationMovedOn extends ReplyRefused {
  override name = "ConversationMovedOn";
}

/**
 * Throw this (or a subclass) from your send function when the mail API certainly did NOT send (it refused
 * the request, a 4xx). `claim.send` then calls AbortSend (the subject is FREE again) and rethrows it. A
 * timeout or a dropped connection proves nothing: let those propagate (they become SendOutcomeUnknown).
 */
export class SendRejected extends InboxClaimsError {
  override name = "SendRejected";
  constructor(readonly reason: string = "the mail API refused the send") {
    super(reason);
  }
}

/**
 * The send function threw something other than SendRejected: the reply may have gone out. The subject
 * stays SENDING and is reported IN_DOUBT after the send timeout; do not retry the send. `cause` is the error.
 */
export class SendOutcomeUnknown extends InboxClaimsError {
  override name = "SendOutcomeUnknown";
  constructor(
    readonly subject: Subject,
    readonly token: bigint,
    cause: unknown,
  ) {
    super(
      `the send for ${describe(subject)} threw an error that does not prove it failed; the subject stays SENDING and will be reported IN_DOUBT`,
      { cause },
    );
  }
}

/** The send function returned (the reply went out) but ConfirmSent could not be recorded. Never send again. */
export class SentButUnconfirmed extends InboxClaimsError {
  override name = "SentButUnconfirmed";
  constructor(
    readonly subject: Subject,
    readonly token: bigint,
    readonly sentMessageId: string | undefined,
    detail: string,
    cause?: unknown,
  ) {
    super(`the reply for ${describe(subject)} was sent but not recorded: ${detail}`, { cause });
  }
}

/** gRPC status codes by number (the same numbers in every gRPC implementation). */
export const StatusCode = {
  OK: 0,
  CANCELLED: 1,
  UNKNOWN: 2,
  INVALID_ARGUMENT: 3,
  DEADLINE_EXCEEDED: 4,
  NOT_FOUND: 5,
  ALREADY_EXISTS: 6,
  PERMISSION_DENIED: 7,
  RESOURCE_EXHAUSTED: 8,
  FAILED_PRECONDITION: 9,
  ABORTED: 10,
  OUT_OF_RANGE: 11,
  UNIMPLEMENTED: 12,
  INTERNAL: 13,
  UNAVAILABLE: 14,
  DATA_LOSS: 15,
  UNAUTHENTICATED: 16,
} as const;
export type StatusCodeName = keyof typeof StatusCode;

export function codeName(code: number): StatusCodeName {
  const entry = Object.entries(StatusCode).find(([, value]) => value === code);
  return (entry?.[0] ?? "UNKNOWN") as StatusCodeName;
}

/** The coordinator answered with an error status: `code` (a gRPC status name) and `details`. */
export class CoordinatorError extends InboxClaimsError {
  override name = "CoordinatorError";
  constructor(
    readonly code: StatusCodeName,
    readonly details: string,
    readonly method: string = "",
    readonly attempts: number = 1,
    /** Milliseconds the coordinator asked to wait before trying again (its `retry-after-ms` hint), if any. */
    readonly retryAfterMs: number | undefined = undefined,
  ) {
    super(`${method ? method + ": " : ""}${code}: ${details}${attempts > 1 ? ` (after ${attempts} attempts)` : ""}`);
  }
}

export class InvalidRequest extends CoordinatorError {
  override name = "InvalidRequest";
}
export class FailedPrecondition extends CoordinatorError {
  override name = "FailedPrecondition";
}
export class PermissionDenied extends CoordinatorError {
  override name = "PermissionDenied";
}
export class Unauthenticated extends CoordinatorError {
  override name = "Unauthenticated";
}
export class CoordinatorUnavailable extends CoordinatorError {
  override name = "CoordinatorUnavailable";
}
export class QuotaExceeded extends CoordinatorError {
  override name = "QuotaExceeded";
}

const BY_CODE: Partial<Record<StatusCodeName, typeof CoordinatorError>> = {
  INVALID_ARGUMENT: InvalidRequest,
  OUT_OF_RANGE: InvalidRequest,
  FAILED_PRECONDITION: FailedPrecondition,
  PERMISSION_DENIED: PermissionDenied,
  UNAUTHENTICATED: Unauthenticated,
  UNAVAILABLE: CoordinatorUnavailable,
  DEADLINE_EXCEEDED: CoordinatorUnavailable,
  ABORTED: CoordinatorUnavailable,
  RESOURCE_EXHAUSTED: QuotaExceeded,
};

/** The error for a gRPC status; codes without a class of their own give CoordinatorError. */
export function errorFor(code: StatusCodeName, details: string, method = "", attempts = 1, retryAfterMs?: number): CoordinatorError {
  const cls = BY_CODE[code] ?? CoordinatorError;
  return new cls(code, details, method, attempts, retryAfterMs);
}
