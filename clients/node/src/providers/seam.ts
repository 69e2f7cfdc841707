// The seam between the mail providers and everything that coordinates (docs/providers.md, docs/design.md#providers),
// the Node twin of the Python client's inbox_claims.providers._seam.
//
// A provider turns what its webhook delivers into MessageFacts, the one value the guard (Coordinator.replyTo), the
// webhook adapters and the outgoing rules read. Its three parts:
//   check(request)          the signature and the endpoint's handshakes, on the raw body, before anything is stored;
//   open(accepted, cursors) the facts of one delivery, as a Batch whose commit() runs once every message of it was
//                           recorded (a provider whose notifications only point at a change keeps its position as a
//                           cursor in the coordinator: docs/design.md#cursors);
//   reply(...)              a send function for claim.send: with the claim's idempotency key, or stamped from the claim.
// Where Python runs one flow of effects under a blocking and an asyncio client, Node has one kind of I/O: a provider's
// steps are async functions over an injected Transport (fetch by default, a double in tests).
import { agentHeaders } from "../current.js";
import { InboxClaimsError, SendRejected } from "../errors.js";
import type { OutgoingMatch } from "../outgoing.js";
import { traceHeaders } from "../tracing.js";
import { verifySvixWebhook, WebhookVerificationError } from "../webhooks.js";

/** The header a reply sent without an idempotency key carries: `<idempotency key>.<fencing token>`. */
export const STAMP_HEADER = "X-Inbox-Claim";
const STAMP = /^(ic1-[0-9a-f]{64})\.([1-9][0-9]{0,18})$/;

/** The claim a reply was sent under: its idempotency key and its fencing token. */
export interface ClaimStamp {
  readonly key: string;
  readonly token: bigint;
}

/** The stamp as the header carries it. */
export function formatStamp(stamp: ClaimStamp): string {
  return `${stamp.key}.${stamp.token}`;
}

/** A Message-ID derived from the stamp (RFC 5322: `<left@domain>`). */
export function stampMessageId(stamp: ClaimStamp, domain: string): string {
  return `<${formatStamp(stamp)}@${domain || "inbox-claims.invalid"}>`;
}

/** The stamp of an X-Inbox-Claim value (or of a Message-ID derived from one); undefined for anything else. */
export function parseStamp(value: string | undefined | null): ClaimStamp | undefined {
  if (!value) return undefined;
  let text = value.trim();
  if (text.startsWith("<") && text.endsWith(">")) text = text.slice(1, -1).split("@")[0]!;
  const match = STAMP.exec(text);
  return match ? { key: match[1]!, token: BigInt(match[2]!) } : undefined;
}

/** Whether a message is automated mail and why (the rule and value: "Auto-Submitted: auto-replied"), by judgeAutomated. */
export interface Automated {
  readonly automated: boolean;
  readonly why: string;
}

/** What a reply needs: who to answer (Reply-To, else From), its subject, the message's Message-ID and References. */
export interface ReplyContext {
  readonly to: readonly string[];
  readonly subject: string;
  readonly internetMessageId: string | undefined;
  readonly references: readonly string[];
}

/** What the coordinator needs from any provider's message: the neutral value (docs/providers.md, "The neutral value"). */
export interface MessageFacts {
  readonly provider: string;
  /** "message.created" or "message.updated", in Nylas's words for every provider. */
  readonly event: string;
  readonly mailbox: string;
  /** The delivery's dedup key: ClaimReply's notification_id. */
  readonly dedupKey: string;
  readonly messageId: string;
  readonly threadId: string | undefined;
  readonly receivedAt: Date | undefined;
  /** "Name <address>", or whichever half is known. */
  readonly sender: string;
  readonly subjectLine: string;
  readonly fromAddresses: readonly string[];
  /** Folder or label ids the message is in; SENT stands for the provider's sent folder. */
  readonly folders: readonly string[];
  /** Why the mailbox sent it, as the client's outgoing rules decide; undefined: incoming (or not judged yet). */
  readonly outgoing: OutgoingMatch | undefined;
  /**
   * Whether it is automated mail agents leave (src/automated.ts, conformance/automated.json), judged on its headers;
   * undefined: not known (a provider that could not read them).
   */
  readonly automated: Automated | undefined;
  readonly stamp: ClaimStamp | undefined;
  readonly reply: ReplyContext;
  /** The provider's own document: the Nylas Notification, the Graph message, the Gmail message. */
  readonly source: unknown;
}

