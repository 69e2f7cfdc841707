// The send-path guard, the phases of the Python client's inbox_claims._guard:
//
//   CLAIMING --the message is outgoing, RecordOutgoing--> OUTGOING (refused: the work never runs)
//   CLAIMING --the message is automated mail, RecordIncoming--> AUTOMATED (refused: the work never runs)
//   CLAIMING --ClaimReply GRANTED--> CLAIMED --renewal finds it gone--> LOST
//   CLAIMED --send()--> BEGINNING --BeginSend OK--> SENDING --fn returned, ConfirmSent--> REPLIED
//                                 --BeginSend STALE--> LOST        --fn threw SendRejected, AbortSend--> ABORTED
//                                 --BeginSend REFUSED, released--> RELEASED (ReplyRefused thrown)
//                                                                  --fn threw anything else--> UNKNOWN (left SENDING)
//   CLAIMED (or LOST after failed renewals, or BEGINNING with an unknown answer) --work ends--> RELEASED
//
// Renewal only ever acts in CLAIMED: a renewal answer that arrives after send() started is ignored, so the
// renewal can never declare a loss the commit point has already settled.
import type { Coordinator, Op } from "./client.js";
import { sendingAs } from "./current.js";
import type { Notification } from "./envelope.js";
import { factsOf } from "./providers/nylas.js";
import { isMessageFacts, ProviderError, type ClaimStamp, type MessageFacts, type Provider } from "./providers/seam.js";
import {
  AlreadyReplied,
  AutomatedMessage,
  ClaimLost,
  ClaimNotGranted,
  DuplicateDelivery,
  FailedPrecondition,
  InboxClaimsError,
  OutgoingMessage,
  ReplyHeld,
  ReplyRefused,
  SendOutcomeUnknown,
  SendRejected,
  SentButUnconfirmed,
} from "./errors.js";
import type { OutgoingMatch } from "./outgoing.js";
import { inChild, replyStarted, type GuardSpan } from "./tracing.js";
import { inScope, sdkError, sentIdOf } from "./sdks.js";
import {
  idempotencyKey,
  messageSubject,
  type ClaimResult,
  type IncomingResult,
  type LossReason,
  type MessageSummary,
  type OutgoingResult,
  type Subject,
  type SubjectStatus,
} from "./types.js";

export type Scope = "message" | "thread";

/** The code of the process warning a send without the claim's idempotency key gets (see Claim.send). */
export const NO_IDEMPOTENCY_KEY_WARNING = "INBOX_CLAIMS_NO_IDEMPOTENCY_KEY";

function warnNoIdempotencyKey(messageId: string): void {
  process.emitWarning(
    `claim.send() for ${messageId}: the send function took no idempotency key and never read claim.idempotencyKey, so the ` +
      "mail API got no Idempotency-Key. Send it as that header: claim.send((idempotencyKey) => sendReply(..., idempotencyKey)) " +
      "(docs/node.md); without it the provider cannot refuse a second reply that got past everything else.",
    { code: NO_IDEMPOTENCY_KEY_WARNING },
  );
}

/** What to claim when there is no parsed notification (explicit ids win over a notification's). */
export interface ReplyTarget {
  mailbox: string;
  messageId?: string;
  threadId?: string;
  notificationId?: string;
  /**
   * When the message arrived, for a target given without its notification (a notification carries it): with
   * threadId, a reply written from the mailbox in that thread ends the claim, as it does a notification's.
   */
  receivedAt?: Date;
  /** The sender's address, for the agents' reply budget per correspondent (a notification's facts carry it). */
  correspondent?: string;
}

export interface ReplyOptions {
  /** Claim TTL in seconds (default 60); renewed every third of it. */
  ttl?: number;
  /** "message" (default): one reply per message; "thread": one per conversation. */
  scope?: Scope;
  /** Shown to humans watching the mailbox (e.g. "support-agent-1 is drafting"). */
  note?: string;
  /**
   * Coordinate on this mailbox instead of the notification's grant id: several grants that see one inbox
   * (each agent connected with its own grant) then claim the same subject for the same message.
   */
  mailbox?: string;
  /** Which email it is, for the people watching the mailbox; default: taken from the notification (summaryOf). */
  summary?: MessageSummary;
  /**
   * The provider the message came from, to look at its thread right before the send (docs/node.md, "Look before
   * you send"): a person's reply or a customer's newer message found there is recorded as if its notification had
   * arrived, so that BeginSend refuses. The webhook adapters pass theirs; needs MessageFacts as the target.
   */
  provider?: Provider;
}

