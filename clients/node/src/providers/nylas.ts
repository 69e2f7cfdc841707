// Nylas behind the provider seam (docs/providers.md), the Python client's inbox_claims.providers.nylas: its webhooks
// (x-nylas-signature or Standard Webhooks, GET ?challenge=, the v3 envelope) as MessageFacts, and its send API with
// outcomes that fit claim.send. A Nylas notification is one message: its top-level `id` is the delivery's dedup key,
// `data.object.id` the message id (conformance/notifications.json pins the envelope; conformance/providers/nylas the
// facts). The send carries the claim's Idempotency-Key:
//
//   Nylas answers                         send() does, and so claim.send leaves the subject
//   2xx                                   returns data.id: REPLIED
//   409 (the idempotency key was used)    throws NylasDuplicateSend: a reply with this key went out or is in
//                                         flight, so never "not sent": SENDING, then IN_DOUBT
//   any other 4xx                         throws NylasSendRejected (a SendRejected): nothing went out; FREE again
//   5xx, timeout, connection error        throws NylasSendUnknown: it may have gone out: SENDING, then IN_DOUBT
//
// send() never retries by itself: a second attempt is a decision for whoever resolves the subject. Every send is an
// agent's reply, marked Auto-Submitted: auto-replied (a custom header; Nylas's reply_to_message_id writes
// In-Reply-To and References), so that other machines leave it (docs/design.md#reply-storms).
//
// A notification carries no headers: with the API key (NylasProviderOptions.apiKey) open() reads the message with
// its headers (GET .../messages/{id}?fields=include_headers, one request per message notification) for the
// automated-mail rules; without it MessageFacts.automated is undefined (not known) and the guard judges the sender
// alone (no-reply, mailer-daemon). The same key lets the send
// path look at the thread first (since(): GET .../messages?thread_id=&received_after=, one request per send).
import { judgeAutomated } from "../automated.js";
import { InboxClaimsError, SendRejected } from "../errors.js";
import { traceHeaders } from "../tracing.js";
import { EnvelopeError, parseNotification, type Notification } from "../envelope.js";
import { NYLAS_SIGNATURE_HEADER, nylasChallengeResponse, signNylas, signStandardWebhook, verifyNylasSignature, verifyStandardWebhook, WebhookVerificationError } from "../webhooks.js";
import { claimCustomHeaders, type CustomHeader } from "../sdks.js";
import {
  Accepted,
  batchOf,
  bearer,
  fetchTransport,
  header,
  isRecord,
  jsonOf,
  parseStamp,
  ProviderError,
  replySubject,
  STAMP_HEADER,
  str,
  type Answer,
  type Batch,
  type HttpRequest,
  type MessageFacts,
  type Provider,
  type Transport,
  type WebhookRequest,
} from "./seam.js";

// Unix seconds of the year 10000: a later "date" is not a time the coordinator can store.
const LAST_DATE_SECONDS = 253402300800;

/**
 * The message's date (Nylas: `date`, unix seconds), as the provider gives it; not the notification's `time`,
 * which is when Nylas noticed the message: the thread rule compares messages' own dates.
 */
export function dateOf(notification: Notification): Date | undefined {
  const date = notification.object.date;
  return typeof date === "number" && Number.isInteger(date) && date >= 0 && date < LAST_DATE_SECONDS ? new Date(date * 1000) : undefined;
}

const emails = (participants: unknown): string[] =>
  (Array.isArray(participants) ? participants : []).flatMap((p) => (isRecord(p) && typeof p.email === "string" ? [p.email] : []));

/**
 * The facts of a Nylas message notification (any action, any variant); undefined for a notification about no
 * message (grant.expired...). Fields of another shape than Nylas documents are left out, never an error.
 */
export function factsOf(notification: Notification): MessageFacts | undefined {
  if (!notification.isMessageEvent || notification.messageId === undefined) return undefined;
  return messageFacts(notification.object, {
    event: notification.baseType,
    mailbox: notification.grantId ?? "",
    dedupKey: notification.notificationId,
    messageId: notification.messageId,
    threadId: notification.threadId,
    receivedAt: dateOf(notification),
    source: notification,
  });
}

