// Resend inbound behind the provider seam (docs/providers.md, "Resend"; the vectors: conformance/providers/resend).
//
// * Authenticity: Resend delivers through Svix (`svix-id`, `svix-timestamp`, `svix-signature`, a `whsec_...` secret).
// * The dedup key is `svix-id`: Resend's payload has no event id of its own, and Svix keeps the id on every retry of
//   a message to an endpoint.
// * `email.received` carries metadata only: the email (its headers, its text) is read from the received-emails API
//   (GET /emails/receiving/{email_id}). Resend has no threads: the thread is named after the conversation's first
//   Message-ID (the first of References, else In-Reply-To, else the message's own), hashed so that it fits a tag.
// * `email.sent` is outgoing (SENT): the agent's reply carries its claim's stamp and thread as tags, which Resend's
//   events repeat, so that the sent event of an IN_DOUBT send settles it.
// * Send: POST /emails with the claim's key as `Idempotency-Key`; In-Reply-To and References thread it, the stamp
//   (X-Inbox-Claim) and `Auto-Submitted: auto-replied` go in its headers.
import { agentHeaders } from "../current.js";
import { createHash } from "node:crypto";
import { InboxClaimsError, SendRejected } from "../errors.js";
import {
  Accepted,
  batchOf,
  bearer,
  display,
  fetchTransport,
  formatStamp,
  headerIn,
  isAnswer,
  isoDate,
  isRecord,
  jsonOf,
  keyedSend,
  messageIds,
  parseStamp,
  ProviderError,
  replySubject,
  requireEnv,
  requireSvixSecret,
  splitAddress,
  STAMP_HEADER,
  str,
  svixChecked,
  type Answer,
  type Batch,
  type ClaimStamp,
  type MessageFacts,
  type Provider,
  type Transport,
  type WebhookRequest,
} from "./seam.js";

export const DEFAULT_API_BASE = "https://api.resend.com";
export const RECEIVED = "email.received";
export const SENT = "email.sent";
/** The tags the agent's reply carries (Resend allows letters, digits, `_` and `-` in a tag): the stamp as `<key>_<token>`, and the thread. */
export const TAG_STAMP = "inbox_claim";
export const TAG_THREAD = "inbox_thread";

/** Resend refused the send (a 4xx other than 409): nothing went out (claim.send aborts: FREE). */
export class ResendSendRejected extends SendRejected {
  override name = "ResendSendRejected";
}

/** The send may have gone out (a 409, a 5xx, no answer): SENDING, then IN_DOUBT, until its email.sent settles it. */
export class ResendSendOutcomeUnknown extends InboxClaimsError {
  override name = "ResendSendOutcomeUnknown";
}

/** The thread of a message: `rt-` and the first 40 hex digits of the SHA-256 of the conversation's first Message-ID. */
export function threadOf(ownId: string | undefined, inReplyTo: string | undefined, references: readonly string[]): string | undefined {
  const root = references[0] ?? messageIds(inReplyTo)[0] ?? ownId;
  return root ? "rt-" + createHash("sha256").update(root.trim()).digest("hex").slice(0, 40) : undefined;
}

/** Tags as Resend's events give them: an object, or a list of {name, value}. */
function tagsOf(value: unknown): Record<string, string> {
  if (Array.isArray(value)) return Object.fromEntries(value.flatMap((t: unknown) => (isRecord(t) && typeof t.name === "string" && typeof t.value === "string" ? [[t.name, t.value]] : [])));
  return isRecord(value) ? Object.fromEntries(Object.entries(value).filter((e): e is [string, string] => typeof e[1] === "string")) : {};
}

function addresses(value: unknown): string[] {
  const list = Array.isArray(value) ? value : typeof value === "string" ? [value] : [];
  return list.flatMap((item: unknown) => (typeof item === "string" && item ? [splitAddress(item)[1]] : []));
}

export interface ResendProviderOptions {
  /** The Resend API key (Authorization: Bearer), to read received emails and to send. */
  apiKey: string;
  apiBase?: string;
  /** The reply's From (`Name <address>` or an address); default: the mailbox, when it is an address. */
  from?: string;
  toleranceSeconds?: number;
  mailboxAddresses?: readonly string[];
  transport?: Transport;
  clock?: () => number;
}

interface Delivery {
  id: string;
  type: string;
  data: Record<string, unknown>;
}