/** Tells MessageFacts from the other things a handler may have (a Nylas Notification, an envelope, a ReplyTarget). */
export function isMessageFacts(value: unknown): value is MessageFacts {
  return typeof value === "object" && value !== null && "dedupKey" in value && "provider" in value && "reply" in value;
}

/** One request to a webhook endpoint: `query` the raw query string, `headers` with lower-case names, `body` as received. */
export interface WebhookRequest {
  readonly method: string;
  readonly query: string;
  readonly headers: Readonly<Record<string, string>>;
  readonly body: Buffer;
}

/** What the endpoint answers. */
export interface Answer {
  readonly status: number;
  readonly body: string;
  readonly headers?: Readonly<Record<string, string>>;
  readonly contentType?: string;
}

/** A request whose signature held: `delivery` is the provider's parsed payload, for its open(). */
export class Accepted {
  constructor(readonly delivery: unknown) {}
}

/** A delivery nothing recorded: never 2xx, so that the provider delivers it again. */
export function retryLater(why: string): Answer {
  return { status: 503, body: `${why}; deliver it again later`, headers: { "retry-after": "5" } };
}

/**
 * The provider's API could not answer what a delivery needs (a 5xx, a timeout, a refusal): the delivery is not
 * acknowledged, so that the provider delivers it again.
 */
export class ProviderError extends Error {
  override name = "ProviderError";
}

/** One request to a provider's API, for whichever transport runs it. */
export interface HttpRequest {
  readonly method: string;
  /** Without its query: the parameters are `params`. */
  readonly url: string;
  readonly params: readonly (readonly [string, string])[];
  readonly headers: readonly (readonly [string, string])[];
  readonly json?: unknown;
  /** A body that is not JSON (Graph's base64 MIME), sent as it is; its Content-Type is in `headers`. */
  readonly content?: Buffer;
}

export interface HttpResponse {
  readonly status: number;
  readonly body: Buffer;
  readonly headers?: Readonly<Record<string, string>>;
}

/** Sends one request to a provider's API. */
export type Transport = (request: HttpRequest) => Promise<HttpResponse>;

/** The URL with its query, as sent. */
export function fullUrl(request: HttpRequest): string {
  return request.url + (request.params.length > 0 ? "?" + new URLSearchParams(request.params as [string, string][]).toString() : "");
}

/** The JSON body, or undefined when it is not JSON. */
export function jsonOf(response: HttpResponse): unknown {
  try {
    return response.body.length > 0 ? (JSON.parse(response.body.toString("utf8")) as unknown) : undefined;
  } catch {
    return undefined;
  }
}

/** The transport on fetch: an answer is whatever came back; no answer (a timeout, a refused connection) is a ProviderError. */
export function fetchTransport(options: { timeoutMs?: number } = {}): Transport {
  const timeoutMs = options.timeoutMs ?? 30_000;
  return async (request) => {
    // Every request to Graph or Gmail carries the active span's trace context (a reply's, beneath "inbox send").
    const headers = new Headers([...(request.headers as [string, string][]), ...Object.entries(traceHeaders())]);
    let body: string | Buffer | undefined = request.content;
    if (request.json !== undefined) {
      body = JSON.stringify(request.json);
      if (!headers.has("content-type")) headers.set("content-type", "application/json");
    }
    try {
      const response = await fetch(fullUrl(request), { method: request.method, headers, body, signal: AbortSignal.timeout(timeoutMs) });
      return { status: response.status, body: Buffer.from(await response.arrayBuffer()), headers: Object.fromEntries(response.headers) };
    } catch (error) {
      const kind = (error as Error).name === "TimeoutError" ? "timed out" : `failed (${(error as Error).name})`;
      throw new ProviderError(`${request.method} ${request.url} ${kind}: ${(error as Error).message}`, { cause: error });
    }
  };
}

/** TakeCursorRange's answer: TAKEN (the range starts at value/position; token advances it), COVERED or BUSY. */
export interface CursorRange {
  readonly outcome: "TAKEN" | "COVERED" | "BUSY";
  readonly value: string;
  readonly position: bigint;
  readonly token: bigint;
  readonly holder: string;
  /** BUSY: milliseconds until the other worker's range lapses. */
  readonly expiresInMs: number;
}