/** The facts of a Nylas message object (a notification's, or one the API answered), with what only its envelope says. */
function messageFacts(
  message: Readonly<Record<string, unknown>>,
  known: { event: string; mailbox: string; dedupKey: string; messageId: string; threadId: string | undefined; receivedAt: Date | undefined; source: unknown },
): MessageFacts {
  const senders = Array.isArray(message.from) ? (message.from as unknown[]) : [];
  const first = isRecord(senders[0]) ? senders[0] : {};
  const name = str(first.name), email = str(first.email);
  const subject = str(message.subject);
  const replyTo = Array.isArray(message.reply_to) && message.reply_to.length > 0 ? message.reply_to : senders;
  return {
    provider: "nylas",
    ...known,
    sender: name && email ? `${name} <${email}>` : name || email,
    subjectLine: subject,
    fromAddresses: emails(senders),
    folders: Array.isArray(message.folders) ? message.folders.filter((f): f is string => typeof f === "string") : [],
    outgoing: undefined,
    // `headers` only when the message was read with fields=include_headers; without them: not known (the guard then
    // applies the sender's rules).
    automated: Array.isArray(message.headers) ? judgeAutomated(message.headers as { name: string; value: string }[], email) : undefined,
    stamp: undefined,
    reply: { to: emails(replyTo).filter((address) => address), subject: replySubject(subject), internetMessageId: undefined, references: [] },
    source: known.source,
  };
}

export interface NylasProviderOptions {
  /** "nylas" (default): x-nylas-signature; "standard": Standard Webhooks headers with a whsec_... secret. */
  scheme?: "nylas" | "standard";
  /** Standard Webhooks: how far webhook-timestamp may be from now, in seconds (default 300). */
  toleranceSeconds?: number;
  mailboxAddresses?: readonly string[];
  /**
   * The Nylas API key: with it, each message is read with its headers for the automated-mail rules (one request per
   * message notification; a message in a sent folder gives the claim stamp its send carried, what settles an IN_DOUBT
   * send) and the send path looks at the thread before sending (one request per send).
   */
  apiKey?: string;
  /** Default https://api.us.nylas.com. */
  apiBase?: string;
  /** The sent folders besides SENT (Microsoft and IMAP grants' folder ids: Nylas.sentFolderIds). */
  sentFolders?: readonly string[];
  transport?: Transport;
}

/** Nylas webhooks behind the seam. `secret`: the webhook secret Nylas showed when the webhook was created. */
export class NylasProvider implements Provider {
  readonly name = "nylas";
  readonly answerWithinMs = 10_000;
  readonly scheme: "nylas" | "standard";
  readonly toleranceSeconds: number;
  readonly mailboxAddresses: readonly string[];
  readonly apiBase: string;
  readonly sentFolders: ReadonlySet<string>;
  private readonly apiKey: string;
  private readonly transport: Transport;

  constructor(
    readonly secret: string | Buffer,
    options: NylasProviderOptions = {},
  ) {
    this.apiKey = options.apiKey ?? "";
    this.apiBase = (options.apiBase || DEFAULT_API_BASE).replace(/\/+$/, "");
    this.transport = options.transport ?? fetchTransport();
    this.scheme = options.scheme ?? "nylas";
    this.toleranceSeconds = options.toleranceSeconds ?? 300;
    this.mailboxAddresses = options.mailboxAddresses ?? [];
    this.apiKey = options.apiKey ?? "";
    this.apiBase = (options.apiBase || DEFAULT_API_BASE).replace(/\/+$/, "");
    this.sentFolders = new Set(["SENT", ...(options.sentFolders ?? [])]);
    this.transport = options.transport ?? fetchTransport();
    // Throws on an empty or mistyped secret: at start, not on the first request.
    if (this.scheme === "nylas") signNylas(Buffer.alloc(0), secret);
    else if (this.scheme === "standard") {
      if (typeof secret !== "string") throw new TypeError("a Standard Webhooks secret is a string ('whsec_<base64>')");
      signStandardWebhook(Buffer.alloc(0), { msgId: "config-check", timestamp: 0, secret });
    } else throw new TypeError(`scheme must be "nylas" or "standard", not ${JSON.stringify(this.scheme)}`);
  }

