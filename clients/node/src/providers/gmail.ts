// Gmail behind the provider seam: Cloud Pub/Sub push in, messages.send out (docs/providers.md, "Gmail"; the vectors:
// conformance/providers/gmail), the Python client's inbox_claims.providers.gmail.
//
// * Authenticity: the push's OIDC token (Authorization: Bearer), RS256 by a key of Google's JWKS (the URL is a
//   setting, so that a test double signs with its own key), issuer Google, the configured audience, not expired;
//   checked with node:crypto (no JWT library: the few rules are below, each one refusing).
// * A push holds no message, only {emailAddress, historyId}: the worker takes a range of the mailbox's gmail-history
//   cursor in the coordinator, reads the history since it (messageAdded), reads each message and hands the batch
//   back; the cursor advances only once every message was recorded (docs/design.md#cursors).
// * A history id too old (404): a bounded resync of the last day's messages, the cursor set to the profile's.
// * Send: a raw RFC 2822 reply with threadId, In-Reply-To and References, stamped with the claim, marked
//   Auto-Submitted: auto-replied (an agent's reply, RFC 3834: machines that honour it leave it).
// * Automated mail: the rules' headers are among those a message is read with (no request more).
// * The look before a send: the thread (threads.get, format=metadata), its messages after the claim's (one request).
import { createPublicKey, verify, type KeyObject } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { judgeAutomated } from "../automated.js";
import { InboxClaimsError, SendRejected } from "../errors.js";
import {
  Accepted,
  batchOf,
  bearer,
  fetchTransport,
  header,
  isRecord,
  jsonOf,
  messageIds,
  parseStamp,
  ProviderError,
  replyMime,
  replySubject,
  requireEnv,
  splitAddress,
  STAMP_HEADER,
  stampMessageId,
  str,
  type Answer,
  type Batch,
  type ClaimStamp,
  type CursorRange,
  type Cursors,
  type HttpRequest,
  type HttpResponse,
  type MessageFacts,
  type Provider,
  type Transport,
  type WebhookRequest,
} from "./seam.js";

export const DEFAULT_API_BASE = "https://gmail.googleapis.com";
export const DEFAULT_JWKS_URL = "https://www.googleapis.com/oauth2/v3/certs";
const ISSUERS = new Set(["https://accounts.google.com", "accounts.google.com"]);
/** The mailbox's cursor in the coordinator: the last history id processed. */
export const CURSOR = "gmail-history";
const RANGE_TTL = 60;
/** The headers a message is read with (format=metadata). */
export const METADATA_HEADERS = [
  "From",
  "To",
  "Subject",
  "Date",
  "Message-ID",
  "References",
  "In-Reply-To",
  "Reply-To",
  STAMP_HEADER,
  // The automated-mail rules' (src/automated.ts).
  "Auto-Submitted",
  "Precedence",
  "List-Id",
  "List-Unsubscribe",
  "X-Autoreply",
  "X-Autorespond",
  "X-Auto-Response-Suppress",
  "Content-Type",
];
/** The bounded resync after a 404: the last day's messages, at most this many. */
export const RESYNC_QUERY = "newer_than:1d";
export const RESYNC_MAX = 500;
const JWKS_REFRESH_S = 60;
/** How often the webhook adapters run the periodic history check (what a dropped push would have said). */
export const DEFAULT_HISTORY_CHECK_MS = 60_000;
/** The periodic check's "push": through position 0, which no cursor covers (a push's history id is positive). */
const PERIODIC = 0n;
// A range another worker holds: look again this often, this many times, then ask Pub/Sub to deliver again.
const BUSY_WAIT_MS = 250;
const BUSY_LOOKS = 16;

/** Gmail refused the send: nothing went out (claim.send aborts: FREE). */
export class GmailSendRejected extends SendRejected {
  override name = "GmailSendRejected";
}

/** The send may have gone out (a 5xx, a timeout): SENDING, then IN_DOUBT until its stamped SENT copy settles it, or a person does. */
export class GmailSendOutcomeUnknown extends InboxClaimsError {
  override name = "GmailSendOutcomeUnknown";
}

export interface GmailProviderOptions {
  /** An access token for the Gmail API, or a function that gives the current one. */
  token: string | (() => string);
  apiBase?: string;
  /** Where Google's public keys are (a test points it at its own). */
  jwksUrl?: string;
  /** When set, the `email` the push's token must carry (the push subscription's service account). */
  serviceAccount?: string;
  mailboxAddresses?: readonly string[];
  transport?: Transport;
  /** Unix seconds now (the token's expiry is checked on it). */
  clock?: () => number;
  /** Milliseconds between the periodic history checks the webhook adapters run (default 60 000; 0: none). */
  historyCheckIntervalMs?: number;
}