/** The coordinator's cursors (docs/design.md#cursors): Coordinator.cursors, or a double in the vectors' runner. */
export interface Cursors {
  take(mailbox: string, name: string, throughPosition: bigint, ttlSeconds: number): Promise<CursorRange>;
  advance(mailbox: string, name: string, taken: CursorRange, value: string, position: bigint): Promise<boolean>;
}

/**
 * The cursors of one delivery (a Cursors over another): remembers each range taken and not yet advanced, so that a
 * delivery that fails anywhere (the provider's API, the coordinator, the admission's time bound) gives its ranges
 * back at once (giveBack), instead of leaving the mailbox to wait for their leases. Where Python cancels the
 * provider's open() at the time bound, a Node promise runs on: a range it takes after giveBack() is given back as
 * soon as it is taken, and that open() fails.
 */
export class RangesTaken implements Cursors {
  private readonly open = new Map<string, { mailbox: string; name: string; taken: CursorRange }>();
  private closed = false;

  constructor(readonly cursors: Cursors) {}

  async take(mailbox: string, name: string, throughPosition: bigint, ttlSeconds: number): Promise<CursorRange> {
    if (this.closed) throw new ProviderError("the delivery was given up (its time bound passed): no range is taken for it");
    const taken = await this.cursors.take(mailbox, name, throughPosition, ttlSeconds);
    if (taken.outcome !== "TAKEN") return taken;
    if (this.closed) {
      await this.cursors.advance(mailbox, name, taken, taken.value, taken.position);
      throw new ProviderError("the delivery was given up (its time bound passed): its range was given back");
    }
    this.open.set(JSON.stringify([mailbox, name]), { mailbox, name, taken });
    return taken;
  }

  async advance(mailbox: string, name: string, taken: CursorRange, value: string, position: bigint): Promise<boolean> {
    this.open.delete(JSON.stringify([mailbox, name]));
    return this.cursors.advance(mailbox, name, taken, value, position);
  }

  /** Advances every range still open to its start (the cursor unmoved, the range free for the next delivery); none is taken after. */
  async giveBack(): Promise<void> {
    this.closed = true;
    const left = [...this.open.values()];
    this.open.clear();
    const given = await Promise.allSettled(left.map(({ mailbox, name, taken }) => this.cursors.advance(mailbox, name, taken, taken.value, taken.position)));
    const failed = given.find((outcome): outcome is PromiseRejectedResult => outcome.status === "rejected");
    if (failed !== undefined) throw failed.reason; // the rest were given back; this one waits for its lease
  }
}

/**
 * The facts of one delivery. commit() runs once each was recorded (a cursor advances), abandon() when one could
 * not be (a cursor's range is given back). `actions`: what the provider did besides (lifecycle).
 */
export interface Batch {
  readonly facts: readonly MessageFacts[];
  commit(): Promise<void>;
  abandon(): Promise<void>;
  readonly actions: readonly string[];
}

const nothing = async (): Promise<void> => {};

export function batchOf(facts: readonly MessageFacts[] = [], more: Partial<Omit<Batch, "facts">> = {}): Batch {
  return { facts, commit: more.commit ?? nothing, abandon: more.abandon ?? nothing, actions: more.actions ?? [] };
}

/** One mail platform behind the seam (docs/providers.md, "The provider protocol"). */
export interface Provider {
  readonly name: string;
  /** The mailbox's own addresses the provider knows (added to the client's outgoing rules). */
  readonly mailboxAddresses: readonly string[];
  /** How long the provider waits for an answer, in milliseconds (Nylas 10 s, Graph 3 s, Pub/Sub 10 s). */
  readonly answerWithinMs: number;
  check(request: WebhookRequest): Promise<Answer | Accepted>;
  open(accepted: Accepted, cursors: Cursors): Promise<Batch>;
  /** The answer to a delivery every message of which was recorded. */
  acknowledge(): Answer;
  /**
   * A provider whose pushes can be dropped (Gmail): the delivery its periodic check opens, which finds what a dropped
   * push would have said. The webhook adapters run it every `periodicIntervalMs` (0: never).
   */
  periodic?(): Accepted;
  readonly periodicIntervalMs?: number;
  /**
   * The messages of `message`'s thread received after it, as facts (the look before a send, docs/node.md): one or a
   * few API requests. A ProviderError when the provider's API cannot answer.
   */
  since?(message: MessageFacts): Promise<MessageFacts[]>;
}

