// AgentMail behind the provider seam (docs/providers.md, "AgentMail"; the vectors: conformance/providers/agentmail).
//
// * Authenticity: AgentMail delivers through Svix: `svix-id`, `svix-timestamp`, `svix-signature` over the raw body,
//   the endpoint's `whsec_...` secret (Standard Webhooks under Svix's header names).
// * The dedup key is the payload's `event_id`, never `svix-id`: AgentMail documents `event_id` as the same on every
//   retry and on every subscription (organisation, pod, inbox webhooks), while `svix-id` differs per webhook, so
//   an agent subscribed twice would otherwise claim each message twice.
// * `message.received` carries the whole message: no read. `message.sent` carries only its ids, so the sent message
//   is read (GET /v0/inboxes/{inbox}/messages/{id}) for its headers: the claim's stamp on our own reply settles an
//   IN_DOUBT send. The `sent` label is the mailbox's sent folder (SENT in the facts).
// * Send: POST /v0/inboxes/{inbox}/messages/{id}/reply with the claim's key as `Idempotency-Key`, the stamp and
//   `Auto-Submitted: auto-replied` in its headers.
import { agentHeaders } from "../current.js";
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

export const DEFAULT_API_BASE = "https://api.agentmail.to";
/** The events whose message is handed to the guard; others (delivered, bounced, opened...) are acknowledged, nothing recorded. */
export const RECEIVED = "message.received";
export const SENT = "message.sent";

/** AgentMail refused the reply (a 4xx other than 409): nothing went out (claim.send aborts: FREE). */
export class AgentMailSendRejected extends SendRejected {
  override name = "AgentMailSendRejected";
}

/** The reply may have gone out (a 409, a 5xx, no answer): SENDING, then IN_DOUBT, until its message.sent settles it. */
export class AgentMailSendOutcomeUnknown extends InboxClaimsError {
  override name = "AgentMailSendOutcomeUnknown";
}

export interface AgentMailProviderOptions {
  /** The AgentMail API key (Authorization: Bearer), to read sent messages and to reply. */
  apiKey: string;
  apiBase?: string;
  /** How far svix-timestamp may be from now, in seconds (default 300). */
  toleranceSeconds?: number;
  /** The inboxes this endpoint answers for (default: every inbox the webhook covers). */
  inboxIds?: readonly string[];
  mailboxAddresses?: readonly string[];
  transport?: Transport;
  /** Unix seconds now (the signature's timestamp is checked against it). */
  clock?: () => number;
}

interface Event {
  eventType: string;
  eventId: string;
  body: Record<string, unknown>;
}

/** AgentMail webhooks, for every inbox the webhook covers (the facts' mailbox is the message's inbox_id). */
export class AgentMailProvider implements Provider {
  readonly name = "agentmail";
  /** Svix waits 15 s for an answer. */
  readonly answerWithinMs = 15_000;
  readonly apiBase: string;
  readonly toleranceSeconds: number;
  readonly mailboxAddresses: readonly string[];
  readonly inboxIds: ReadonlySet<string>;
  private readonly apiKey: string;
  private readonly transport: Transport;
  private readonly clock: () => number;

  constructor(
    readonly secret: string,
    options: AgentMailProviderOptions,
  ) {
    if (!options.apiKey) throw new TypeError("the AgentMail API key is empty (AGENTMAIL_API_KEY)");
    // Throws on an empty or mistyped secret: at start, not on the first request.
    requireSvixSecret(secret, "AgentMail", "AGENTMAIL_WEBHOOK_SECRET");
    this.apiKey = options.apiKey;
    this.apiBase = (options.apiBase ?? DEFAULT_API_BASE).replace(/\/+$/, "");
    this.toleranceSeconds = options.toleranceSeconds ?? 300;
    this.mailboxAddresses = options.mailboxAddresses ?? [];
    this.inboxIds = new Set(options.inboxIds ?? []);
    this.transport = options.transport ?? fetchTransport();
    this.clock = options.clock ?? (() => Date.now() / 1000);
  }

  /** From AGENTMAIL_WEBHOOK_SECRET, AGENTMAIL_API_KEY, AGENTMAIL_API_BASE, AGENTMAIL_INBOX_IDS and INBOX_MAILBOX_ADDRESSES (as Python); `overrides` win. */
  static fromEnv(env: Record<string, string | undefined> = process.env, overrides: Partial<AgentMailProviderOptions> = {}): AgentMailProvider {
    requireEnv(env, ["AGENTMAIL_WEBHOOK_SECRET", "AGENTMAIL_API_KEY"], "AgentMail");
    return new AgentMailProvider(env["AGENTMAIL_WEBHOOK_SECRET"]!, {
      apiKey: env["AGENTMAIL_API_KEY"]!,
      apiBase: env["AGENTMAIL_API_BASE"] || DEFAULT_API_BASE,
      mailboxAddresses: (env["INBOX_MAILBOX_ADDRESSES"] ?? "").split(",").map((a) => a.trim()).filter((a) => a),
      inboxIds: (env["AGENTMAIL_INBOX_IDS"] ?? "").split(",").map((a) => a.trim()).filter((a) => a),
      ...overrides,
    });
  }

  /** From a vector file's settings (conformance/providers/agentmail). */
  static fromSettings(settings: Record<string, unknown>, io: Pick<AgentMailProviderOptions, "transport" | "clock"> = {}): AgentMailProvider {
    return new AgentMailProvider(str(settings.webhook_secret), {
      apiKey: str(settings.api_key),
      apiBase: str(settings.api_base) || DEFAULT_API_BASE,
      mailboxAddresses: (settings.mailbox_addresses as string[] | undefined) ?? [],
      inboxIds: (settings.inbox_ids as string[] | undefined) ?? [],
      ...io,
    });
  }