type Phase = "claiming" | "outgoing" | "automated" | "claimed" | "lost" | "beginning" | "sending" | "replied" | "aborted" | "unknown" | "released";

export const REASON_MAX_BYTES = 1024;
/** The coordinator's limit on RecordIncoming's `automated` (AUTOMATED_REASON_MAX_BYTES). */
export const AUTOMATED_REASON_MAX_BYTES = 256;
// After a failed renewal, try again after a third of the time left, but not more often than this.
const RENEWAL_RETRY_FLOOR_MS = 200;

/** The subject to claim and the dedup key, from a message's facts or an explicit target (explicit mailbox wins). */
export function resolveSubject(target: MessageFacts | ReplyTarget, scope: Scope, mailboxOverride?: string): { subject: Subject; notificationId: string } {
  let mailbox: string | undefined;
  let messageId: string | undefined;
  let threadId: string | undefined;
  let notificationId: string | undefined;
  if (isMessageFacts(target)) ({ mailbox, messageId, threadId, dedupKey: notificationId } = target);
  else ({ mailbox, messageId, threadId, notificationId } = target);
  mailbox = mailboxOverride || mailbox;
  if (!mailbox) throw new TypeError("replyTo needs a mailbox (the notification carries no grant_id): pass { mailbox }");
  if (scope === "message") {
    if (!messageId) throw new TypeError("replyTo with scope 'message' needs a message id");
    return { subject: messageSubject(mailbox, messageId), notificationId: notificationId ?? "" };
  }
  if (scope === "thread") {
    if (!threadId) throw new TypeError("replyTo with scope 'thread' needs a thread id (none in the notification)");
    return { subject: { mailbox, kind: "thread", id: threadId }, notificationId: notificationId ?? "" };
  }
  throw new TypeError(`scope must be "message" or "thread", not ${JSON.stringify(scope)}`);
}

function grantedStatus(result: ClaimResult, subject: Subject, notificationId: string): SubjectStatus {
  if (result.outcome === "DUPLICATE_DELIVERY") throw new DuplicateDelivery(subject, notificationId, result.delivery);
  const status = result.status!;
  if (result.outcome === "HELD") throw new ReplyHeld(status);
  if (result.outcome === "ALREADY_REPLIED") throw new AlreadyReplied(status);
  return status;
}

// The coordinator's limits on a summary's texts (SUMMARY_SUBJECT_LINE_MAX_BYTES, SUMMARY_SENDER_MAX_BYTES):
// longer ones are cut, not refused.
export const SUMMARY_TEXT_MAX_BYTES = 512;

/**
 * Which email a message is, from its facts (subject line, sender, received time), as the Python client's
 * summary_of: what is missing is left out, the texts cut to the coordinator's limits; undefined when nothing is
 * there or a notification is not about a message. A Nylas notification is read by the Nylas provider.
 */
export function summaryOf(event: Notification | MessageFacts | undefined): MessageSummary | undefined {
  // A message notification without its message id (which only replyTo needs) still says which email it is.
  const facts = event === undefined || isMessageFacts(event) ? event : event.isMessageEvent ? factsOf({ ...event, messageId: event.messageId ?? "" }) : undefined;
  if (facts === undefined) return undefined;
  const subjectLine = cleanText(facts.subjectLine, SUMMARY_TEXT_MAX_BYTES);
  const sender = cleanText(facts.sender, SUMMARY_TEXT_MAX_BYTES);
  const receivedAt = facts.receivedAt;
  if (!subjectLine && !sender && receivedAt === undefined) return undefined;
  return { subjectLine, sender, ...(receivedAt === undefined ? {} : { receivedAt }) };
}

/** A free-form text the coordinator accepts: control characters become spaces, cut to maxBytes of UTF-8. */
export function cleanText(text: string, maxBytes = REASON_MAX_BYTES): string {
  // eslint-disable-next-line no-control-regex
  const bytes = Buffer.from(text.replace(/[\x00-\x1f\x7f-\x9f]/g, " "), "utf8");
  if (bytes.length <= maxBytes) return bytes.toString("utf8");
  let cut = maxBytes;
  while (cut > 0 && ((bytes[cut] ?? 0) & 0xc0) === 0x80) cut--; // never cut a character in two
  return bytes.subarray(0, cut).toString("utf8");
}