  /** From a vector file's settings (conformance/providers/nylas). */
  static fromSettings(settings: Record<string, unknown>, io: Pick<NylasProviderOptions, "transport"> = {}): NylasProvider {
    return new NylasProvider(str(settings.webhook_secret), {
      mailboxAddresses: (settings.mailbox_addresses as string[] | undefined) ?? [],
      apiKey: str(settings.api_key),
      apiBase: str(settings.api_base),
      sentFolders: (settings.sent_folders as string[] | undefined) ?? [],
      ...io,
    });
  }

  /** The challenge's answer, a refusal (401 signature, 400 envelope), or the notification (no I/O). */
  verify(request: WebhookRequest): Answer | Notification {
    if (request.method === "GET" || request.method === "HEAD") return challenge(request.query);
    if (request.method !== "POST") return { status: 405, body: "use GET ?challenge= or POST", headers: { allow: "GET, HEAD, POST" } };
    try {
      if (this.scheme === "nylas") verifyNylasSignature(request.body, request.headers[NYLAS_SIGNATURE_HEADER], this.secret);
      else verifyStandardWebhook(request.body, request.headers, this.secret as string, { toleranceSeconds: this.toleranceSeconds });
    } catch (error) {
      if (!(error instanceof WebhookVerificationError)) throw error;
      return { status: 401, body: `signature refused: ${error.message}` };
    }
    try {
      return parseNotification(request.body);
    } catch (error) {
      if (!(error instanceof EnvelopeError)) throw error;
      return { status: 400, body: `not a notification envelope: ${error.message}` };
    }
  }

  async check(request: WebhookRequest): Promise<Answer | Accepted> {
    const verdict = this.verify(request);
    return "notificationId" in verdict ? new Accepted(verdict) : verdict;
  }

  async open(accepted: Accepted): Promise<Batch> {
    const notification = accepted.delivery as Notification;
    const facts = factsOf(notification);
    if (facts === undefined || !this.apiKey) return batchOf(facts === undefined ? [] : [facts]);
    // The notification has no headers: the message as the API gives it, with them, for the automated-mail rules.
    const response = await this.transport(this.api(`messages/${encodeURIComponent(facts.messageId)}`, facts.mailbox, [["fields", "include_headers"]]));
    if (response.status === 404) return batchOf([facts]); // deleted since: the facts as notified (automated not known)
    const document = jsonOf(response);
    const data = isRecord(document) ? document.data : undefined;
    if (response.status !== 200 || !isRecord(data)) throw new ProviderError(`reading message ${JSON.stringify(facts.messageId)} with its headers answered HTTP ${response.status}`);
    const { event, mailbox, dedupKey, messageId, threadId, receivedAt, source } = facts;
    const read = messageFacts({ ...notification.object, ...data }, { event, mailbox, dedupKey, messageId, threadId, receivedAt, source });
    // The same read gives a sent message's claim stamp: what settles an IN_DOUBT send.
    const sent = facts.folders.some((folder) => this.sentFolders.has(folder));
    return batchOf([sent ? { ...read, stamp: parseStamp(header(data.headers, STAMP_HEADER)) } : read]);
  }

  private api(path: string, grantId: string, params: [string, string][]): HttpRequest {
    return { method: "GET", url: `${this.apiBase}/v3/grants/${encodeURIComponent(grantId)}/${path}`, params, headers: [bearer(this.apiKey), ["Accept", "application/json"]] };
  }

