// Doubles of AgentMail's and Resend's APIs on node:http, following their documentation (never our code): they hold
// the mailbox's messages, sign their webhook events as Svix does, and take sends with an Idempotency-Key as the
// providers document it: the same key with the same body answers the first send again and sends nothing; the same
// key with another body is refused 409 (Resend's invalid_idempotent_request; AgentMail the same). A send can be
// made to fail as a network does: `lost_answer` (sent, the answer lost: the connection is dropped) or
// `unavailable` (503, nothing sent).
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { signStandardWebhook } from "../src/webhooks.js";

export type Failure = "" | "lost_answer" | "unavailable";
export interface SentMail {
  by: "agent" | "person";
  inReplyTo: string;
  id: string;
  key: string;
  to: string[];
  headers: Record<string, string>;
  tags: Record<string, string>;
}
type Json = Record<string, unknown>;

let svixCounter = 0;

/** An event as Svix delivers it: the body's bytes and its headers, signed with the endpoint's secret. */
export function svixDelivery(secret: string, event: Json, svixId = `msg_${process.pid}_${++svixCounter}`): { body: Buffer; headers: Record<string, string> } {
  const body = Buffer.from(JSON.stringify(event));
  const timestamp = Math.floor(Date.now() / 1000);
  return {
    body,
    headers: {
      "content-type": "application/json",
      "svix-id": svixId,
      "svix-timestamp": String(timestamp),
      "svix-signature": signStandardWebhook(body, { msgId: svixId, timestamp, secret }),
    },
  };
}

export const secretOf = (text: string): string => "whsec_" + Buffer.from(text).toString("base64");

abstract class MailApi {
  server!: Server;
  url = "";
  sendFailure: Failure = "";
  readonly sends: SentMail[] = [];
  readonly calls: Record<string, number> = {};
  private readonly idempotent = new Map<string, { body: string; status: number; answer: Json }>();
  protected counter = 0;

  constructor(readonly apiKey: string) {}

  async start(): Promise<this> {
    this.server = createServer((req, res) => void this.serve(req, res));
    await new Promise<void>((ok) => this.server.listen(0, "127.0.0.1", ok));
    this.server.unref();
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
    return this;
  }

  async stop(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise((ok) => this.server.close(ok));
  }

  /** The replies to `messageId` by `by` that went out. */
  repliesTo(messageId: string, by: "agent" | "person" = "agent"): number {
    return this.sends.filter((s) => s.inReplyTo === messageId && s.by === by).length;
  }

  protected abstract route(method: string, path: string, body: Json, key: string): { status: number; answer: Json; sent?: boolean };

  /** An error's body, as the API documents it. */
  protected errorBody(status: number, name: string, message: string): Json {
    return { name, message };
  }

  private async serve(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const chunks: Buffer[] = [];
    for await (const chunk of req) chunks.push(chunk as Buffer);
    const text = Buffer.concat(chunks).toString("utf8");
    const answer = (status: number, document: Json): void => void res.writeHead(status, { "content-type": "application/json" }).end(JSON.stringify(document));
    if (req.headers.authorization !== `Bearer ${this.apiKey}`) return answer(401, this.errorBody(401, "missing_api_key", "Missing or invalid API key"));
    const path = new URL(req.url ?? "/", this.url).pathname;
    const name = `${req.method} ${path.replace(/\/[^/]*$/, "/*")}`;
    this.calls[name] = (this.calls[name] ?? 0) + 1;
    const key = String(req.headers["idempotency-key"] ?? "");
    const isSend = req.method === "POST";
    if (isSend && key) {
      const earlier = this.idempotent.get(key);
      if (earlier !== undefined) {
        if (earlier.body !== text) return answer(409, this.errorBody(409, "invalid_idempotent_request", "Same idempotency key used with a different request payload"));
        return answer(earlier.status, earlier.answer); // the first answer again, nothing sent
      }
    }
    if (isSend && this.sendFailure === "unavailable") return answer(503, this.errorBody(503, "service_unavailable", "try again later"));
    const { status, answer: document, sent } = this.route(req.method ?? "GET", decodeURIComponent(path), text ? (JSON.parse(text) as Json) : {}, key);
    if (sent && key) this.idempotent.set(key, { body: text, status, answer: document });
    if (sent && this.sendFailure === "lost_answer") return void res.destroy(); // sent; the answer never arrives
    answer(status, document);
  }
}

/** AgentMail: inboxes' messages, GET .../messages/{id}, POST .../messages/{id}/reply; events message.received and message.sent. */
export class AgentMailDouble extends MailApi {
  readonly messages = new Map<string, Json>();

  constructor(
    readonly inbox: string,
    readonly secret: string,
    apiKey = "am_test_key",
  ) {
    super(apiKey);
  }

