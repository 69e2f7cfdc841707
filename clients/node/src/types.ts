// Subjects, statuses and results as plain TypeScript values, and their conversions from the wire messages.
import { createHash } from "node:crypto";
import { create } from "@bufbuild/protobuf";
import { timestampDate, timestampFromDate, type Timestamp } from "@bufbuild/protobuf/wkt";
import * as pb from "./gen/inbox/coordinator/v1/coordinator_pb.js";
import { canonicalMessageId } from "./messageIds.js";

export type SubjectKind = "message" | "thread";
export type HolderKind = "agent" | "human";
export type SubjectState = "FREE" | "CLAIMED" | "SENDING" | "REPLIED" | "IN_DOUBT";
export type ClaimOutcome = "GRANTED" | "HELD" | "ALREADY_REPLIED" | "DUPLICATE_DELIVERY";
export type LossReason = "taken_over" | "expired" | "stale_token" | "renewal_failed" | "answered_outside";

/** What is claimed: a message or a thread inside one mailbox (a Nylas grant id, or the mailbox address). */
export interface Subject {
  readonly mailbox: string;
  readonly kind: SubjectKind;
  readonly id: string;
}

/** A message's subject, its id written the one way every client does (canonicalMessageId: " <m1@x> " is "m1@x"). */
export function messageSubject(mailbox: string, messageId: string): Subject {
  return { mailbox, kind: "message", id: canonicalMessageId(messageId) };
}

export function threadSubject(mailbox: string, threadId: string): Subject {
  return { mailbox, kind: "thread", id: threadId };
}

export const IDEMPOTENCY_KEY_PREFIX = "ic1-";

/**
 * The deterministic send idempotency key of one subject: "ic1-" and 64 hex digits, derived only from
 * (mailbox, kind, id), byte for byte what the Python client computes: SHA-256 of the UTF-8 of
 * `json.dumps([mailbox, kind, id], ensure_ascii=False, separators=(",", ":"))`. Pass it as the mail API's
 * `Idempotency-Key`: every agent, in either language, computes the same key for the same subject.
 */
export function idempotencyKey(subject: Subject): string {
  const canonical = `[${pythonJsonString(subject.mailbox)},${pythonJsonString(subject.kind)},${pythonJsonString(subject.id)}]`;
  return IDEMPOTENCY_KEY_PREFIX + createHash("sha256").update(pythonUtf8(canonical)).digest("hex");
}