  async check(request: WebhookRequest): Promise<Answer | Accepted> {
    return this.verify(request);
  }

  /** A refusal (405 method, 401 signature, 400 body) or the event (no I/O). */
  verify(request: WebhookRequest): Answer | Accepted {
    const document = svixChecked(request, "AgentMail", this.secret, this.toleranceSeconds, this.clock());
    if (isAnswer(document)) return document;
    if (!isRecord(document) || !str(document.event_id)) return { status: 400, body: "the event has no event_id: not an AgentMail event" };
    return new Accepted({ eventType: str(document.event_type), eventId: str(document.event_id), body: document } satisfies Event);
  }

  acknowledge(): Answer {
    return { status: 200, body: "ok" };
  }

  async open(accepted: Accepted): Promise<Batch> {
    const event = accepted.delivery as Event;
    if (event.eventType === RECEIVED) {
      const message = event.body.message;
      return batchOf(isRecord(message) && str(message.message_id) && this.answersFor(str(message.inbox_id)) ? [this.facts(message, event.eventId)] : []);
    }
    if (event.eventType === SENT) {
      const send = isRecord(event.body.send) ? event.body.send : {};
      const [inbox, id] = [str(send.inbox_id), str(send.message_id)];
      if (!inbox || !id || !this.answersFor(inbox)) return batchOf();
      const message = await this.read(inbox, id);
      return batchOf(message === undefined ? [] : [this.facts(message, event.eventId)]);
    }
    return batchOf(); // delivered, bounced, opened, ...: nothing to answer or record
  }

  /** Whether this endpoint answers for `inbox` (every inbox when inboxIds is empty). */
  answersFor(inbox: string): boolean {
    return this.inboxIds.size === 0 || this.inboxIds.has(inbox);
  }

  private url(inbox: string, messageId: string, tail = ""): string {
    return `${this.apiBase}/v0/inboxes/${encodeURIComponent(inbox).replaceAll("%40", "@")}/messages/${encodeURIComponent(messageId)}${tail}`;
  }

  private async read(inbox: string, messageId: string): Promise<Record<string, unknown> | undefined> {
    const response = await this.transport({ method: "GET", url: this.url(inbox, messageId), params: [], headers: [bearer(this.apiKey)] });
    if (response.status === 404) return undefined; // deleted before it was read: nothing to record
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`reading AgentMail message ${JSON.stringify(messageId)} answered HTTP ${response.status}`);
    return document;
  }

  /** The facts of an AgentMail message (as the received event and the messages API give it). */
  facts(message: Record<string, unknown>, eventId: string): MessageFacts {
    const [name, address] = splitAddress(str(message.from));
    const labels = Array.isArray(message.labels) ? message.labels.filter((l): l is string => typeof l === "string") : [];
    const replyTo = (Array.isArray(message.reply_to) ? message.reply_to : []).flatMap((r: unknown) => (typeof r === "string" && r ? [splitAddress(r)[1]] : []));
    const headers = message.headers;
    const ownId = headerIn(headers, "Message-ID") ?? (/^<[^<>]+>$/.test(str(message.message_id)) ? str(message.message_id) : undefined);
    const references = Array.isArray(message.references) ? message.references.filter((r): r is string => typeof r === "string") : messageIds(headerIn(headers, "References"));
    const subject = str(message.subject);
    return {
      provider: this.name,
      event: "message.created",
      mailbox: str(message.inbox_id),
      dedupKey: eventId,
      messageId: str(message.message_id),
      threadId: str(message.thread_id) || undefined,
      receivedAt: isoDate(message.timestamp),
      sender: display(name, address),
      subjectLine: subject,
      fromAddresses: address ? [address] : [],
      folders: labels.includes("sent") ? [...labels, "SENT"] : labels,
      outgoing: undefined,
      automated: undefined,
      stamp: parseStamp(headerIn(headers, STAMP_HEADER)),
      reply: { to: replyTo.length > 0 ? replyTo : address ? [address] : [], subject: replySubject(subject), internetMessageId: ownId, references },
      source: message,
    };
  }

  /**
   * The reply, for claim.send: `claim.send(() => agentmail.reply(message, { body, stamp: claim.stamp }))`: AgentMail's
   * reply endpoint (it threads the reply: In-Reply-To, References), with the claim's key as Idempotency-Key and the
   * stamp in X-Inbox-Claim; resolves to the sent message's id. Throws as keyedSend says.
   */
  async reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp; html?: string }): Promise<string | undefined> {
    if (options.stamp === undefined) throw new TypeError("reply needs the claim's stamp: agentmail.reply(message, { body, stamp: claim.stamp })");
    const json = {
      text: options.body,
      ...(options.html === undefined ? {} : { html: options.html }),
      headers: { [STAMP_HEADER]: formatStamp(options.stamp), ...Object.fromEntries(agentHeaders()) },
    };
    const request = { method: "POST", url: this.url(message.mailbox, message.messageId, "/reply"), params: [], headers: [bearer(this.apiKey), ["Idempotency-Key", options.stamp.key] as const], json };
    return keyedSend(this.transport, request, "AgentMail's reply", (document) => document.message_id, { rejected: AgentMailSendRejected, unknown: AgentMailSendOutcomeUnknown });
  }
}