/** One guarded claim, made by Coordinator.replyTo and handed to its work function. */
export class Claim {
  private phase: Phase = "claiming";
  private token_ = 0n;
  private status_: SubjectStatus | undefined;
  private loss_: ClaimLost | undefined;
  private sentMessageId_: string | undefined;
  // Whether anything read the idempotency key (send() hands it to its function, which then counts as taking it).
  private keyTaken = false;
  // Until this performance.now() value the claim certainly holds: the coordinator counts the TTL from when it
  // handled the last claim or renewal, which is after we sent it.
  private validUntil = 0;
  private ttl_: number;
  private readonly lostController = new AbortController();
  private readonly stopRenewal = new AbortController();
  private readonly claimOp;
  /** @internal The reply's span (started on entering), when OpenTelemetry records one (docs/operations.md#traces). */
  trace: GuardSpan | undefined;
  /** @internal Set when the notification's message is one the mailbox sent: entering reports it and refuses. */
  outgoing: { why: OutgoingMatch; report: Op<OutgoingResult> | undefined } | undefined;
  /** @internal Set when the message is automated mail: entering records it for people (RecordIncoming) and refuses. */
  automated: { why: string; report: Op<IncomingResult> | undefined } | undefined;
  /** @internal The message and its provider, for the look at its thread right before the send. */
  look: { facts: MessageFacts; provider: Provider } | undefined;

  constructor(
    private readonly coordinator: Coordinator,
    /** The message (or thread, with scope "thread") this claim is on. */
    readonly subject: Subject,
    /** The notification this claim recorded as delivered (empty when none was given). */
    readonly notificationId: string,
    ttl: number,
    note: string,
    summary?: MessageSummary,
    threadId?: string,
    receivedAt?: Date,
    correspondent?: string,
  ) {
    this.ttl_ = ttl;
    const thread = threadId && receivedAt ? { threadId, receivedAt } : {};
    this.claimOp = coordinator.claimOp(subject, { ttl, notificationId, note: cleanText(note), summary, correspondent: correspondent ?? "", ...thread });
  }

  /** The fencing token (0n until the claim is granted). */
  get token(): bigint {
    return this.token_;
  }
  /** The claim's TTL in seconds; it is renewed every third of it. */
  get ttl(): number {
    return this.ttl_;
  }
  /** The subject's status as last answered by the coordinator. */
  get status(): SubjectStatus | undefined {
    return this.status_;
  }
  /** When the claim frees unless renewed, as of the last grant or renewal (the coordinator's clock). */
  get expiresAt(): Date | undefined {
    return this.status_?.expiresAt;
  }
  /** Aborts (its reason is a ClaimLost) once the claim is found lost: taken over, expired, or unrenewable past its TTL. */
  get signal(): AbortSignal {
    return this.lostController.signal;
  }
  /** Why the claim was lost, once it was. */
  get loss(): ClaimLost | undefined {
    return this.loss_;
  }
  get lost(): boolean {
    return this.loss_ !== undefined;
  }
  /** What the send function returned, once the reply is recorded. */
  get sentMessageId(): string | undefined {
    return this.sentMessageId_;
  }
  /** True once send() went through and the coordinator recorded the reply (REPLIED). */
  get replied(): boolean {
    return this.phase === "replied";
  }
  /**
   * "ic1-" + 64 hex digits from (mailbox, kind, id) only, equal to the Python client's claim.idempotency_key.
   * Send it as the mail API's Idempotency-Key: every agent computes the same key for the same subject.
   */
  get idempotencyKey(): string {
    this.keyTaken = true;
    return idempotencyKey(this.subject);
  }

  /**
   * The claim's stamp (its idempotency key and fencing token), for a provider that takes no idempotency key:
   * its reply carries it (X-Inbox-Claim), so that the reply's copy in the sent mail is known as this claim's
   * (docs/providers.md, "The claim stamp"). `claim.send(() => graph.reply(message, { body, stamp: claim.stamp }))`.
   */
  get stamp(): ClaimStamp {
    if (this.token_ <= 0n) throw new Error("claim.stamp needs a granted claim (read it inside claim.send)");
    return { key: this.idempotencyKey, token: this.token_ };
  }

  /** Throws ClaimLost if the claim was lost: call it between long steps of drafting. */
  throwIfLost(): void {
    if (this.loss_ !== undefined) throw this.lostError();
  }