const base64url = (text: string): Buffer => Buffer.from(text, "base64url");

/** Gmail's Pub/Sub push for one mailbox (`user`: its address, the mailbox the claims are in). */
export class GmailProvider implements Provider {
  readonly name = "gmail";
  /** Pub/Sub's push acknowledgement deadline is 10 s by default. */
  readonly answerWithinMs = 10_000;
  readonly apiBase: string;
  readonly jwksUrl: string;
  readonly serviceAccount: string;
  readonly mailboxAddresses: readonly string[];
  /** Milliseconds between the periodic history checks the webhook adapters run; 0: none. */
  readonly periodicIntervalMs: number;
  private readonly token: string | (() => string);
  private readonly transport: Transport;
  private readonly clock: () => number;
  private keys = new Map<string, KeyObject>();
  private keysAt = Number.NEGATIVE_INFINITY;

  constructor(
    readonly audience: string,
    readonly user: string,
    options: GmailProviderOptions,
  ) {
    if (!audience) throw new TypeError("audience is empty: the audience of the push subscription's OIDC token");
    if (!user.includes("@")) throw new TypeError(`user must be the mailbox's address, not ${JSON.stringify(user)}`);
    this.token = options.token;
    this.apiBase = (options.apiBase ?? DEFAULT_API_BASE).replace(/\/+$/, "");
    this.jwksUrl = options.jwksUrl ?? DEFAULT_JWKS_URL;
    this.serviceAccount = options.serviceAccount ?? "";
    this.mailboxAddresses = [user, ...(options.mailboxAddresses ?? [])];
    this.transport = options.transport ?? fetchTransport();
    this.clock = options.clock ?? (() => Date.now() / 1000);
    this.periodicIntervalMs = options.historyCheckIntervalMs ?? DEFAULT_HISTORY_CHECK_MS;
    if (!(this.periodicIntervalMs >= 0)) throw new RangeError(`historyCheckIntervalMs must be 0 (off) or milliseconds, not ${this.periodicIntervalMs}`);
  }

  /**
   * From GMAIL_PUSH_AUDIENCE, GMAIL_USER, GMAIL_TOKEN, GMAIL_API_BASE (default https://gmail.googleapis.com),
   * GMAIL_JWKS_URL, GMAIL_PUSH_SERVICE_ACCOUNT and GMAIL_HISTORY_CHECK_SECONDS (default 60; 0 turns the periodic
   * history check off); `overrides` win.
   */
  static fromEnv(env: Record<string, string | undefined> = process.env, overrides: Partial<GmailProviderOptions> = {}): GmailProvider {
    requireEnv(env, ["GMAIL_PUSH_AUDIENCE", "GMAIL_USER", "GMAIL_TOKEN"], "Gmail");
    const interval = (env["GMAIL_HISTORY_CHECK_SECONDS"] ?? "").trim();
    if (interval && !(Number(interval) >= 0)) throw new TypeError(`GMAIL_HISTORY_CHECK_SECONDS must be a number of seconds, not ${JSON.stringify(interval)}`);
    return new GmailProvider(env["GMAIL_PUSH_AUDIENCE"]!, env["GMAIL_USER"]!, {
      token: env["GMAIL_TOKEN"]!,
      apiBase: env["GMAIL_API_BASE"] || DEFAULT_API_BASE,
      jwksUrl: env["GMAIL_JWKS_URL"] || DEFAULT_JWKS_URL,
      serviceAccount: env["GMAIL_PUSH_SERVICE_ACCOUNT"] ?? "",
      ...(interval ? { historyCheckIntervalMs: Number(interval) * 1000 } : {}),
      ...overrides,
    });
  }

  /** From a vector file's settings (conformance/providers/gmail). */
  static fromSettings(settings: Record<string, unknown>, io: Pick<GmailProviderOptions, "transport" | "clock"> = {}): GmailProvider {
    return new GmailProvider(str(settings.audience), str(settings.user), {
      token: str(settings.token),
      apiBase: str(settings.api_base),
      jwksUrl: str(settings.jwks_url),
      serviceAccount: str(settings.service_account),
      ...io,
    });
  }