  /**
   * The messages of `message`'s thread received since it (GET /v3/grants/{grant}/messages?thread_id=&received_after=,
   * with their headers), for the look before a send; none without an API key.
   */
  async since(message: MessageFacts): Promise<MessageFacts[]> {
    if (!this.apiKey || !message.threadId || message.receivedAt === undefined) return [];
    const after = String(Math.floor(message.receivedAt.getTime() / 1000));
    const params: [string, string][] = [["thread_id", message.threadId], ["received_after", after], ["fields", "include_headers"], ["limit", String(SINCE_LIMIT)]];
    const response = await this.transport(this.api("messages", message.mailbox, params));
    const document = jsonOf(response);
    const data = isRecord(document) ? document.data : undefined;
    if (response.status !== 200 || !Array.isArray(data)) throw new ProviderError(`listing thread ${JSON.stringify(message.threadId)} answered HTTP ${response.status}`);
    return data.filter(isRecord).flatMap((found) => {
      const id = str(found.id);
      const date = typeof found.date === "number" && found.date >= 0 && found.date < LAST_DATE_SECONDS ? new Date(found.date * 1000) : undefined;
      if (!id || id === message.messageId) return [];
      const known = { event: "message.created", mailbox: message.mailbox, dedupKey: "", messageId: id, threadId: str(found.thread_id) || message.threadId, receivedAt: date, source: found };
      return [messageFacts(found, known)];
    });
  }

  acknowledge(): Answer {
    return { status: 200, body: "ok" };
  }
}

function challenge(query: string): Answer {
  try {
    const value = nylasChallengeResponse(new URLSearchParams(query));
    return value === undefined ? { status: 400, body: "expected GET ?challenge=<value> (endpoint verification) or a signed POST" } : { status: 200, body: value };
  } catch (error) {
    if (!(error instanceof WebhookVerificationError)) throw error;
    return { status: 400, body: error.message };
  }
}

export const DEFAULT_API_BASE = "https://api.us.nylas.com";
/** The look before a send reads at most this many newer messages of the thread (one page): one is enough to refuse. */
export const SINCE_LIMIT = 50;
export const MAX_IDEMPOTENCY_KEY_LENGTH = 256;

/** The send may or may not have gone out. `statusCode` is undefined when no answer came. */
export class NylasSendUnknown extends InboxClaimsError {
  override name = "NylasSendUnknown";
  constructor(
    message: string,
    readonly statusCode?: number,
    readonly requestId = "",
    cause?: unknown,
  ) {
    super(message, { cause });
  }
}

/** 409: Nylas already took a request with this idempotency key: a reply went out or is in flight. */
export class NylasDuplicateSend extends NylasSendUnknown {
  override name = "NylasDuplicateSend";
}

/** A 4xx other than 409: Nylas refused the request, nothing was sent (claim.send aborts: FREE). */
export class NylasSendRejected extends SendRejected {
  override name = "NylasSendRejected";
  constructor(
    reason: string,
    readonly statusCode: number,
    readonly requestId = "",
    readonly errorType = "",
  ) {
    super(reason);
  }
}

export type Recipient = string | { email: string; name?: string };

export interface NylasReply {
  replyToMessageId: string;
  to: Recipient[];
  subject: string;
  body: string;
  cc?: Recipient[];
  bcc?: Recipient[];
  /** More fields of the Nylas send body, sent as given. */
  fields?: Record<string, unknown>;
}

/** A reply to the message a notification is about: to its sender (its reply_to when set), "Re: " + its subject. */
export function replyTo(notification: Notification, options: { body: string; subject?: string }): NylasReply {
  if (notification.messageId === undefined) throw new TypeError(`a ${notification.type} notification is not about a message`);
  const message = notification.object;
  const pick = (name: string): unknown[] => (Array.isArray(message[name]) ? (message[name] as unknown[]) : []);
  const senders = pick("reply_to").length > 0 ? pick("reply_to") : pick("from");
  const to = senders.filter((p): p is { email: string } => typeof p === "object" && p !== null && typeof (p as { email?: unknown }).email === "string" && (p as { email: string }).email !== "");
  if (to.length === 0) throw new TypeError(`message ${JSON.stringify(notification.messageId)} has no sender address to reply to`);
  let subject = options.subject;
  if (subject === undefined) {
    const original = typeof message["subject"] === "string" ? message["subject"] : "";
    subject = original.toLowerCase().startsWith("re:") ? original : `Re: ${original}`.trimEnd();
  }
  return { replyToMessageId: notification.messageId, to: to.map((p) => ({ ...p })), subject, body: options.body };
}