  toString(): string {
    return `<Claim ${this.subject.kind} ${this.subject.id} token=${this.token_} ${this.phase}>`;
  }

  private lostError(): ClaimLost {
    const loss = this.loss_!;
    return new ClaimLost(loss.subject, loss.token, loss.reason, loss.status);
  }

  // -- claim ------------------------------------------------------------------------------------------

  /**
   * @internal ClaimReply with the notification id: dedup and claim in one call; a refusal is thrown. A message
   * the mailbox sent is never claimed: RecordOutgoing reports it, one log line says why, OutgoingMessage is
   * thrown. `deadline` (a performance.now() value) bounds the call with its retries.
   */
  async enter(deadline?: number): Promise<void> {
    if (this.phase !== "claiming") throw new Error("a claim can be entered only once; call replyTo() again for a new one");
    this.trace = replyStarted(this.subject, this.notificationId);
    try {
      await this.claim(deadline);
    } catch (error) {
      this.traceEnd(error);
      throw error;
    }
  }

  private async claim(deadline?: number): Promise<void> {
    const { outgoing, automated } = this;
    if (outgoing !== undefined) {
      await this.leave("outgoing", outgoing.report, deadline, (recorded) => new OutgoingMessage(this.subject, this.notificationId, outgoing.why, recorded));
    }
    if (automated !== undefined) {
      await this.leave("automated", automated.report, deadline, (recorded) => new AutomatedMessage(this.subject, this.notificationId, automated.why, recorded));
    }
    const started = performance.now();
    const result = await this.call(this.claimOp, deadline);
    const status = grantedStatus(result, this.subject, this.notificationId);
    this.status_ = status;
    this.token_ = status.fencingToken;
    this.trace?.set({ "inbox.fencing_token": Number(status.fencingToken) });
    this.ttl_ = status.ttlSeconds || this.ttl_;
    this.validUntil = started + this.ttl_ * 1000;
    this.phase = "claimed";
    void this.renewal().catch((error: unknown) => process.emitWarning(`the renewal of ${this.toString()} stopped: ${String(error)}`));
  }

  /** A message an agent never answers: reported (when it can be), one log line says why, the refusal thrown. */
  private async leave<R>(phase: Phase, report: Op<R> | undefined, deadline: number | undefined, refusal: (recorded: R | undefined) => ClaimNotGranted): Promise<never> {
    this.phase = phase;
    const error = refusal(report === undefined ? undefined : await this.call(report, deadline));
    this.coordinator.logger.info(`inbox-claims: ${error.message}`);
    throw error;
  }

  // -- renewal -----------------------------------------------------------------------------------------

  private async renewal(): Promise<void> {
    const interval = (this.ttl_ * 1000) / 3;
    let nextAt = this.validUntil - this.ttl_ * 1000 + interval;
    const stop = this.stopRenewal.signal;
    for (;;) {
      await wait(nextAt - performance.now(), stop);
      if (stop.aborted || this.phase !== "claimed") return;
      const started = performance.now();
      const op = this.coordinator.renewOp(this.subject, this.token_, this.ttl_);
      // A renewal must land before the expiry counted from the last grant; a grant that came after retries
      // longer than the TTL is past that already: ask once anyway. The renewal is fenced, so OK proves it holds.
      const deadline = this.validUntil > started ? this.validUntil : started + interval;
      let result;
      try {
        result = await this.call(op, deadline);
      } catch (error) {
        const now = performance.now();
        if (this.phase !== "claimed") return; // work ended (or the send began) meanwhile
        this.trace?.event("renewal failed", { "error.type": error instanceof Error ? error.constructor.name : typeof error });
        if (now >= this.validUntil) return this.lose("renewal_failed", undefined, "claimed");
        process.emitWarning(`renewing claim ${this.token_} on ${this.subject.id} failed: ${String(error)}; trying again`);
        nextAt = now + Math.max(RENEWAL_RETRY_FLOOR_MS, Math.min(interval, (this.validUntil - now) / 3));
        continue;
      }
      if (!result.ok) return this.lose(this.staleReason(result.status), result.status, "claimed");
      if (this.phase === "claimed") {
        this.status_ = result.status;
        this.validUntil = started + this.ttl_ * 1000;
        this.trace?.event("renewed", { "inbox.ttl_seconds": this.ttl_ });
      }
      nextAt = started + interval;
    }
  }