  /** A customer's mail arriving: the message.received event AgentMail delivers for it (one event id for every webhook). */
  receive(from: string, subject: string, thread = `thd_${++this.counter}`): Json {
    const id = `<c${++this.counter}.${process.pid}@mail.example.org>`;
    const now = new Date().toISOString();
    const message: Json = { inbox_id: this.inbox, thread_id: thread, message_id: id, labels: ["received", "unread"], timestamp: now, from, to: [this.inbox], subject, text: "Where is it?", size: 900, updated_at: now, created_at: now };
    this.messages.set(id, message);
    return { type: "event", event_type: "message.received", event_id: `evt_r${this.counter}_${process.pid}`, message, thread: { inbox_id: this.inbox, thread_id: thread, message_count: 1 } };
  }

  /** The message.sent event of a sent message (as AgentMail delivers it: ids only). */
  sentEvent(messageId: string): Json {
    const message = this.messages.get(messageId)!;
    return { type: "event", event_type: "message.sent", event_id: `evt_s${++this.counter}_${process.pid}`, send: { inbox_id: this.inbox, thread_id: message.thread_id, message_id: messageId, timestamp: message.timestamp, recipients: message.to } };
  }

  /** A person's reply from AgentMail's console: sent, then its message.sent event. */
  personReplies(messageId: string): Json {
    return this.sentEvent(this.send("person", messageId, { text: "Answered by Carla." }, ""));
  }

  /** The id of the agent's reply to `messageId` (the last one). */
  replyOf(messageId: string): string {
    return [...this.sends].reverse().find((s) => s.inReplyTo === messageId)!.id;
  }

  private send(by: "agent" | "person", original: string, body: Json, key: string): string {
    const message = this.messages.get(original)!;
    const id = `<am${++this.counter}.${process.pid}@agentmail.to>`;
    const headers = Object.fromEntries(Object.entries((body.headers as Record<string, string> | undefined) ?? {}).map(([k, v]) => [k.toLowerCase(), v]));
    const now = new Date().toISOString();
    const references = [...((message.references as string[] | undefined) ?? []), original];
    this.messages.set(id, { inbox_id: this.inbox, thread_id: message.thread_id, message_id: id, labels: ["sent"], timestamp: now, from: `Support <${this.inbox}>`, to: [String(message.from)], subject: `Re: ${String(message.subject)}`, in_reply_to: original, references, headers: { ...headers, "message-id": id }, text: body.text, size: 700, updated_at: now, created_at: now });
    this.sends.push({ by, inReplyTo: original, id, key, to: [String(message.from)], headers, tags: {} });
    return id;
  }

  protected route(method: string, path: string, body: Json, key: string): { status: number; answer: Json; sent?: boolean } {
    const match = /^\/v0\/inboxes\/([^/]+)\/messages\/([^/]+)(\/reply)?$/.exec(path);
    if (match === null || match[1] !== this.inbox) return { status: 404, answer: { name: "NotFoundError", message: "Not found" } };
    const message = this.messages.get(match[2]!);
    if (message === undefined) return { status: 404, answer: { name: "NotFoundError", message: "Message not found" } };
    if (method === "GET" && !match[3]) return { status: 200, answer: message };
    if (method !== "POST" || !match[3]) return { status: 405, answer: { name: "MethodNotAllowed", message: method } };
    if (typeof body.text !== "string" && typeof body.html !== "string") return { status: 400, answer: { name: "ValidationError", message: "text or html is required" } };
    const id = this.send("agent", match[2]!, body, key);
    return { status: 200, answer: { message_id: id, thread_id: message.thread_id }, sent: true };
  }
}

/** Resend: received emails (GET /emails/receiving/{id}), POST /emails; events email.received (metadata) and email.sent. */
export class ResendDouble extends MailApi {
  readonly received = new Map<string, Json>();
  private readonly sent = new Map<string, Json>();

  constructor(
    readonly mailbox: string,
    readonly secret: string,
    apiKey = "re_test_key",
  ) {
    super(apiKey);
  }

  /** A customer's mail arriving: the email.received event (metadata only, as Resend documents it). */
  receive(from: string, subject: string, headers: Record<string, string> = {}): Json {
    const id = `${(++this.counter).toString(16).padStart(8, "0")}-7520-42d8-8898-${process.pid.toString(16).padStart(12, "0")}`;
    const messageId = `<c${this.counter}.${process.pid}@mail.example.org>`;
    const now = new Date().toISOString();
    const email: Json = { object: "email", id, to: [this.mailbox], from, created_at: now, subject, bcc: [], cc: [], reply_to: null, received_for: [this.mailbox], html: null, text: "Where is it?", headers: { "message-id": messageId, ...headers }, message_id: messageId, raw: null, attachments: [] };
    this.received.set(id, email);
    return { type: "email.received", created_at: now, data: { email_id: id, created_at: now, from, to: [this.mailbox], bcc: [], cc: [], message_id: messageId, subject, attachments: [] } };
  }

  /** The email.sent event of a sent email, with the tags it was sent with. */
  sentEvent(emailId: string): Json {
    const email = this.sent.get(emailId)!;
    return { type: "email.sent", created_at: new Date().toISOString(), data: { email_id: emailId, created_at: email.created_at, from: email.from, to: email.to, subject: email.subject, tags: email.tags } };
  }