function participants(recipients: Recipient[], name: string): { email: string; name?: string }[] {
  const list = recipients.map((r) => (typeof r === "string" ? { email: r } : { ...r }));
  if (name === "to" && list.length === 0) throw new TypeError("a reply needs at least one recipient in to");
  for (const participant of list) if (!participant.email) throw new TypeError(`every recipient in ${name} needs an email address`);
  return list;
}

export interface SendRequest {
  url: string;
  headers: Record<string, string>;
  body: string;
}

/** The POST .../v3/grants/{grantId}/messages/send request for `reply`. */
export function buildSendRequest(apiBase: string, apiKey: string, grantId: string, reply: NylasReply, idempotencyKey: string): SendRequest {
  if (!apiKey) throw new TypeError("the Nylas API key is empty");
  if (!grantId) throw new TypeError("grantId is empty: pass the notification's grantId");
  if (!idempotencyKey || idempotencyKey.length > MAX_IDEMPOTENCY_KEY_LENGTH || ![...idempotencyKey].every((ch) => ch.charCodeAt(0) < 0x80)) {
    throw new TypeError(`idempotencyKey must be 1 to ${MAX_IDEMPOTENCY_KEY_LENGTH} ASCII characters (pass claim.idempotencyKey)`);
  }
  // Inside claim.send the send carries the claim's stamp (X-Inbox-Claim: its copy in the sent folder, read with its
  // headers, then settles an IN_DOUBT send, docs/providers.md "Sends that settle themselves"); an agent's reply says
  // it is automatic (RFC 3834: machines that honour it do not answer it), a person's never (agentHeaders). Custom
  // headers given are kept, and win over ours of the same name.
  const given = Array.isArray(reply.fields?.["custom_headers"]) ? (reply.fields["custom_headers"] as CustomHeader[]) : [];
  const customHeaders = claimCustomHeaders(given);
  const document: Record<string, unknown> = {
    ...reply.fields,
    ...(customHeaders.length > 0 ? { custom_headers: customHeaders } : {}),
    reply_to_message_id: reply.replyToMessageId,
    to: participants(reply.to, "to"),
    subject: reply.subject,
    body: reply.body,
  };
  if (reply.cc?.length) document["cc"] = participants(reply.cc, "cc");
  if (reply.bcc?.length) document["bcc"] = participants(reply.bcc, "bcc");
  return {
    url: `${apiBase.replace(/\/+$/, "")}/v3/grants/${encodeURIComponent(grantId)}/messages/send`,
    headers: {
      authorization: `Bearer ${apiKey}`,
      "idempotency-key": idempotencyKey,
      "content-type": "application/json",
      accept: "application/json",
    },
    body: JSON.stringify(document),
  };
}

/** The sent message's id from a 2xx answer (undefined when it has none: still sent), or the error for any other. */
export function interpretSendResponse(statusCode: number, text: string): string | undefined {
  let document: Record<string, unknown> = {};
  try {
    const parsed: unknown = text ? JSON.parse(text) : {};
    if (typeof parsed === "object" && parsed !== null && !Array.isArray(parsed)) document = parsed as Record<string, unknown>;
  } catch {
    // an unreadable answer: the status code alone decides
  }
  const requestId = typeof document["request_id"] === "string" ? document["request_id"] : "";
  const error = (typeof document["error"] === "object" && document["error"] !== null ? document["error"] : {}) as Record<string, unknown>;
  const detail = String(error["message"] || text.slice(0, 200)).trim();
  if (statusCode >= 200 && statusCode < 300) {
    const data = document["data"] as Record<string, unknown> | undefined;
    const id = data?.["id"];
    return typeof id === "string" && id ? id : undefined;
  }
  if (statusCode === 409) {
    throw new NylasDuplicateSend(`Nylas answered 409: a send with this idempotency key went out or is in flight (${detail})`, 409, requestId);
  }
  if (statusCode >= 400 && statusCode < 500) {
    throw new NylasSendRejected(`Nylas refused the send (HTTP ${statusCode}): ${detail}`, statusCode, requestId, String(error["type"] ?? ""));
  }
  throw new NylasSendUnknown(`Nylas answered HTTP ${statusCode}; the message may have been sent: ${detail}`, statusCode, requestId);
}