/** Resend inbound for one mailbox (`mailbox`: the name agents coordinate on, e.g. the receiving address). */
export class ResendProvider implements Provider {
  readonly name = "resend";
  readonly answerWithinMs = 15_000;
  readonly apiBase: string;
  readonly from: string;
  readonly toleranceSeconds: number;
  readonly mailboxAddresses: readonly string[];
  private readonly apiKey: string;
  private readonly transport: Transport;
  private readonly clock: () => number;

  constructor(
    readonly secret: string,
    readonly mailbox: string,
    options: ResendProviderOptions,
  ) {
    if (!options.apiKey) throw new TypeError("the Resend API key is empty (RESEND_API_KEY)");
    if (!mailbox) throw new TypeError("mailbox is empty: the receiving address agents coordinate on (RESEND_MAILBOX)");
    requireSvixSecret(secret, "Resend", "RESEND_WEBHOOK_SECRET");
    this.apiKey = options.apiKey;
    this.apiBase = (options.apiBase ?? DEFAULT_API_BASE).replace(/\/+$/, "");
    this.from = options.from ?? (mailbox.includes("@") ? mailbox : "");
    if (!this.from.includes("@")) throw new TypeError("from is not an address: the replies' From (RESEND_FROM)");
    this.toleranceSeconds = options.toleranceSeconds ?? 300;
    this.mailboxAddresses = [...(options.mailboxAddresses ?? []), splitAddress(this.from)[1]];
    this.transport = options.transport ?? fetchTransport();
    this.clock = options.clock ?? (() => Date.now() / 1000);
  }

  /** From RESEND_WEBHOOK_SECRET, RESEND_MAILBOX, RESEND_API_KEY, RESEND_FROM, RESEND_API_BASE, INBOX_MAILBOX_ADDRESSES. */
  static fromEnv(env: Record<string, string | undefined> = process.env, overrides: Partial<ResendProviderOptions> = {}): ResendProvider {
    requireEnv(env, ["RESEND_WEBHOOK_SECRET", "RESEND_MAILBOX", "RESEND_API_KEY"], "Resend");
    return new ResendProvider(env["RESEND_WEBHOOK_SECRET"]!, env["RESEND_MAILBOX"]!, {
      apiKey: env["RESEND_API_KEY"]!,
      apiBase: env["RESEND_API_BASE"] || DEFAULT_API_BASE,
      ...(env["RESEND_FROM"] ? { from: env["RESEND_FROM"] } : {}),
      mailboxAddresses: (env["INBOX_MAILBOX_ADDRESSES"] ?? "").split(",").map((a) => a.trim()).filter((a) => a),
      ...overrides,
    });
  }

  /** From a vector file's settings (conformance/providers/resend). */
  static fromSettings(settings: Record<string, unknown>, io: Pick<ResendProviderOptions, "transport" | "clock"> = {}): ResendProvider {
    return new ResendProvider(str(settings.webhook_secret), str(settings.mailbox), {
      apiKey: str(settings.api_key),
      apiBase: str(settings.api_base) || DEFAULT_API_BASE,
      ...(str(settings.sender) ? { from: str(settings.sender) } : {}),
      mailboxAddresses: (settings.mailbox_addresses as string[] | undefined) ?? [],
      ...io,
    });
  }

  async check(request: WebhookRequest): Promise<Answer | Accepted> {
    return this.verify(request);
  }

  /** A refusal (405 method, 401 signature, 400 body) or the event (no I/O). */
  verify(request: WebhookRequest): Answer | Accepted {
    const document = svixChecked(request, "Resend", this.secret, this.toleranceSeconds, this.clock());
    if (isAnswer(document)) return document;
    if (!isRecord(document) || !str(document.type) || !isRecord(document.data)) return { status: 400, body: "the event has no type and data: not a Resend event" };
    const id = request.headers["svix-id"] ?? request.headers["webhook-id"] ?? "";
    return new Accepted({ id, type: str(document.type), data: document.data } satisfies Delivery);
  }

  acknowledge(): Answer {
    return { status: 200, body: "ok" };
  }

  async open(accepted: Accepted): Promise<Batch> {
    const { id, type, data } = accepted.delivery as Delivery;
    if (type === RECEIVED && str(data.email_id)) {
      const email = await this.read(str(data.email_id));
      return batchOf(email === undefined ? [] : [this.receivedFacts(email, id)]);
    }
    if (type === SENT && str(data.email_id)) return batchOf([this.sentFacts(data, id)]);
    return batchOf(); // delivered, bounced, opened, ...: nothing to answer or record
  }