  private staleReason(status: SubjectStatus): LossReason {
    if (status.repliedOutside) return "answered_outside";
    if (status.state === "CLAIMED" && status.holderKind === "human") return "taken_over";
    if (performance.now() >= this.validUntil) return "expired"; // we were paused past the TTL
    return "stale_token"; // renewed in time, yet gone: released or taken over meanwhile
  }

  private lose(reason: LossReason, status: SubjectStatus | undefined, expected: Phase): void {
    if (this.phase !== expected) return; // the send (or the end of work) got there first
    this.phase = "lost";
    this.loss_ = new ClaimLost(this.subject, this.token_, reason, status);
    this.trace?.event("claim lost", { "inbox.loss_reason": reason });
    this.lostController.abort(this.loss_);
  }

  // -- send --------------------------------------------------------------------------------------------

  /**
   * Sends the reply through the fenced commit point, once: with a provider to look at (ReplyOptions.provider), the
   * thread's newer messages are recorded first; then BeginSend (a stale token: ClaimLost; refused by the mailbox's
   * reply rules: the claim is released and ReplyBudgetSpent or ConversationMovedOn thrown; `fn` is never called),
   * then `fn(idempotencyKey)`, which must send with that key as the mail API's Idempotency-Key header
   * and return the sent message's id (a string) or undefined/null, then ConfirmSent. If `fn` throws
   * SendRejected, AbortSend frees the subject and the error is rethrown; any other error leaves the subject
   * SENDING (reported IN_DOUBT later) and throws SendOutcomeUnknown (its cause). Resolves to what `fn` returned.
   * A send function that takes no key and never reads `claim.idempotencyKey` sends without it: that is warned
   * about (a process warning, INBOX_CLAIMS_NO_IDEMPOTENCY_KEY), since the provider's own refusal of a second
   * reply, the last backstop, then cannot work.
   */
  async send(fn: (idempotencyKey: string) => Promise<string | null | undefined> | string | null | undefined): Promise<string | undefined> {
    if (this.phase === "lost") throw this.lostError();
    if (this.phase !== "claimed") throw new Error(`claim.send() runs once, inside replyTo's work (this claim is ${this.phase})`);
    // A person's send is never refused by the reply rules: nothing to look for on their behalf.
    if (this.look !== undefined && this.status_?.holderKind !== "human") await this.lookBeforeSend(this.look.facts, this.look.provider);
    this.phase = "beginning"; // renewal stops acting; until BeginSend answers, the end of work aborts
    this.stopRenewal.abort();
    const begin = await this.call(this.coordinator.beginSendOp(this.subject, this.token_));
    if (begin.refusal !== undefined) {
      // Nothing was sent or counted and the claim is still ours: give it up for good, since a redelivery of this
      // notification would be refused the same way (the newer message has its own claim; a spent budget, a person).
      this.phase = "released";
      const refused = ReplyRefused.of(this.subject, begin.refusal, begin.status);
      this.coordinator.logger.info(`inbox-claims: ${refused.message}`);
      try {
        await this.release(false);
      } catch (error) {
        if (!(error instanceof InboxClaimsError)) throw error;
        process.emitWarning(`could not release ${this.subject.id} after its send was refused (${error.message}); it frees when its TTL runs out`);
      }
      throw refused;
    }
    if (!begin.ok) {
      this.lose(this.staleReason(begin.status), begin.status, "beginning");
      throw this.lostError();
    }
    this.status_ = begin.status;
    this.phase = "sending";
    let sent: unknown;
    try {
      const key = fn.length > 0 ? this.idempotencyKey : idempotencyKey(this.subject);
      // The send paths mark an agent's reply Auto-Submitted, never a person's (current.ts); an SDK's response is read
      // for its sent id, and an SDK's 4xx is a SendRejected (src/sdks.ts).
      const stamp = `${idempotencyKey(this.subject)}.${this.token_}`;
      sent = sentIdOf(
        await inChild(this.trace, "inbox send", async () => inScope(this.subject.id, true, stamp, () => sendingAs(this.status_?.holderKind === "human", () => fn(key)))),
      );
      if (!this.keyTaken) warnNoIdempotencyKey(this.subject.id);
    } catch (thrown) {
      const error = sdkError(thrown);
      if (error instanceof SendRejected) {
        await this.abort(error);
        throw error;
      }
      this.phase = "unknown";
      throw new SendOutcomeUnknown(this.subject, this.token_, error);
    }
    await this.confirm(sent);
    return (sent as string | null | undefined) ?? undefined;
  }