  /** The id of the last send answering `emailId`. */
  replyOf(emailId: string): string {
    return [...this.sends].reverse().find((s) => s.inReplyTo === emailId)!.id;
  }

  /**
   * A person's reply from their own mail client, which never passes through Resend's API: the customer gets it, and
   * its copy (the mailbox in Bcc) arrives at the receiving address: that email.received event, From the mailbox, in
   * the thread by In-Reply-To and References.
   */
  personReplies(emailId: string): Json {
    const email = this.received.get(emailId)!;
    const original = String(email.message_id);
    this.sends.push({ by: "person", inReplyTo: emailId, id: `person-${++this.counter}`, key: "", to: [String(email.from)], headers: { "In-Reply-To": original }, tags: {} });
    return this.receive(`Carla <${this.mailbox}>`, `Re: ${String(email.subject)}`, { "in-reply-to": original, references: original });
  }

  private store(by: "agent" | "person", body: Json, key: string): string {
    const id = `${(++this.counter).toString(16).padStart(8, "0")}-02e9-4d39-ad75-${process.pid.toString(16).padStart(12, "0")}`;
    const tags = Object.fromEntries(((body.tags as { name: string; value: string }[] | undefined) ?? []).map((t) => [t.name, t.value]));
    const headers = (body.headers as Record<string, string> | undefined) ?? {};
    const answered = [...this.received.values()].find((e) => e.message_id === headers["In-Reply-To"]);
    this.sent.set(id, { id, from: body.from, to: body.to, subject: body.subject, created_at: new Date().toISOString(), tags });
    this.sends.push({ by, inReplyTo: answered === undefined ? "" : String(answered.id), id, key, to: body.to as string[], headers, tags });
    return id;
  }

  protected override errorBody(status: number, name: string, message: string): Json {
    return { statusCode: status, name, message };
  }

  protected route(method: string, path: string, body: Json, key: string): { status: number; answer: Json; sent?: boolean } {
    const read = /^\/emails\/receiving\/([^/]+)$/.exec(path);
    if (method === "GET" && read !== null) {
      const email = this.received.get(read[1]!);
      return email === undefined ? { status: 404, answer: { statusCode: 404, name: "not_found", message: "Email not found" } } : { status: 200, answer: email };
    }
    if (method === "POST" && path === "/emails") {
      const to = Array.isArray(body.to) ? body.to : [body.to];
      if (typeof body.from !== "string" || to.length === 0 || !to.every((a) => typeof a === "string" && a.includes("@")) || typeof body.subject !== "string") {
        return { status: 422, answer: { statusCode: 422, name: "validation_error", message: "from, to (email addresses) and subject are required" } };
      }
      for (const tag of (body.tags as { name: string; value: string }[] | undefined) ?? []) {
        if (!/^[A-Za-z0-9_-]{1,256}$/.test(tag.name) || !/^[A-Za-z0-9_-]{1,256}$/.test(tag.value)) {
          return { status: 422, answer: { statusCode: 422, name: "validation_error", message: "tags may hold only ASCII letters, numbers, underscores and dashes" } };
        }
      }
      return { status: 200, answer: { id: this.store("agent", body, key) }, sent: true };
    }
    return { status: 404, answer: { statusCode: 404, name: "not_found", message: "The requested endpoint does not exist" } };
  }
}

/** Nylas v3: POST /v3/grants/{grant}/messages/send (the answer `{request_id, data}`, an error `{request_id, error: {type, message}}`). */
export class NylasDouble extends MailApi {
  constructor(
    readonly grant: string,
    apiKey = "nyk_test_key",
  ) {
    super(apiKey);
  }

  protected override errorBody(_status: number, name: string, message: string): Json {
    return { request_id: `req-${++this.counter}`, error: { type: name, message } };
  }

  protected route(method: string, path: string, body: Json, key: string): { status: number; answer: Json; sent?: boolean } {
    if (method !== "POST" || path !== `/v3/grants/${this.grant}/messages/send`) return { status: 404, answer: this.errorBody(404, "not_found_error", "Not found") };
    const to = Array.isArray(body.to) ? (body.to as { email?: unknown }[]) : [];
    if (to.length === 0 || !to.every((p) => typeof p.email === "string" && p.email.includes("@"))) {
      return { status: 400, answer: this.errorBody(400, "invalid_request_error", "to: at least one recipient with a valid email is required") };
    }
    const id = `nylas-sent-${++this.counter}`;
    // custom_headers ({name, value}) are what Nylas writes into the message's headers.
    const custom = Array.isArray(body.custom_headers) ? (body.custom_headers as { name?: unknown; value?: unknown }[]) : [];
    const headers = Object.fromEntries(custom.map((h) => [String(h.name), String(h.value)]));
    this.sends.push({ by: "agent", inReplyTo: String(body.reply_to_message_id ?? ""), id, key, to: to.map((p) => String(p.email)), headers, tags: {} });
    return { status: 200, answer: { request_id: `req-${this.counter}`, data: { id, grant_id: this.grant, thread_id: "thread-1", subject: body.subject, to: body.to } }, sent: true };
  }
}
