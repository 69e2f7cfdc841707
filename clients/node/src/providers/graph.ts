// Microsoft 365 behind the provider seam: Graph change notifications in, createReply + send out (docs/providers.md,
// "Microsoft 365"; the vectors: conformance/providers/graph), the Python client's inbox_claims.providers.graph.
//
// * The handshake: ?validationToken= is echoed, decoded, as text/plain (on the notification and lifecycle URLs).
// * Authenticity: every notification of the POST carries the subscription's clientState, compared in constant time.
// * A notification only names the message: it is read (immutable ids), and the dedup key is `<id>@<change key>`.
// * Lifecycle: reauthorizationRequired renews, subscriptionRemoved subscribes again, missed reads the Inbox and Sent
//   Items by delta query from the delta links the coordinator keeps as cursors (graph-delta:<folder>); a first round
//   (no link yet, or an expired one: 410) reads only the last day's messages.
// * Send: createReply in MIME (base64, Content-Type: text/plain: JSON internetMessageHeaders take only X- headers, and
//   an agent's reply says Auto-Submitted: auto-replied; the draft carries In-Reply-To, References and the claim's
//   stamp, X-Inbox-Claim; its immutable id is the id of its copy in Sent Items), then send (202).
// * Automated mail: read from the message's internetMessageHeaders (selected with it: no request more).
// * The look before a send: the conversation's messages received after the claim's (one request).
import { timingSafeEqual } from "node:crypto";
import { judgeAutomated } from "../automated.js";
import { InboxClaimsError, SendRejected } from "../errors.js";
import {
  Accepted,
  batchOf,
  bearer,
  display,
  fetchTransport,
  header,
  isoDate,
  isRecord,
  jsonOf,
  messageIds,
  parseStamp,
  ProviderError,
  replyMime,
  replySubject,
  requireEnv,
  STAMP_HEADER,
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

export const DEFAULT_API_BASE = "https://graph.microsoft.com/v1.0";
const IMMUTABLE_IDS = ["Prefer", 'IdType="ImmutableId"'] as const;
/** The message fields the facts need. */
export const SELECT = "id,changeKey,conversationId,receivedDateTime,subject,from,replyTo,parentFolderId,internetMessageId,internetMessageHeaders";
/** The folders a mailbox is subscribed to: the Inbox, and Sent Items (a person's reply from Outlook). */
export const FOLDERS = ["inbox", "sentitems"] as const;
// Outlook message subscriptions last at most 7 days; renewed for 3, well inside it.
const SUBSCRIPTION_SECONDS = 3 * 24 * 3600;
const RANGE_TTL = 60;
/** The look before a send reads one page of the conversation's newer messages: one is enough to refuse. */
const SINCE_TOP = 50;

/** A first delta round (no link yet, or an expired one) reads only the messages of the last day. */
const RESYNC_SECONDS = 24 * 3600;
const EVENTS: Record<string, string> = { created: "message.created", updated: "message.updated" };

/** Graph refused the draft or its send: nothing went out (claim.send aborts: FREE). */
export class GraphSendRejected extends SendRejected {
  override name = "GraphSendRejected";
}

/**
 * The send may have gone out (a 5xx, a timeout): the subject stays SENDING, then IN_DOUBT, until its stamped copy in
 * Sent Items settles it (RecordOutgoing) or a person does.
 */
export class GraphSendOutcomeUnknown extends InboxClaimsError {
  override name = "GraphSendOutcomeUnknown";
}

function iso(seconds: number): string {
  return new Date(Math.floor(seconds) * 1000).toISOString().replace(/\.\d{3}Z$/, "Z");
}

function etagKey(etag: unknown): string | undefined {
  if (typeof etag !== "string" || !etag) return undefined;
  return etag.replace(/^W\//, "").replace(/^"+|"+$/g, "") || undefined;
}

export interface GraphProviderOptions {
  /** An access token for Graph, or a function that gives the current one. */
  token: string | (() => string);
  apiBase?: string;
  notificationUrl?: string;
  lifecycleUrl?: string;
  /** When set, a notification of another subscription is refused. */
  subscriptionIds?: readonly string[];
  /** The Sent Items folder's id; read once from Graph when not given. */
  sentItemsFolderId?: string;
  mailboxAddresses?: readonly string[];
  transport?: Transport;
  /** Unix seconds now (the subscriptions' expiry is counted from it). */
  clock?: () => number;
}

type Taken = { name: string; range: CursorRange; value: string; position: bigint };

/** Microsoft Graph change notifications for one mailbox (`user`: its id or address). */
export class GraphProvider implements Provider {
  readonly name = "graph";
  /** Graph wants a notification answered within 3 s. */
  readonly answerWithinMs = 3_000;
  readonly apiBase: string;
  readonly notificationUrl: string;
  readonly lifecycleUrl: string;
  readonly subscriptionIds: ReadonlySet<string>;
  readonly mailboxAddresses: readonly string[];
  sentItemsFolderId: string | undefined;
  private readonly token: string | (() => string);
  private readonly transport: Transport;
  private readonly clock: () => number;

  constructor(
    readonly clientState: string,
    readonly user: string,
    options: GraphProviderOptions,
  ) {
    if (!clientState || clientState.length > 255) throw new RangeError("clientState must be 1 to 255 characters (the clientState given when subscribing)");
    if (!user) throw new TypeError("user is empty: the Graph user id or address whose mailbox this is");
    this.token = options.token;
    this.apiBase = (options.apiBase ?? DEFAULT_API_BASE).replace(/\/+$/, "");
    this.notificationUrl = options.notificationUrl ?? "";
    this.lifecycleUrl = options.lifecycleUrl || this.notificationUrl;
    this.subscriptionIds = new Set(options.subscriptionIds ?? []);
    this.sentItemsFolderId = options.sentItemsFolderId;
    this.mailboxAddresses = options.mailboxAddresses ?? [];
    this.transport = options.transport ?? fetchTransport();
    this.clock = options.clock ?? (() => Date.now() / 1000);
  }

  /**
   * From GRAPH_CLIENT_STATE, GRAPH_USER, GRAPH_TOKEN, GRAPH_API_BASE (default https://graph.microsoft.com/v1.0),
   * GRAPH_NOTIFICATION_URL and INBOX_MAILBOX_ADDRESSES; `overrides` win.
   */
  static fromEnv(env: Record<string, string | undefined> = process.env, overrides: Partial<GraphProviderOptions> = {}): GraphProvider {
    requireEnv(env, ["GRAPH_CLIENT_STATE", "GRAPH_USER", "GRAPH_TOKEN"], "Microsoft 365");
    return new GraphProvider(env["GRAPH_CLIENT_STATE"]!, env["GRAPH_USER"]!, {
      token: env["GRAPH_TOKEN"]!,
      apiBase: env["GRAPH_API_BASE"] || DEFAULT_API_BASE,
      notificationUrl: env["GRAPH_NOTIFICATION_URL"] ?? "",
      mailboxAddresses: (env["INBOX_MAILBOX_ADDRESSES"] ?? "").split(",").map((a) => a.trim()).filter((a) => a),
      ...overrides,
    });
  }

  /** From a vector file's settings (conformance/providers/graph). */
  static fromSettings(settings: Record<string, unknown>, io: Pick<GraphProviderOptions, "transport" | "clock"> = {}): GraphProvider {
    return new GraphProvider(str(settings.client_state), str(settings.user), {
      token: str(settings.token),
      apiBase: str(settings.api_base),
      notificationUrl: str(settings.notification_url),
      subscriptionIds: (settings.subscription_ids as string[] | undefined) ?? [],
      sentItemsFolderId: typeof settings.sent_items_folder_id === "string" ? settings.sent_items_folder_id : undefined,
      mailboxAddresses: (settings.mailbox_addresses as string[] | undefined) ?? [],
      ...io,
    });
  }

  // -- requests ---------------------------------------------------------------------------------------------

  private request(method: string, url: string, options: { params?: [string, string][]; json?: unknown } = {}): HttpRequest {
    return { method, url, params: options.params ?? [], headers: [bearer(this.token), IMMUTABLE_IDS], json: options.json };
  }

  private userUrl(path: string): string {
    return `${this.apiBase}/users/${encodeURIComponent(this.user).replaceAll("%40", "@")}/${path}`;
  }

  private async call(request: HttpRequest): Promise<HttpResponse> {
    return this.transport(request);
  }

  // -- check ------------------------------------------------------------------------------------------------

  async check(request: WebhookRequest): Promise<Answer | Accepted> {
    return this.verify(request);
  }

  /** The handshake's answer, a refusal, or the notifications (no I/O). */
  verify(request: WebhookRequest): Answer | Accepted {
    const query = new URLSearchParams(request.query);
    if (query.has("validationToken")) {
      // Graph validating a new or renewed subscription's endpoint: the token decoded, as text/plain.
      const token = query.get("validationToken")!;
      return token ? { status: 200, body: token } : { status: 400, body: "validationToken is empty" };
    }
    if (request.method !== "POST") return { status: 405, body: "Graph posts notifications; GET is not one", headers: { allow: "POST" } };
    let document: unknown;
    try {
      document = JSON.parse(request.body.toString("utf8"));
    } catch {
      return { status: 400, body: "the body is not JSON: not a Graph notification collection" };
    }
    const notes = isRecord(document) ? document.value : undefined;
    if (!Array.isArray(notes) || !notes.every(isRecord)) return { status: 400, body: "the body has no 'value' array of notifications" };
    const expected = Buffer.from(this.clientState, "utf8");
    for (const note of notes) {
      const given = Buffer.from(str(note.clientState), "utf8");
      // timingSafeEqual needs equal lengths; comparing the expected value with itself keeps the time the same.
      const same = given.length === expected.length ? timingSafeEqual(given, expected) : !timingSafeEqual(expected, expected);
      if (!same) return { status: 401, body: "clientState does not match this subscription's: refused, nothing recorded" };
      if (this.subscriptionIds.size > 0 && !this.subscriptionIds.has(str(note.subscriptionId))) {
        return { status: 401, body: `subscription ${JSON.stringify(note.subscriptionId)} is not one of this endpoint's` };
      }
    }
    return new Accepted(notes);
  }

  acknowledge(): Answer {
    return { status: 202, body: "" };
  }

  // -- open -------------------------------------------------------------------------------------------------

  async open(accepted: Accepted, cursors: Cursors): Promise<Batch> {
    const notes = accepted.delivery as Record<string, unknown>[];
    const facts: MessageFacts[] = [];
    const actions: string[] = [];
    const taken: Taken[] = [];
    if (notes.some((n) => Object.hasOwn(EVENTS, str(n.changeType)) || n.lifecycleEvent === "missed")) await this.sentItems(); // once, before any message is read
    for (const note of notes) {
      const event = note.lifecycleEvent;
      if (event === "reauthorizationRequired") {
        await this.renew(str(note.subscriptionId));
        actions.push(`renewed ${str(note.subscriptionId)}`);
      } else if (event === "subscriptionRemoved") {
        await this.subscribe(str(note.resource));
        actions.push(`recreated ${str(note.resource)}`);
      } else if (event === "missed") {
        for (const folder of FOLDERS) facts.push(...(await this.resync(folder, cursors, taken)));
      } else if (Object.hasOwn(EVENTS, str(note.changeType))) {
        const data = isRecord(note.resourceData) ? note.resourceData : {};
        const messageId = str(data.id);
        if (!messageId) continue;
        const message = await this.read(messageId);
        if (message !== undefined) facts.push(await this.facts(message, EVENTS[str(note.changeType)]!, etagKey(data["@odata.etag"])));
      }
    }
    return batchOf(facts, {
      actions,
      commit: async () => {
        for (const { name, range, value, position } of taken) await cursors.advance(this.user, name, range, value, position);
      },
      abandon: async () => {
        for (const { name, range } of taken) await cursors.advance(this.user, name, range, range.value, range.position);
      },
    });
  }

  private async read(messageId: string): Promise<Record<string, unknown> | undefined> {
    const url = this.userUrl(`messages/${encodeURIComponent(messageId).replaceAll("%3D", "=")}`);
    const response = await this.call(this.request("GET", url, { params: [["$select", SELECT]] }));
    if (response.status === 404) return undefined; // gone before it was read: nothing to answer
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`reading message ${JSON.stringify(messageId)} answered HTTP ${response.status}`);
    return document;
  }

  private async sentItems(): Promise<string> {
    if (this.sentItemsFolderId === undefined) {
      const response = await this.call(this.request("GET", this.userUrl("mailFolders/sentitems"), { params: [["$select", "id"]] }));
      const document = jsonOf(response);
      if (response.status !== 200 || !isRecord(document) || typeof document.id !== "string") {
        throw new ProviderError(`reading the Sent Items folder answered HTTP ${response.status}`);
      }
      this.sentItemsFolderId = document.id;
    }
    return this.sentItemsFolderId;
  }

  /** The facts of a Graph message (as read with SELECT). */
  async facts(message: Record<string, unknown>, event: string, changeKey?: string): Promise<MessageFacts> {
    const sentItems = await this.sentItems();
    const from = isRecord(message.from) && isRecord(message.from.emailAddress) ? message.from.emailAddress : {};
    const name = str(from.name), address = str(from.address);
    const headers = message.internetMessageHeaders;
    const folder = message.parentFolderId;
    const folders = folder === sentItems ? [folder, "SENT"] : typeof folder === "string" ? [folder] : [];
    const replyTo = (Array.isArray(message.replyTo) ? message.replyTo : []).flatMap((r: unknown) =>
      isRecord(r) && isRecord(r.emailAddress) && typeof r.emailAddress.address === "string" ? [r.emailAddress.address] : [],
    );
    const subject = str(message.subject);
    const id = String(message.id);
    return {
      provider: this.name,
      event,
      mailbox: this.user,
      dedupKey: `${id}@${changeKey || str(message.changeKey)}`,
      messageId: id,
      threadId: str(message.conversationId) || undefined,
      receivedAt: isoDate(message.receivedDateTime),
      sender: display(name, address),
      subjectLine: subject,
      fromAddresses: address ? [address] : [],
      folders,
      outgoing: undefined,
      automated: judgeAutomated(Array.isArray(headers) ? (headers as { name: string; value: string }[]) : undefined, address),
      stamp: parseStamp(header(headers, STAMP_HEADER)),
      reply: {
        to: replyTo.length > 0 ? replyTo : address ? [address] : [],
        subject: replySubject(subject),
        internetMessageId: str(message.internetMessageId) || undefined,
        references: messageIds(header(headers, "References")),
      },
      source: message,
    };
  }

  /**
   * The messages of `message`'s conversation received after it (GET /users/{user}/messages?$filter=conversationId eq
   * '...' and receivedDateTime gt ..., one page), for the look before a send.
   */
  async since(message: MessageFacts): Promise<MessageFacts[]> {
    if (!message.threadId || message.receivedAt === undefined) return [];
    const filter = `conversationId eq '${message.threadId.replaceAll("'", "''")}' and receivedDateTime gt ${message.receivedAt.toISOString()}`;
    const response = await this.call(this.request("GET", this.userUrl("messages"), { params: [["$filter", filter], ["$select", SELECT], ["$top", String(SINCE_TOP)]] }));
    const document = jsonOf(response);
    if (response.status !== 200 || !isRecord(document) || !Array.isArray(document.value)) {
      throw new ProviderError(`listing conversation ${JSON.stringify(message.threadId)} answered HTTP ${response.status}`);
    }
    const found: MessageFacts[] = [];
    for (const item of document.value) if (isRecord(item) && typeof item.id === "string" && item.id !== message.messageId) found.push(await this.facts(item, "message.created"));
    return found;
  }

  /** A delta query of `folder` from its delta link, every page (after a `missed` lifecycle notification). */
  private async resync(folder: string, cursors: Cursors, taken: Taken[]): Promise<MessageFacts[]> {
    const name = `graph-delta:${folder}`;
    const range = await cursors.take(this.user, name, 0n, RANGE_TTL);
    if (range.outcome !== "TAKEN") return []; // another worker resyncs it now
    // A first round lists the folder: only the last day of it, as Gmail's resync (an older message is not one to
    // answer now, and a mailbox's whole Inbox would be a storm of replies).
    const first = this.userUrl(`mailFolders('${folder}')/messages/delta`);
    const firstParams: [string, string][] = [["$select", SELECT], ["$filter", `receivedDateTime ge ${iso(this.clock() - RESYNC_SECONDS)}`]];
    let [url, params] = range.value ? [range.value, [] as [string, string][]] : [first, firstParams];
    let found: MessageFacts[] = [];
    for (;;) {
      const split = new URL(url);
      const query: [string, string][] = [...split.searchParams.entries(), ...params];
      const base = `${split.protocol}//${split.host}${decodeURIComponent(split.pathname)}`;
      const response = await this.call(this.request("GET", base, { params: query }));
      if (response.status === 410 && url === range.value) {
        [url, params, found] = [first, firstParams, []]; // the delta link expired: a first round again
        continue;
      }
      const document = jsonOf(response);
      if (response.status !== 200 || !isRecord(document)) throw new ProviderError(`the delta query of ${folder} answered HTTP ${response.status}`);
      for (const item of Array.isArray(document.value) ? document.value : []) {
        if (isRecord(item) && !("@removed" in item) && typeof item.id === "string") found.push(await this.facts(item, "message.created"));
      }
      if (typeof document["@odata.nextLink"] === "string") {
        url = document["@odata.nextLink"];
        params = [];
        continue;
      }
      const link = document["@odata.deltaLink"];
      if (typeof link !== "string") throw new ProviderError(`the delta query of ${folder} ended without a delta link`);
      taken.push({ name, range, value: link, position: range.position + 1n });
      return found;
    }
  }

  // -- subscriptions ----------------------------------------------------------------------------------------

  /**
   * Creates a subscription to `resource` (created,updated, this endpoint's clientState and URLs); its id. Its
   * notifications name messages by immutable id (the requests carry Prefer: IdType="ImmutableId").
   */
  async subscribe(resource: string): Promise<string> {
    const json = {
      changeType: "created,updated",
      resource,
      clientState: this.clientState,
      notificationUrl: this.notificationUrl,
      lifecycleNotificationUrl: this.lifecycleUrl,
      expirationDateTime: iso(this.clock() + SUBSCRIPTION_SECONDS),
    };
    const response = await this.call(this.request("POST", `${this.apiBase}/subscriptions`, { json }));
    const document = jsonOf(response);
    if (response.status !== 201 || !isRecord(document) || typeof document.id !== "string") {
      throw new ProviderError(`creating the subscription to ${resource} answered HTTP ${response.status}`);
    }
    return document.id;
  }

  /** The two subscriptions a mailbox needs: its Inbox and its Sent Items (a person's reply from Outlook). */
  async subscriptions(): Promise<string[]> {
    const ids: string[] = [];
    for (const folder of FOLDERS) ids.push(await this.subscribe(`users/${this.user}/mailFolders('${folder}')/messages`));
    return ids;
  }

  /** Renews and reauthorizes a subscription in one request (PATCH with a new expirationDateTime). */
  async renew(subscriptionId: string): Promise<void> {
    const url = `${this.apiBase}/subscriptions/${encodeURIComponent(subscriptionId)}`;
    const response = await this.call(this.request("PATCH", url, { json: { expirationDateTime: iso(this.clock() + SUBSCRIPTION_SECONDS) } }));
    if (response.status !== 200) throw new ProviderError(`renewing subscription ${JSON.stringify(subscriptionId)} answered HTTP ${response.status}`);
  }

  // -- send -------------------------------------------------------------------------------------------------

  /**
   * The reply, for claim.send: `claim.send(() => graph.reply(message, { body, stamp: claim.stamp }))`: the draft
   * (createReply, stamped with the claim), then its send; resolves to the draft's immutable id, which its copy in
   * Sent Items keeps. A 4xx (the draft not made, or not sent) is a GraphSendRejected (nothing went out); a 5xx or
   * no answer to the send, a GraphSendOutcomeUnknown.
   */
  async reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp }): Promise<string> {
    if (options.stamp === undefined) throw new TypeError("reply needs the claim's stamp: graph.reply(message, { body, stamp: claim.stamp })");
    const id = (value: string): string => encodeURIComponent(value).replaceAll("%3D", "=");
    const draft = this.request("POST", this.userUrl(`messages/${id(message.messageId)}/createReply`));
    const mime = Buffer.from(replyMime(message, options.body, options.stamp).toString("base64"), "ascii");
    let created: HttpResponse;
    try {
      created = await this.call({ ...draft, headers: [...draft.headers, ["Content-Type", "text/plain"]], content: mime });
    } catch (error) {
      throw new GraphSendRejected(`the reply's draft could not be made, nothing was sent: ${(error as Error).message}`);
    }
    const document = jsonOf(created);
    if (created.status !== 201 || !isRecord(document) || typeof document.id !== "string") {
      throw new GraphSendRejected(`Graph refused the reply's draft (HTTP ${created.status}); nothing was sent`);
    }
    let sent: HttpResponse;
    try {
      sent = await this.call(this.request("POST", this.userUrl(`messages/${id(document.id)}/send`)));
    } catch (error) {
      throw new GraphSendOutcomeUnknown(`the send may have gone out: ${(error as Error).message}`, { cause: error });
    }
    if (sent.status === 202) return document.id;
    if (sent.status >= 400 && sent.status < 500) throw new GraphSendRejected(`Graph refused to send the draft (HTTP ${sent.status}); nothing was sent`);
    throw new GraphSendOutcomeUnknown(`Graph answered HTTP ${sent.status} to the send: it may have gone out`);
  }
}