  /**
   * Records that the reply was made outside send() (by a person in a mail client, by phone): the subject
   * becomes REPLIED and every later notification for it is answered ALREADY_REPLIED. Fenced like send():
   * throws ClaimLost if the claim is no longer yours (nothing is recorded then).
   */
  async markReplied(options: { sentMessageId?: string; note?: string } = {}): Promise<void> {
    if (this.phase === "lost") throw this.lostError();
    if (this.phase !== "claimed") throw new Error(`claim.markReplied() needs a held claim (this claim is ${this.phase})`);
    this.phase = "beginning"; // renewal stops acting; the end of work releases if the answer never comes
    this.stopRenewal.abort();
    const sentMessageId = options.sentMessageId ?? "";
    let result;
    try {
      result = await this.call(this.coordinator.markRepliedOp(this.subject, this.token_, sentMessageId, cleanText(options.note ?? "")));
    } catch (error) {
      this.phase = "claimed";
      throw error;
    }
    if (!result.ok) {
      this.lose(this.staleReason(result.status), result.status, "beginning");
      throw this.lostError();
    }
    this.status_ = result.status;
    this.sentMessageId_ = sentMessageId || undefined;
    this.phase = "replied";
  }

  /**
   * The "double-check inside the lock": asks the provider for the thread's messages received after the claim's and
   * records each as its notification would have been (a reply the mailbox sent: RecordOutgoing, which ends this
   * claim when written outside; anything else: RecordIncoming, so that BeginSend refuses as the conversation moved
   * on). With no notification id: each message's own notification still comes, and is claimed (or refused) then. A
   * provider that cannot answer (a ProviderError) does not stop the send: the commit point's rules still hold for
   * every notification that arrived; it is warned about.
   */
  private async lookBeforeSend(facts: MessageFacts, provider: Provider): Promise<void> {
    if (provider.since === undefined || facts.receivedAt === undefined || !facts.threadId) return;
    let newer: readonly MessageFacts[];
    try {
      newer = await provider.since(facts);
    } catch (error) {
      if (!(error instanceof ProviderError)) throw error;
      process.emitWarning(`looking at thread ${facts.threadId} before the send failed (${error.message}); sending on what the notifications said`);
      return;
    }
    const mailbox = this.subject.mailbox;
    for (const found of newer) {
      if (found.messageId === facts.messageId || !found.threadId || found.receivedAt === undefined) continue;
      const why = found.outgoing ?? this.coordinator.outgoing.judge(found.folders, found.fromAddresses, provider.mailboxAddresses);
      const sender = cleanText(found.sender, SUMMARY_TEXT_MAX_BYTES);
      if (why !== undefined) {
        const claimToken = why.rule === "sent_folder" ? (found.stamp?.token ?? 0n) : 0n;
        await this.coordinator.call(this.coordinator.recordOutgoingOp(mailbox, found.messageId, found.threadId, found.receivedAt, { sender, claimToken }));
      } else {
        const automated = found.automated?.automated ? cleanText(found.automated.why, AUTOMATED_REASON_MAX_BYTES) : "";
        await this.coordinator.call(this.coordinator.recordIncomingOp(mailbox, found.messageId, found.threadId, found.receivedAt, { summary: summaryOf(found), automated }));
      }
    }
  }

  private async abort(rejected: SendRejected): Promise<void> {
    const op = this.coordinator.abortSendOp(this.subject, this.token_, cleanText(rejected.reason));
    try {
      const result = await this.call(op);
      this.status_ = result.status;
      this.phase = result.ok ? "aborted" : "unknown";
    } catch (error) {
      if (!(error instanceof InboxClaimsError)) throw error;
      this.phase = "unknown";
      process.emitWarning(`AbortSend for ${this.subject.id} failed (${error.message}): it stays SENDING and will be reported IN_DOUBT`);
    }
  }