/** The Nylas send adapter: `await claim.send(() => nylas.send(grantId, reply, { idempotencyKey: claim.idempotencyKey }))`. */
export class Nylas {
  readonly apiBase: string;
  readonly timeoutMs: number;

  constructor(
    private readonly apiKey: string,
    options: { apiBase?: string; timeoutMs?: number } = {},
  ) {
    if (!apiKey) throw new TypeError("the Nylas API key is empty");
    this.apiBase = options.apiBase ?? DEFAULT_API_BASE;
    if (!/^https?:\/\//.test(this.apiBase)) throw new TypeError(`apiBase must be an http(s) URL such as ${DEFAULT_API_BASE}, not ${this.apiBase}`);
    this.timeoutMs = options.timeoutMs ?? 60_000;
  }

  /** Sends `reply` from `grantId`; resolves to the sent message id. Throws as the table at the top of this module says. */
  async send(grantId: string, reply: NylasReply, options: { idempotencyKey: string }): Promise<string | undefined> {
    const request = buildSendRequest(this.apiBase, this.apiKey, grantId, reply, options.idempotencyKey);
    let status: number;
    let text: string;
    try {
      // The send's trace context goes with it (Nylas ignores a header it does not know; a proxy may continue it).
      const headers = { ...request.headers, ...traceHeaders() };
      const response = await fetch(request.url, { method: "POST", headers, body: request.body, signal: AbortSignal.timeout(this.timeoutMs) });
      status = response.status;
      text = await response.text();
    } catch (error) {
      const kind = (error as Error).name === "TimeoutError" ? "timed out" : `failed (${(error as Error).name})`;
      throw new NylasSendUnknown(`the Nylas send request ${kind}; the message may have been sent: ${(error as Error).message}`, undefined, "", error);
    }
    return interpretSendResponse(status, text);
  }

  /**
   * The ids of the grant's sent folders (GET /v3/grants/{grantId}/folders, every page: the folders whose
   * `attributes` hold \\Sent), for the Coordinator's `sentFolders` on Microsoft and IMAP grants, whose folder ids
   * are opaque or the server's own names (Google's is always SENT). Throws on an answer other than 2xx.
   */
  async sentFolderIds(grantId: string): Promise<string[]> {
    if (!grantId) throw new TypeError("grantId is empty");
    const ids: string[] = [];
    let cursor = "";
    do {
      const url = new URL(`${this.apiBase.replace(/\/+$/, "")}/v3/grants/${encodeURIComponent(grantId)}/folders`);
      if (cursor) url.searchParams.set("page_token", cursor);
      const response = await fetch(url, { headers: { authorization: `Bearer ${this.apiKey}`, accept: "application/json" }, signal: AbortSignal.timeout(this.timeoutMs) });
      if (!response.ok) throw new Error(`Nylas answered HTTP ${response.status} to the folder list: ${(await response.text()).slice(0, 200)}`);
      const page = sentFoldersIn((await response.json()) as unknown);
      ids.push(...page.ids);
      cursor = page.cursor;
    } while (cursor);
    return ids;
  }
}

/** The attribute Nylas gives a sent folder, on every provider. */
export const SENT_ATTRIBUTE = "\\Sent";

/** From one page of the folder list: the ids of the folders whose attributes hold \\Sent, and the next page's cursor. */
export function sentFoldersIn(document: unknown): { ids: string[]; cursor: string } {
  const record = typeof document === "object" && document !== null ? (document as Record<string, unknown>) : {};
  const data = Array.isArray(record["data"]) ? (record["data"] as unknown[]) : [];
  const ids = data.flatMap((folder) => {
    if (typeof folder !== "object" || folder === null) return [];
    const { id, attributes } = folder as Record<string, unknown>;
    return typeof id === "string" && Array.isArray(attributes) && attributes.includes(SENT_ATTRIBUTE) ? [id] : [];
  });
  return { ids, cursor: typeof record["next_cursor"] === "string" ? record["next_cursor"] : "" };
}