// -- helpers the providers share ---------------------------------------------------------------------------

/** The first header called `name` (case aside) of a list of {name, value} objects, as Graph and Gmail give them. */
export function header(headers: unknown, name: string): string | undefined {
  if (!Array.isArray(headers)) return undefined;
  const wanted = name.toLowerCase();
  for (const item of headers) {
    if (typeof item !== "object" || item === null) continue;
    const { name: key, value } = item as Record<string, unknown>;
    if (typeof key === "string" && key.toLowerCase() === wanted && typeof value === "string") return value;
  }
  return undefined;
}

/** `Name <addr>` (or a bare address) as [name, address]. */
export function splitAddress(text: string): [string, string] {
  const trimmed = text.trim();
  const match = /<([^<>@\s]+@[^<>\s]+)>\s*$/.exec(trimmed);
  if (match) return [trimmed.slice(0, match.index).trim().replace(/^"|"$/g, "").trim(), match[1]!];
  return ["", trimmed];
}

/** The sender as people read it: `Name <address>`, or whichever half is there. */
export function display(name: string, address: string): string {
  return name && address ? `${name} <${address}>` : name || address;
}

/**
 * A reply as MIME (Gmail's raw send, Graph's MIME createReply), as the Python client's reply_mime: `first` (Gmail's
 * From and Message-ID), To the sender (its Reply-To), the subject, In-Reply-To and References, the claim's stamp, and
 * an agent's Auto-Submitted: auto-replied (agentHeaders: never on a person's reply); the body as UTF-8 in base64.
 */
export function replyMime(message: MessageFacts, body: string, stamp: ClaimStamp, first: readonly (readonly [string, string])[] = []): Buffer {
  const lines: (readonly [string, string])[] = [...first, ["To", message.reply.to.join(", ")], ["Subject", message.reply.subject]];
  if (message.reply.internetMessageId) {
    lines.push(["In-Reply-To", message.reply.internetMessageId], ["References", [...message.reply.references, message.reply.internetMessageId].join(" ")]);
  }
  lines.push([STAMP_HEADER, formatStamp(stamp)], ...agentHeaders());
  lines.push(["MIME-Version", "1.0"], ["Content-Type", 'text/plain; charset="utf-8"'], ["Content-Transfer-Encoding", "base64"]);
  const encoded = Buffer.from(body, "utf8").toString("base64").replace(/.{76}/g, "$&\r\n");
  return Buffer.from(lines.map(([key, value]) => `${key}: ${encodedWord(value)}`).join("\r\n") + "\r\n\r\n" + encoded + "\r\n", "utf8");
}

/** A header value as RFC 2047 wants it: ASCII as it is, anything else as one UTF-8 encoded word. */
function encodedWord(value: string): string {
  return /^[\x20-\x7e]*$/.test(value) ? value : `=?UTF-8?B?${Buffer.from(value, "utf8").toString("base64")}?=`;
}

export function replySubject(subject: string): string {
  return subject.toLowerCase().startsWith("re:") ? subject : `Re: ${subject}`.trimEnd();
}

/** The <...> ids of a References (or In-Reply-To) header. */
export function messageIds(value: string | undefined): string[] {
  return value?.match(/<[^<>\s]+>/g) ?? [];
}

/** The Authorization header of a provider's API request, from a token or a function that gives the current one. */
export function bearer(token: string | (() => string)): readonly [string, string] {
  return ["Authorization", `Bearer ${typeof token === "function" ? token() : token}`];
}

/** Throws, naming the variable and the docs' section, when one of `names` is unset or empty in `env`. */
export function requireEnv(env: Record<string, string | undefined>, names: readonly string[], section: string): void {
  for (const name of names) if (!env[name]) throw new TypeError(`set ${name} (docs/providers.md, ${section})`);
}

export const isRecord = (value: unknown): value is Record<string, unknown> => typeof value === "object" && value !== null && !Array.isArray(value);
export const str = (value: unknown): string => (typeof value === "string" ? value : "");

/** The header an agent's reply carries (RFC 3834): an auto-responder elsewhere does not answer it, so two agents never mail each other in a loop. */
export const AUTO_SUBMITTED: readonly [string, string] = ["Auto-Submitted", "auto-replied"];