  private async read(emailId: string): Promise<Record<string, unknown> | undefined> {
    const url = `${this.apiBase}/emails/receiving/${encodeURIComponent(emailId)}`;
    const response = await this.transport({ method: "GET", url, params: [], headers: [bearer(this.apiKey)] });
    if (response.status === 404) return undefined; // gone before it was read: nothing to answer
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`reading received email ${JSON.stringify(emailId)} answered HTTP ${response.status}`);
    return document;
  }

  /** The facts of a received email (GET /emails/receiving/{id}). */
  receivedFacts(email: Record<string, unknown>, dedupKey: string): MessageFacts {
    const [name, address] = splitAddress(str(email.from));
    const headers = email.headers;
    const ownId = str(email.message_id) || headerIn(headers, "Message-ID") || undefined;
    const references = messageIds(headerIn(headers, "References"));
    const replyTo = addresses(email.reply_to);
    const subject = str(email.subject);
    return {
      provider: this.name,
      event: "message.created",
      mailbox: this.mailbox,
      dedupKey,
      messageId: str(email.id),
      threadId: threadOf(ownId, headerIn(headers, "In-Reply-To"), references),
      receivedAt: isoDate(email.created_at),
      sender: display(name, address),
      subjectLine: subject,
      fromAddresses: address ? [address] : [],
      folders: [],
      outgoing: undefined,
      automated: undefined,
      stamp: parseStamp(headerIn(headers, STAMP_HEADER)),
      reply: { to: replyTo.length > 0 ? replyTo : address ? [address] : [], subject: replySubject(subject), internetMessageId: ownId, references },
      source: email,
    };
  }

  /** The facts of an email.sent event's data: in the sent mail, its stamp and thread from the tags the reply set. */
  sentFacts(data: Record<string, unknown>, dedupKey: string): MessageFacts {
    const [name, address] = splitAddress(str(data.from));
    const tags = tagsOf(data.tags);
    const subject = str(data.subject);
    return {
      provider: this.name,
      event: "message.created",
      mailbox: this.mailbox,
      dedupKey,
      messageId: str(data.email_id),
      threadId: tags[TAG_THREAD] || undefined,
      receivedAt: isoDate(data.created_at),
      sender: display(name, address),
      subjectLine: subject,
      fromAddresses: address ? [address] : [],
      folders: ["SENT"],
      outgoing: undefined,
      automated: undefined,
      stamp: parseStamp(tags[TAG_STAMP]?.replace(/_(\d+)$/, ".$1")),
      reply: { to: addresses(data.to), subject: replySubject(subject), internetMessageId: undefined, references: [] },
      source: data,
    };
  }

  /**
   * The reply, for claim.send: `claim.send(() => resend.reply(message, { body, stamp: claim.stamp }))`: POST /emails
   * to the sender, in the thread (In-Reply-To, References), with the claim's key as Idempotency-Key and its stamp and
   * thread as tags; resolves to the sent email's id. Throws as keyedSend says.
   */
  async reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp; html?: string }): Promise<string | undefined> {
    if (options.stamp === undefined) throw new TypeError("reply needs the claim's stamp: resend.reply(message, { body, stamp: claim.stamp })");
    if (message.reply.to.length === 0) throw new TypeError(`message ${JSON.stringify(message.messageId)} has no sender address to reply to`);
    const { internetMessageId, references } = message.reply;
    const headers: Record<string, string> = { [STAMP_HEADER]: formatStamp(options.stamp), ...Object.fromEntries(agentHeaders()) };
    if (internetMessageId) {
      headers["In-Reply-To"] = internetMessageId;
      headers["References"] = [...references, internetMessageId].join(" ");
    }
    const tags = [
      { name: TAG_STAMP, value: `${options.stamp.key}_${options.stamp.token}` },
      ...(message.threadId ? [{ name: TAG_THREAD, value: message.threadId }] : []),
    ];
    const json = { from: this.from, to: [...message.reply.to], subject: message.reply.subject, text: options.body, ...(options.html === undefined ? {} : { html: options.html }), headers, tags };
    const request = { method: "POST", url: `${this.apiBase}/emails`, params: [], headers: [bearer(this.apiKey), ["Idempotency-Key", options.stamp.key] as const], json };
    return keyedSend(this.transport, request, "Resend's send", (document) => document.id, { rejected: ResendSendRejected, unknown: ResendSendOutcomeUnknown });
  }
}