  private api(method: string, path: string, params: [string, string][] = [], json?: unknown): HttpRequest {
    return { method, url: `${this.apiBase}/gmail/v1/users/me/${path}`, params, headers: [bearer(this.token)], json };
  }

  // -- check ------------------------------------------------------------------------------------------------

  async check(request: WebhookRequest): Promise<Answer | Accepted> {
    if (request.method !== "POST") return { status: 405, body: "Pub/Sub posts its pushes", headers: { allow: "POST" } };
    const authorization = request.headers["authorization"] ?? "";
    const token = authorization.startsWith("Bearer ") ? authorization.slice(7).trim() : "";
    if (!token) return { status: 401, body: "no OIDC token (Authorization: Bearer): refused, nothing recorded" };
    const refusal = await this.refusalOf(token);
    if (refusal !== undefined) return { status: 401, body: `the push's token is refused: ${refusal}` };
    let email: unknown, history: bigint;
    try {
      const document = JSON.parse(request.body.toString("utf8")) as { message: { data: string } };
      const push = JSON.parse(Buffer.from(document.message.data, "base64").toString("utf8")) as Record<string, unknown>;
      email = push.emailAddress;
      const id = push.historyId;
      if (!((typeof id === "string" && /^\s*\d+\s*$/.test(id)) || (typeof id === "number" && Number.isSafeInteger(id)))) throw new TypeError("historyId");
      history = BigInt(String(id).trim());
    } catch {
      return { status: 400, body: "not a Gmail push: message.data is not base64 of {emailAddress, historyId}" };
    }
    if (typeof email !== "string" || email.toLowerCase() !== this.user.toLowerCase()) {
      return { status: 403, body: `a push for ${JSON.stringify(email)}, not for this endpoint's mailbox: refused, nothing recorded` };
    }
    return new Accepted(history);
  }

  /** Undefined when the token is Google's, for this audience, current; else why not. */
  private async refusalOf(token: string): Promise<string | undefined> {
    const parts = token.split(".");
    let head: Record<string, unknown>, claims: Record<string, unknown>;
    try {
      if (parts.length !== 3) throw new TypeError("not three parts");
      head = JSON.parse(base64url(parts[0]!).toString("utf8")) as Record<string, unknown>;
      claims = JSON.parse(base64url(parts[1]!).toString("utf8")) as Record<string, unknown>;
      if (!isRecord(head) || !isRecord(claims)) throw new TypeError("not JSON objects");
    } catch (error) {
      return `not a JWT (${(error as Error).message})`;
    }
    const kid = typeof head.kid === "string" ? head.kid : undefined;
    let key = kid === undefined ? undefined : this.keys.get(kid);
    if (key === undefined && this.clock() - this.keysAt >= JWKS_REFRESH_S) {
      await this.fetchKeys();
      key = kid === undefined ? undefined : this.keys.get(kid);
    }
    if (key === undefined) return `signed by an unknown key (${JSON.stringify(kid ?? null)})`;
    if (head.alg !== "RS256") return `signed with ${JSON.stringify(head.alg)}, not RS256`;
    if (!verify("RSA-SHA256", Buffer.from(`${parts[0]}.${parts[1]}`), key, base64url(parts[2]!))) return "the signature does not match (forged, or another key's)";
    const audiences = Array.isArray(claims.aud) ? claims.aud : [claims.aud];
    if (!audiences.includes(this.audience)) return `for the audience ${JSON.stringify(claims.aud ?? null)}, not this endpoint's`;
    if (typeof claims.exp !== "number" || claims.exp <= this.clock()) return "expired";
    if (typeof claims.iss !== "string" || !ISSUERS.has(claims.iss)) return `issuer ${JSON.stringify(claims.iss ?? null)} is not Google's`;
    if (claims.email_verified !== true) return "its email is not verified";
    if (this.serviceAccount && claims.email !== this.serviceAccount) return `from ${JSON.stringify(claims.email ?? null)}, not the configured service account`;
    return undefined;
  }