// Python's json.dumps(ensure_ascii=False) escapes only '"', '\\' and the C0 controls (with the short forms
// \b \f \n \r \t, else \u00xx in lower case); JSON.stringify differs on lone surrogates, so write it out.
const SHORT_ESCAPES: Record<string, string> = { '"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t" };

function pythonJsonString(text: string): string {
  let out = '"';
  for (const ch of text) {
    const code = ch.charCodeAt(0);
    const short = SHORT_ESCAPES[ch];
    if (short !== undefined) out += short;
    else if (code < 0x20) out += "\\u" + code.toString(16).padStart(4, "0");
    else out += ch;
  }
  return out + '"';
}

// Python encodes with "surrogatepass": a lone surrogate becomes its 3-byte form, where Buffer.from would
// substitute U+FFFD. Valid text (all a coordinator accepts) encodes the same either way.
function pythonUtf8(text: string): Buffer {
  const bytes: number[] = [];
  for (const ch of text) {
    const cp = ch.codePointAt(0)!;
    if (cp < 0x80) bytes.push(cp);
    else if (cp < 0x800) bytes.push(0xc0 | (cp >> 6), 0x80 | (cp & 0x3f));
    else if (cp < 0x10000) bytes.push(0xe0 | (cp >> 12), 0x80 | ((cp >> 6) & 0x3f), 0x80 | (cp & 0x3f));
    else bytes.push(0xf0 | (cp >> 18), 0x80 | ((cp >> 12) & 0x3f), 0x80 | ((cp >> 6) & 0x3f), 0x80 | (cp & 0x3f));
  }
  return Buffer.from(bytes);
}

/**
 * Which email a claim is about, shown to the people watching the mailbox (inboxctl, the claims board). Personal
 * data: the coordinator keeps it with the claim and its reply record only, and not at all when its
 * store_summaries setting is off. replyTo fills it from the notification's message.
 */
export interface MessageSummary {
  readonly subjectLine?: string;
  /** As people read it: "Bea Costa <bea@example.org>". */
  readonly sender?: string;
  readonly receivedAt?: Date;
}

/** Everything recorded about one subject. Times are Dates, undefined when unset. */
export interface SubjectStatus {
  readonly subject: Subject;
  readonly state: SubjectState;
  readonly holder: string;
  readonly holderKind: HolderKind | undefined;
  readonly fencingToken: bigint;
  readonly acquiredAt: Date | undefined;
  readonly expiresAt: Date | undefined;
  readonly note: string;
  readonly sendStartedAt: Date | undefined;
  readonly sendDeadline: Date | undefined;
  readonly sentAt: Date | undefined;
  readonly sentMessageId: string;
  readonly revision: bigint;
  readonly ttlSeconds: number;
  /** Which email it is, when the claim carried a summary (and the coordinator stores them). */
  readonly summary: MessageSummary | undefined;
  /** REPLIED by markReplied (a person answered outside the coordinator), not through send. */
  readonly repliedByHand: boolean;
  /**
   * REPLIED because someone answered in its thread outside the coordinator (`outsideReply` says who): `holder`
   * is then that sender.
   */
  readonly repliedOutside: boolean;
  /**
   * A reply written outside in its thread: with repliedOutside, the one that answered it; on a SENDING,
   * IN_DOUBT or REPLIED subject that sent its own, both replies went out.
   */
  readonly outsideReply: OutsideReply | undefined;
  /** REPLIED by ResolveInDoubt (sent): the person who settled it; `holder` is whose send it was. */
  readonly settledBy: string;
  /**
   * Automated mail agents leave (recorded by RecordIncoming): why, for people ("Auto-Submitted: auto-replied");
   * empty otherwise. A person can still claim and answer it.
   */
  readonly automated: string;
  /** While agents are stopped on this subject's conversation (its reply budget spent): the refusal they were given. */
  readonly agentsStopped: SendRefusal | undefined;
}

/**
 * Why BeginSend refused an agent's send (docs/design.md#reply-storms): the reply budget of the thread or of the
 * correspondent is spent, or the customer wrote again after the claim's message.
 */
export interface SendRefusal {
  readonly kind: "REPLY_BUDGET_SPENT" | "CONVERSATION_MOVED_ON";
  /** For a person: "agents stopped: 3 agent replies to this conversation in the last hour — a person should look". */
  readonly reason: string;
  /** REPLY_BUDGET_SPENT: "thread" or "correspondent", its limit, window, the replies counted, when the oldest leaves it. */
  readonly scope: string;
  readonly limit: number;
  readonly windowSeconds: number;
  readonly counted: number;
  readonly freesAt: Date | undefined;
  /** CONVERSATION_MOVED_ON: the newer message and when it was received. */
  readonly newerMessageId: string;
  readonly newerReceivedAt: Date | undefined;
}

/** A reply written outside the coordinator in a subject's thread (a person in Gmail, Outlook, a helpdesk). */
export interface OutsideReply {
  /** Who sent it, as the message's `from` says: "Ana Lima <ana@shop.example>". */
  readonly sender: string;
  /** The message's date, as the provider gives it. */
  readonly sentAt: Date | undefined;
  readonly messageId: string;
  /** The principal whose client reported it. */
  readonly recordedBy: string;
  /** The principal whose claim it ended; empty when none was held. */
  readonly stoppedHolder: string;
}

/** The answer to recordOutgoing: what the coordinator took the message for, and the subjects it concerns. */
export interface OutgoingResult {
  readonly outcome: "OWN_REPLY" | "ANSWERED_OUTSIDE" | "DUPLICATE_DELIVERY";
  /** OWN_REPLY: the subject whose reply it is; ANSWERED_OUTSIDE: the subjects it answered, as they are now. */
  readonly subjects: readonly SubjectStatus[];
  /** DUPLICATE_DELIVERY: the notification's first sighting. */
  readonly delivery: DeliveryRecord | undefined;
}

export interface DeliveryRecord {
  readonly mailbox: string;
  readonly notificationId: string;
  readonly recordedBy: string;
  readonly recordedAt: Date | undefined;
  readonly subject: Subject | undefined;
}

export interface ClaimResult {
  readonly outcome: ClaimOutcome;
  /** Undefined for DUPLICATE_DELIVERY. */
  readonly status: SubjectStatus | undefined;
  readonly delivery: DeliveryRecord | undefined;
}

export interface FenceResult {
  /** False: the fencing token is stale (the claim is gone), or (BeginSend) the send is refused; never send. */
  readonly ok: boolean;
  readonly status: SubjectStatus;
  /** BeginSend REFUSED: why (the claim is still held: release it). Undefined otherwise. */
  readonly refusal?: SendRefusal;
}

/** The answer to recordIncoming: RECORDED (also to a retry) or DUPLICATE_DELIVERY, and the message's subject now. */
export interface IncomingResult {
  readonly outcome: "RECORDED" | "DUPLICATE_DELIVERY";
  readonly status: SubjectStatus | undefined;
  readonly delivery: DeliveryRecord | undefined;
}

export interface DeliveryResult {
  readonly isNew: boolean;
  readonly first: DeliveryRecord | undefined;
}

export interface TakeoverResult {
  readonly outcome: "TAKEN_OVER" | "GRANTED" | "HELD" | "ALREADY_REPLIED";
  readonly status: SubjectStatus;
  readonly previousHolder: string;
  readonly previousToken: bigint;
}

export type EventType =
  | "CLAIMED"
  | "RENEWED"
  | "RELEASED"
  | "EXPIRED"
  | "SENDING"
  | "REPLIED"
  | "ABORTED"
  | "TAKEN_OVER"
  | "IN_DOUBT"
  | "RESOLVED_NOT_SENT"
  | "RETENTION_ENDED"
  | "MARKED_REPLIED"
  | "ANSWERED_OUTSIDE";

/** What Watch sends: first a snapshot of the mailbox, then an event for every transition. */
export type WatchItem =
  | { readonly kind: "snapshot"; readonly subjects: readonly SubjectStatus[]; readonly revision: bigint }
  | {
      readonly kind: "event";
      readonly type: EventType;
      readonly status: SubjectStatus;
      readonly previousHolder: string;
      readonly previousToken: bigint;
      readonly revision: bigint;
      readonly reason: string;
    };

export function watchItemFromPb(response: pb.WatchResponse): WatchItem {
  if (response.kind.case === "snapshot") {
    return { kind: "snapshot", subjects: response.kind.value.subjects.map(statusFromPb), revision: response.kind.value.revision };
  }
  if (response.kind.case === "event") {
    const event = response.kind.value;
    return {
      kind: "event",
      type: enumName(pb.EventType, event.type, "", "EventType") as EventType,
      status: statusFromPb(event.status),
      previousHolder: event.previousHolder,
      previousToken: event.previousToken,
      revision: event.revision,
      reason: event.reason,
    };
  }
  throw new Error("the coordinator sent a WatchResponse with neither a snapshot nor an event");
}

/** Who the coordinator takes the caller to be (`caller()`): what to offer a person. */
export interface CallerIdentity {
  readonly principal: string;
  readonly kind: HolderKind;
  /** Sorted: "admin", "report", "resolve", "takeover" (admin implies the others, which are listed too). */
  readonly roles: readonly string[];
  /** The granted mailboxes: exact names or globs; ["*"] for every mailbox. */
  readonly mailboxes: readonly string[];
  /** The coordinator has no token file: anyone may name themselves, with every right. */
  readonly developmentMode: boolean;
}

export interface ClaimsPage {
  readonly subjects: readonly SubjectStatus[];
  readonly nextPageToken: string;
  readonly revision: bigint;
}

// ------------------------------------------------------------------------------------------- conversions

function enumName<E extends Record<number, string>>(values: E, value: number, prefix: string, what: string): string {
  const name = values[value];
  if (name === undefined || name.endsWith("UNSPECIFIED")) {
    throw new Error(`the coordinator sent ${what} ${value}, unknown to this client`);
  }
  return name.startsWith(prefix) ? name.slice(prefix.length) : name;
}

const date = (stamp: Timestamp | undefined): Date | undefined => (stamp === undefined ? undefined : timestampDate(stamp));

export function subjectToPb(subject: Subject): pb.Subject {
  if (subject.kind !== "message" && subject.kind !== "thread") {
    throw new TypeError(`subject.kind must be "message" or "thread", not ${JSON.stringify(subject.kind)}`);
  }
  const kind = subject.kind === "thread" ? pb.SubjectKind.THREAD : pb.SubjectKind.MESSAGE;
  return create(pb.SubjectSchema, { mailbox: subject.mailbox, kind, id: subject.id });
}

export function subjectFromPb(message: pb.Subject | undefined): Subject {
  return {
    mailbox: message?.mailbox ?? "",
    kind: message?.kind === pb.SubjectKind.THREAD ? "thread" : "message",
    id: message?.id ?? "",
  };
}

const HOLDER_KINDS = { [pb.HolderKind.AGENT]: "agent", [pb.HolderKind.HUMAN]: "human" } as Record<number, HolderKind>;

export function statusFromPb(message: pb.SubjectStatus | undefined): SubjectStatus {
  if (message === undefined) throw new Error("the coordinator answered without a subject status");
  return {
    subject: subjectFromPb(message.subject),
    state: enumName(pb.SubjectState, message.state, "", "SubjectState") as SubjectState,
    holder: message.holder,
    holderKind: HOLDER_KINDS[message.holderKind],
    fencingToken: message.fencingToken,
    acquiredAt: date(message.acquiredAt),
    expiresAt: date(message.expiresAt),
    note: message.note,
    sendStartedAt: date(message.sendStartedAt),
    sendDeadline: date(message.sendDeadline),
    sentAt: date(message.sentAt),
    sentMessageId: message.sentMessageId,
    revision: message.revision,
    ttlSeconds: message.ttlSeconds,
    summary: summaryFromPb(message.summary),
    repliedByHand: message.repliedByHand,
    repliedOutside: message.repliedOutside,
    outsideReply: outsideReplyFromPb(message.outsideReply),
    settledBy: message.settledBy,
    automated: message.automated,
    agentsStopped: refusalFromPb(message.agentsStopped),
  };
}

export function refusalFromPb(message: pb.SendRefusal | undefined): SendRefusal | undefined {
  if (message === undefined || message.kind === pb.SendRefusal_Kind.KIND_UNSPECIFIED) return undefined;
  return {
    kind: enumName(pb.SendRefusal_Kind, message.kind, "", "SendRefusal.Kind") as SendRefusal["kind"],
    reason: message.reason,
    scope: message.scope,
    limit: message.limit,
    windowSeconds: message.windowSeconds,
    counted: message.counted,
    freesAt: date(message.freesAt),
    newerMessageId: message.newerMessageId,
    newerReceivedAt: date(message.newerReceivedAt),
  };
}

export function incomingFromPb(response: pb.RecordIncomingResponse): IncomingResult {
  return {
    outcome: enumName(pb.RecordIncomingResponse_Result, response.result, "", "RecordIncomingResponse.Result") as IncomingResult["outcome"],
    status: response.status === undefined ? undefined : statusFromPb(response.status),
    delivery: deliveryFromPb(response.delivery),
  };
}

function outsideReplyFromPb(message: pb.OutsideReply | undefined): OutsideReply | undefined {
  if (message === undefined) return undefined;
  return {
    sender: message.sender,
    sentAt: date(message.sentAt),
    messageId: message.messageId,
    recordedBy: message.recordedBy,
    stoppedHolder: message.stoppedHolder,
  };
}

export function outgoingFromPb(response: pb.RecordOutgoingResponse): OutgoingResult {
  return {
    outcome: enumName(pb.RecordOutgoingResponse_Result, response.result, "", "RecordOutgoingResponse.Result") as OutgoingResult["outcome"],
    subjects: response.subjects.map(statusFromPb),
    delivery: deliveryFromPb(response.delivery),
  };
}

export function summaryFromPb(message: pb.MessageSummary | undefined): MessageSummary | undefined {
  if (message === undefined) return undefined;
  return { subjectLine: message.subjectLine, sender: message.sender, receivedAt: date(message.receivedAt) };
}

export function summaryToPb(summary: MessageSummary | undefined): pb.MessageSummary | undefined {
  if (summary === undefined) return undefined;
  return create(pb.MessageSummarySchema, {
    subjectLine: summary.subjectLine ?? "",
    sender: summary.sender ?? "",
    receivedAt: summary.receivedAt === undefined ? undefined : timestampFromDate(summary.receivedAt),
  });
}

export function deliveryFromPb(message: pb.DeliveryRecord | undefined): DeliveryRecord | undefined {
  if (message === undefined) return undefined;
  return {
    mailbox: message.mailbox,
    notificationId: message.notificationId,
    recordedBy: message.recordedBy,
    recordedAt: date(message.recordedAt),
    subject: message.subject === undefined ? undefined : subjectFromPb(message.subject),
  };
}

export function claimResultFromPb(response: pb.ClaimReplyResponse): ClaimResult {
  const outcome = enumName(pb.ClaimReplyResponse_Result, response.result, "", "ClaimReplyResponse.Result") as ClaimOutcome;
  return {
    outcome,
    status: outcome === "DUPLICATE_DELIVERY" ? undefined : statusFromPb(response.status),
    delivery: deliveryFromPb(response.delivery),
  };
}

export function fenceFromPb(response: { result: pb.FenceResult; status?: pb.SubjectStatus | undefined; refusal?: pb.SendRefusal | undefined }): FenceResult {
  const refusal = response.result === pb.FenceResult.REFUSED ? refusalFromPb(response.refusal) : undefined;
  return { ok: response.result === pb.FenceResult.OK, status: statusFromPb(response.status), ...(refusal === undefined ? {} : { refusal }) };
}

export function deliveryResultFromPb(response: pb.RecordDeliveryResponse): DeliveryResult {
  return { isNew: response.result === pb.RecordDeliveryResponse_Result.NEW, first: deliveryFromPb(response.first) };
}

export function takeoverFromPb(response: pb.TakeoverResponse): TakeoverResult {
  return {
    outcome: enumName(pb.TakeoverResponse_Result, response.result, "", "TakeoverResponse.Result") as TakeoverResult["outcome"],
    status: statusFromPb(response.status),
    previousHolder: response.previousHolder,
    previousToken: response.previousToken,
  };
}

export function callerFromPb(response: pb.GetCallerResponse): CallerIdentity {
  return {
    principal: response.principal,
    kind: HOLDER_KINDS[response.kind] ?? "agent",
    roles: response.roles,
    mailboxes: response.mailboxes,
    developmentMode: response.developmentMode,
  };
}

export function pageFromPb(response: pb.ListClaimsResponse): ClaimsPage {
  return {
    subjects: response.subjects.map(statusFromPb),
    nextPageToken: response.nextPageToken,
    revision: response.revision,
  };
}

export function stateToPb(state: SubjectState): pb.SubjectState {
  const value = (pb.SubjectState as unknown as Record<string, number>)[state];
  if (value === undefined) throw new TypeError(`unknown subject state ${JSON.stringify(state)}`);
  return value as pb.SubjectState;
}

export function describe(subject: Subject): string {
  return `${subject.kind} ${JSON.stringify(subject.id)} of mailbox ${JSON.stringify(subject.mailbox)}`;
}