  private async confirm(sent: unknown): Promise<void> {
    const wrongType = sent !== undefined && sent !== null && typeof sent !== "string";
    const sentId = typeof sent === "string" ? sent : undefined;
    let result;
    try {
      result = await this.call(this.coordinator.confirmSentOp(this.subject, this.token_, sentId ?? ""));
    } catch (error) {
      this.phase = "unknown";
      if (!(error instanceof InboxClaimsError)) throw error;
      throw new SentButUnconfirmed(this.subject, this.token_, sentId, `ConfirmSent failed: ${error.message}`, error);
    }
    if (!result.ok) {
      this.phase = "unknown";
      throw new SentButUnconfirmed(this.subject, this.token_, sentId, `the coordinator no longer knows this send (${result.status.state})`);
    }
    this.status_ = result.status;
    this.sentMessageId_ = sentId;
    this.phase = "replied";
    if (wrongType) {
      throw new TypeError(
        `the send function returned ${typeof sent}; return the sent message id (a string) or undefined. The reply was sent and is recorded as REPLIED without an id.`,
      );
    }
  }

  // -- the end of work ---------------------------------------------------------------------------------

  /**
   * @internal replyTo's second half, on an entered claim: runs `work`, then releases what was not sent (as
   * redeliverable when `work` threw). Resolves to what `work` returned.
   */
  async run<T>(work: (claim: Claim) => Promise<T>): Promise<T> {
    let failed: { error: unknown } | undefined;
    try {
      // The reply's span is the active one in the work: the user's own spans and the send's request beneath it; a send
      // outside claim.send is caught there (src/sdks.ts).
      const run = () => inScope(this.subject.id, false, "", () => work(this));
      return await (this.trace === undefined ? run() : this.trace.active(run));
    } catch (error) {
      failed = { error };
      throw error;
    } finally {
      try {
        await this.exit(failed !== undefined);
      } finally {
        this.traceEnd(failed?.error);
      }
    }
  }

  // -- the reply's span (docs/operations.md#traces) ----------------------------------------------------

  private call<R>(op: Op<R>, deadline?: number): Promise<R> {
    return this.coordinator.call(op, deadline, this.trace);
  }

  /** Ends the reply's span with the claim's outcome (a refusal on entering is an outcome, not a failure). */
  private traceEnd(error: unknown): void {
    if (this.trace === undefined) return;
    const refusal = REFUSAL_OUTCOMES.find(([type]) => error instanceof type)?.[1];
    if (refusal !== undefined) this.trace.end(refusal);
    else if (this.phase === "claiming" || this.phase === "outgoing") this.trace.end("not_claimed", error);
    else this.trace.end(this.phase, this.phase === "lost" ? undefined : error);
  }

  /**
   * @internal Best effort, never throws a coordinator error: release an unsent claim; abort a BeginSend whose
   * answer was lost (the send function was never called). `failed`: work threw, so giving the claim up is no
   * decision about the message: released as redeliverable, as after a lost renewal or a lost BeginSend answer.
   */
  async exit(failed: boolean): Promise<void> {
    this.stopRenewal.abort();
    const phase = this.phase;
    const unsure = phase === "lost" && this.loss_?.reason === "renewal_failed";
    if (phase === "claimed" || phase === "beginning" || unsure) this.phase = "released";
    try {
      if (phase === "claimed" || unsure) {
        await this.release(failed || unsure);
      } else if (phase === "beginning") {
        const reason = "BeginSend's answer was lost; the send function was never called";
        try {
          await this.call(this.coordinator.abortSendOp(this.subject, this.token_, reason, true));
        } catch (error) {
          if (!(error instanceof FailedPrecondition)) throw error;
          await this.release(true); // BeginSend never committed: the subject is still CLAIMED
        }
      }
    } catch (error) {
      if (!(error instanceof InboxClaimsError)) throw error;
      process.emitWarning(`could not release ${this.subject.id} (${error.message}); it frees when its TTL runs out`);
    }
  }

  private async release(redeliverable: boolean): Promise<void> {
    const result = await this.call(this.coordinator.releaseOp(this.subject, this.token_, redeliverable));
    this.status_ = result.status;
  }
}

const REFUSAL_OUTCOMES: [new (...args: never[]) => Error, string][] = [
  [DuplicateDelivery, "duplicate_delivery"],
  [ReplyHeld, "held"],
  [AlreadyReplied, "already_replied"],
  [OutgoingMessage, "outgoing"],
];

/** Resolves after `ms`, or at once when `signal` aborts. */
function wait(ms: number, signal: AbortSignal): Promise<void> {
  if (signal.aborted || ms <= 0) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done(): void {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
    signal.addEventListener("abort", done, { once: true });
  });
}