  private async fetchKeys(): Promise<void> {
    const response = await this.transport({ method: "GET", url: this.jwksUrl, params: [], headers: [] });
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`Google's keys (${this.jwksUrl}) answered HTTP ${response.status}`);
    const keys = new Map<string, KeyObject>();
    for (const entry of Array.isArray(document.keys) ? document.keys : []) {
      if (!isRecord(entry) || entry.kty !== "RSA" || typeof entry.kid !== "string") continue;
      try {
        keys.set(entry.kid, createPublicKey({ key: { kty: "RSA", n: str(entry.n), e: str(entry.e) }, format: "jwk" }));
      } catch {
        // a key this client cannot read is no key of Google's it will check against
      }
    }
    this.keys = keys;
    this.keysAt = this.clock();
  }

  acknowledge(): Answer {
    return { status: 200, body: "ok" };
  }

  /**
   * What the periodic history check opens: a push that reaches everything, i.e. what a dropped push would have
   * said. The webhook adapters run it every `periodicIntervalMs`.
   */
  periodic(): Accepted {
    return new Accepted(PERIODIC);
  }

  // -- open -------------------------------------------------------------------------------------------------

  async open(accepted: Accepted, cursors: Cursors): Promise<Batch> {
    const through = accepted.delivery as bigint;
    let range: CursorRange | undefined;
    for (let look = 0; look < BUSY_LOOKS; look++) {
      range = await cursors.take(this.user, CURSOR, through, RANGE_TTL);
      if (range.outcome !== "BUSY") break;
      if (through === PERIODIC) return batchOf(); // another worker reads the history now: what the check would find, it records
      await sleep(BUSY_WAIT_MS); // another worker reads this history now: what it records may cover ours
    }
    if (range === undefined || range.outcome === "BUSY") throw new ProviderError("another worker held the mailbox's history range too long");
    if (range.outcome === "COVERED") return batchOf();
    const taken = range;
    // The cursor too old, or never set: a bounded resync.
    const { ids, end } = (await this.history(taken)) ?? (await this.resync());
    const facts: MessageFacts[] = [];
    for (const id of ids) {
      const message = await this.message(id);
      if (message !== undefined) facts.push(this.facts(message));
    }
    return batchOf(facts, {
      commit: async () => void (await cursors.advance(this.user, CURSOR, taken, String(end), end > taken.position ? end : taken.position)),
      abandon: async () => void (await cursors.advance(this.user, CURSOR, taken, taken.value, taken.position)),
    });
  }

  private async history(range: CursorRange): Promise<{ ids: string[]; end: bigint } | undefined> {
    if (!range.value) return undefined;
    const ids: string[] = [];
    let page = "";
    for (;;) {
      const params: [string, string][] = [["startHistoryId", range.value], ["historyTypes", "messageAdded"]];
      if (page) params.push(["pageToken", page]);
      const response = await this.transport(this.api("GET", "history", params));
      if (response.status === 404) return undefined;
      const document = jsonOf(response);
      if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`history.list answered HTTP ${response.status}`);
      for (const record of Array.isArray(document.history) ? document.history : []) {
        for (const added of isRecord(record) && Array.isArray(record.messagesAdded) ? record.messagesAdded : []) {
          const id = isRecord(added) && isRecord(added.message) ? added.message.id : undefined;
          if (typeof id === "string" && !ids.includes(id)) ids.push(id);
        }
      }
      page = str(document.nextPageToken);
      if (!page) return { ids, end: document.historyId ? BigInt(String(document.historyId)) : range.position };
    }
  }

  private async resync(): Promise<{ ids: string[]; end: bigint }> {
    const profile = await this.transport(this.api("GET", "profile"));
    const document = jsonOf(profile);
    if (profile.status !== 200 || !isRecord(document)) throw new ProviderError(`getProfile answered HTTP ${profile.status}`);
    const end = BigInt(String(document.historyId));
    const listed = await this.transport(this.api("GET", "messages", [["q", RESYNC_QUERY], ["maxResults", String(RESYNC_MAX)]]));
    const page = jsonOf(listed);
    if (listed.status !== 200 || !isRecord(page)) throw new ProviderError(`messages.list answered HTTP ${listed.status}`);
    const ids = (Array.isArray(page.messages) ? page.messages : []).flatMap((m: unknown) => (isRecord(m) && typeof m.id === "string" ? [m.id] : []));
    return { ids, end };
  }

  /**
   * The messages of `message`'s thread received after it (threads.get with format=metadata, one request), for the
   * look before a send.
   */
  async since(message: MessageFacts): Promise<MessageFacts[]> {
    if (!message.threadId || message.receivedAt === undefined) return [];
    const response = await this.transport(this.api("GET", `threads/${encodeURIComponent(message.threadId)}`, metadataParams()));
    if (response.status === 404) return []; // the thread is gone: nothing newer in it
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`threads.get ${JSON.stringify(message.threadId)} answered HTTP ${response.status}`);
    const after = message.receivedAt.getTime();
    return (Array.isArray(document.messages) ? document.messages : [])
      .filter(isRecord)
      .map((found) => this.facts(found))
      .filter((facts) => facts.messageId !== message.messageId && facts.receivedAt !== undefined && facts.receivedAt.getTime() > after);
  }

  private async message(id: string): Promise<Record<string, unknown> | undefined> {
    const params = metadataParams();
    const response = await this.transport(this.api("GET", `messages/${id}`, params));
    if (response.status === 404) return undefined; // deleted since the history named it
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`messages.get ${JSON.stringify(id)} answered HTTP ${response.status}`);
    return document;
  }

  /** The facts of a Gmail message (as read with format=metadata). */
  facts(message: Record<string, unknown>): MessageFacts {
    const headers = isRecord(message.payload) ? message.payload.headers : undefined;
    const [name, address] = splitAddress(header(headers, "From") ?? "");
    const replyTo = header(headers, "Reply-To");
    const subject = header(headers, "Subject") ?? "";
    const internal = message.internalDate;
    const id = String(message.id);
    return {
      provider: this.name,
      event: "message.created",
      mailbox: this.user,
      dedupKey: id,
      messageId: id,
      threadId: str(message.threadId) || undefined,
      receivedAt: typeof internal === "string" || typeof internal === "number" ? new Date(Number(internal)) : undefined,
      sender: name && address ? `${name} <${address}>` : name || address,
      subjectLine: subject,
      fromAddresses: address ? [address] : [],
      folders: Array.isArray(message.labelIds) ? message.labelIds.filter((label): label is string => typeof label === "string") : [],
      outgoing: undefined,
      automated: judgeAutomated(Array.isArray(headers) ? (headers as { name: string; value: string }[]) : undefined, address, isRecord(message.payload) ? str(message.payload.mimeType) || undefined : undefined),
      stamp: parseStamp(header(headers, STAMP_HEADER)),
      reply: {
        to: replyTo ? [splitAddress(replyTo)[1]] : address ? [address] : [],
        subject: replySubject(subject),
        internetMessageId: header(headers, "Message-ID"),
        references: messageIds(header(headers, "References")),
      },
      source: message,
    };
  }

  // -- send -------------------------------------------------------------------------------------------------

  /** The RFC 2822 reply (replyMime): From the mailbox, a Message-ID from the stamp, To the sender, threaded, stamped, marked. */
  rawReply(message: MessageFacts, body: string, stamp: ClaimStamp): Buffer {
    return replyMime(message, body, stamp, [
      ["From", this.user],
      ["Message-ID", stampMessageId(stamp, this.user.split("@").pop()!)],
    ]);
  }

  /**
   * The reply, for claim.send: `claim.send(() => gmail.reply(message, { body, stamp: claim.stamp }))`: a raw reply in
   * the message's thread, stamped with the claim; resolves to the sent message's id (its SENT copy's). A 4xx is a
   * GmailSendRejected (nothing went out); a 5xx or no answer, a GmailSendOutcomeUnknown.
   */
  async reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp }): Promise<string> {
    if (options.stamp === undefined) throw new TypeError("reply needs the claim's stamp: gmail.reply(message, { body, stamp: claim.stamp })");
    const document: Record<string, unknown> = { raw: this.rawReply(message, options.body, options.stamp).toString("base64url") };
    if (message.threadId) document.threadId = message.threadId;
    let sent: HttpResponse;
    try {
      sent = await this.transport(this.api("POST", "messages/send", [], document));
    } catch (error) {
      throw new GmailSendOutcomeUnknown(`the send may have gone out: ${(error as Error).message}`, { cause: error });
    }
    const answer = jsonOf(sent);
    if (sent.status === 200 && isRecord(answer) && typeof answer.id === "string") return answer.id;
    if (sent.status >= 400 && sent.status < 500) throw new GmailSendRejected(`Gmail refused the send (HTTP ${sent.status}); nothing was sent`);
    throw new GmailSendOutcomeUnknown(`Gmail answered HTTP ${sent.status} to the send: it may have gone out`);
  }
}

/** A message's read (format=metadata) with the headers the facts need. */
function metadataParams(): [string, string][] {
  return [["format", "metadata"], ...METADATA_HEADERS.map((name): [string, string] => ["metadataHeaders", name])];
}