/** The date of an ISO 8601 text; undefined for anything else. */
export function isoDate(text: unknown): Date | undefined {
  if (typeof text !== "string" || !text) return undefined;
  const date = new Date(text);
  return Number.isNaN(date.getTime()) ? undefined : date;
}

/** A value of a header map ({name: value}, as AgentMail and Resend give them), the name's case aside. */
export function headerIn(headers: unknown, name: string): string | undefined {
  if (!isRecord(headers)) return undefined;
  const wanted = name.toLowerCase();
  for (const [key, value] of Object.entries(headers)) if (key.toLowerCase() === wanted && typeof value === "string") return value;
  return undefined;
}

/**
 * A send to an API that takes an Idempotency-Key (AgentMail, Resend), as claim.send needs its answer: the sent
 * message's id from a 2xx (`idOf`); a 4xx other than 409 throws `rejected` (nothing went out: the claim is freed);
 * a 409 (the key was taken by a send that went out or is in flight), a 5xx or no answer throws `unknown` (the send
 * stays SENDING, then IN_DOUBT, until the sent event carrying the claim's stamp settles it, or a person does).
 */
export async function keyedSend(
  transport: Transport,
  request: HttpRequest,
  what: string,
  idOf: (document: Record<string, unknown>) => unknown,
  errors: { rejected: new (reason: string) => SendRejected; unknown: new (message: string, options?: { cause?: unknown }) => InboxClaimsError },
): Promise<string | undefined> {
  let response: HttpResponse;
  try {
    response = await transport(request);
  } catch (error) {
    throw new errors.unknown(`${what}: no answer, the reply may have gone out: ${(error as Error).message}`, { cause: error });
  }
  const document = jsonOf(response);
  const record = isRecord(document) ? document : {};
  const detail = str(record.message) || str(record.error) || str(record.name) || response.body.toString("utf8").slice(0, 200);
  if (response.status >= 200 && response.status < 300) {
    const id = idOf(record);
    return typeof id === "string" && id ? id : undefined;
  }
  if (response.status === 409) throw new errors.unknown(`${what}: HTTP 409, a send with this idempotency key went out or is in flight (${detail})`);
  if (response.status >= 400 && response.status < 500) throw new errors.rejected(`${what} refused (HTTP ${response.status}), nothing was sent: ${detail}`);
  throw new errors.unknown(`${what}: HTTP ${response.status}, the reply may have gone out: ${detail}`);
}

/** Throws, naming `variable`, unless `secret` is a Svix endpoint secret ('whsec_<base64>'): at start, not on the first request. */
export function requireSvixSecret(secret: string, provider: string, variable: string): void {
  if (typeof secret !== "string" || !secret) throw new TypeError(`the ${provider} webhook secret is empty: the endpoint's 'whsec_...' secret (${variable})`);
  try {
    verifySvixWebhook(Buffer.alloc(0), { "svix-id": "config-check", "svix-timestamp": "0", "svix-signature": "v1,AAAA" }, secret, { now: 0 });
  } catch (error) {
    if (!(error instanceof WebhookVerificationError)) throw new TypeError(`${variable}: ${(error as Error).message}`);
  }
}

/**
 * A Svix-signed request's check (AgentMail, Resend): 405 for anything but a POST, 401 for a signature that does not
 * hold (nothing recorded), 400 for a body that is not JSON; else the parsed body.
 */
export function svixChecked(request: WebhookRequest, provider: string, secret: string, toleranceSeconds: number, now: number): Answer | Record<string, unknown> | unknown[] {
  if (request.method !== "POST") return { status: 405, body: `${provider} posts its events; ${request.method} is not one`, headers: { allow: "POST" } };
  try {
    verifySvixWebhook(request.body, request.headers, secret, { toleranceSeconds, now });
  } catch (error) {
    if (!(error instanceof WebhookVerificationError)) throw error;
    return { status: 401, body: `signature refused: ${error.message}; nothing recorded` };
  }
  try {
    const document: unknown = JSON.parse(request.body.toString("utf8"));
    return isRecord(document) || Array.isArray(document) ? document : { value: document };
  } catch {
    return { status: 400, body: `the body is not JSON: not a ${provider} event` };
  }
}

/** Tells svixChecked's refusal from its parsed body. */
export const isAnswer = (value: unknown): value is Answer => isRecord(value) && typeof value.status === "number" && typeof value.body === "string" && Object.keys(value).every((k) => ["status", "body", "headers"].includes(k));
