// A Nylas webhook endpoint for Express (nylasWebhook) and for plain node:http (nylasWebhookListener): keep the
// raw body, verify its signature, record the notification with the coordinator (the one ClaimReply of
// coordinator.replyTo, or RecordOutgoing for a message the mailbox sent), answer, then run the guarded work in
// the background on the claim already held.
//
//   GET ?challenge=<value>   200, the value echoed as text/plain (Nylas endpoint verification)
//   POST                     413 over maxBodyBytes; 401 bad or missing signature; 400 not an envelope;
//                            for message.created / message.updated: 200 once the coordinator recorded it (and
//                            the guarded work runs), 503 when it cannot within admissionTimeoutMs (5 s: Nylas
//                            delivers it again), 500 for another error; other types: 200
// Nothing is recorded or claimed before both checks pass, and nothing is acknowledged that nothing recorded
// (docs/design.md#no-notification-lost).
import type { IncomingMessage, ServerResponse } from "node:http";
import type { Coordinator } from "./client.js";
import type { Claim, ReplyOptions } from "./claim.js";
import { parseNotification, EnvelopeError, type Notification } from "./envelope.js";
import { ClaimNotGranted, CoordinatorUnavailable, QuotaExceeded } from "./errors.js";
import { NYLAS_SIGNATURE_HEADER, nylasChallengeResponse, verifyNylasSignature, WebhookVerificationError } from "./webhooks.js";

export const DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024;
/** How long a notification waits for the coordinator to record it before it is answered 503 (Nylas waits 10 s). */
export const DEFAULT_ADMISSION_TIMEOUT_MS = 5_000;
/** The notification types (without variant suffix) the guarded work runs for. */
export const DEFAULT_EVENTS: ReadonlySet<string> = new Set(["message.created", "message.updated"]);

export interface WebhookOptions extends ReplyOptions {
  /** The webhook secret Nylas showed when the webhook was created. */
  secret: string | Buffer;
  coordinator: Coordinator;
  /** Runs inside coordinator.replyTo(notification): dedup + claim, renewed, released afterwards. */
  work: (notification: Notification, claim: Claim) => Promise<unknown>;
  events?: ReadonlySet<string>;
  maxBodyBytes?: number;
  /** Milliseconds the coordinator gets to record a notification before it is answered 503 (default 5000). */
  admissionTimeoutMs?: number;
  /** Called with what the background work threw (default: a process warning); refusals are not errors. */
  onError?: (error: unknown, notification: Notification) => void;
  /** Called when the claim was refused (a redelivery, a message someone else answers...). */
  onRefused?: (refusal: ClaimNotGranted, notification: Notification) => void;
}

interface Answer {
  status: number;
  body: string;
  notification?: Notification;
  headers?: Record<string, string>;
}

const OK: Answer = { status: 200, body: "ok" };

/** The handler both variants share; `running` counts background work; `drain()` waits for it (on shutdown). */
export interface WebhookHandler {
  readonly running: number;
  drain(): Promise<void>;
}

class Webhook implements WebhookHandler {
  private readonly tasks = new Set<Promise<void>>();
  readonly maxBodyBytes: number;
  readonly events: ReadonlySet<string>;
  readonly admissionTimeoutMs: number;

  constructor(readonly options: WebhookOptions) {
    if (typeof options.secret === "string" ? !options.secret : options.secret.length === 0) {
      throw new TypeError("webhook secret is empty: check the server's configuration");
    }
    this.maxBodyBytes = options.maxBodyBytes ?? DEFAULT_MAX_BODY_BYTES;
    this.events = options.events ?? DEFAULT_EVENTS;
    this.admissionTimeoutMs = options.admissionTimeoutMs ?? DEFAULT_ADMISSION_TIMEOUT_MS;
    if (!(this.admissionTimeoutMs > 0 && this.admissionTimeoutMs < 10_000)) {
      throw new RangeError(`admissionTimeoutMs must be between 0 and 10000 (Nylas waits 10 s), not ${this.admissionTimeoutMs}`);
    }
  }

  get running(): number {
    return this.tasks.size;
  }

  async drain(): Promise<void> {
    while (this.tasks.size > 0) await Promise.allSettled([...this.tasks]);
  }

  check(method: string, url: string, signature: string | undefined, body: Buffer | undefined): Answer {
    if (method === "GET" || method === "HEAD") {
      try {
        const value = nylasChallengeResponse(new URL(url, "http://localhost").searchParams);
        return value === undefined ? { status: 400, body: "expected GET ?challenge=<value> (endpoint verification) or a signed POST" } : { status: 200, body: value };
      } catch (error) {
        return { status: 400, body: (error as Error).message };
      }
    }
    if (method !== "POST") return { status: 405, body: "use GET ?challenge= or POST" };
    if (body === undefined) return { status: 413, body: `request body over ${this.maxBodyBytes} bytes` };
    try {
      verifyNylasSignature(body, signature, this.options.secret);
    } catch (error) {
      if (!(error instanceof WebhookVerificationError)) throw error;
      return { status: 401, body: `signature refused: ${error.message}` };
    }
    try {
      return { status: 200, body: "ok", notification: parseNotification(body) };
    } catch (error) {
      if (!(error instanceof EnvelopeError)) throw error;
      return { status: 400, body: `not a notification envelope: ${error.message}` };
    }
  }

  /** Records the notification (the claim entered, renewed from now on) and starts its work; the answer to give. */
  async accept(notification: Notification): Promise<Answer> {
    if (!this.events.has(notification.baseType) || !notification.isMessageEvent) return OK;
    const { coordinator, work, ttl, scope, note, mailbox } = this.options;
    let claim: Claim;
    try {
      claim = await coordinator.admit(notification, { ttl, scope, note, mailbox }, performance.now() + this.admissionTimeoutMs);
    } catch (error) {
      if (error instanceof ClaimNotGranted) {
        this.options.onRefused?.(error, notification);
        return OK; // recorded: a redelivery, a message someone else answers, an outgoing message
      }
      return unrecorded(notification, error);
    }
    const task = claim
      .run(() => work(notification, claim))
      .then(
        () => undefined,
        (error: unknown) => {
          if (error instanceof ClaimNotGranted) this.options.onRefused?.(error, notification);
          else if (this.options.onError) this.options.onError(error, notification);
          else process.emitWarning(`the work on notification ${notification.notificationId} failed: ${String(error)}`);
        },
      )
      .finally(() => this.tasks.delete(task));
    this.tasks.add(task);
    return OK;
  }

  async handle(req: IncomingMessage, res: ServerResponse, parsedBody: unknown): Promise<void> {
    const body = req.method === "POST" ? await rawBody(req, parsedBody, this.maxBodyBytes) : undefined;
    const signature = req.headers[NYLAS_SIGNATURE_HEADER];
    const answer = this.check(req.method ?? "GET", req.url ?? "/", Array.isArray(signature) ? signature.join(",") : signature, body);
    const given = answer.notification === undefined ? answer : await this.accept(answer.notification);
    res.writeHead(given.status, { "content-type": "text/plain; charset=utf-8", ...given.headers });
    res.end(req.method === "HEAD" ? undefined : given.body);
  }
}

/** A notification the coordinator did not record is never answered 200: Nylas then delivers it again. */
function unrecorded(notification: Notification, error: unknown): Answer {
  if (error instanceof CoordinatorUnavailable || error instanceof QuotaExceeded) {
    process.emitWarning(`notification ${notification.notificationId} answered 503, the coordinator did not record it: ${String(error)}; Nylas delivers it again`);
    return { status: 503, body: "the coordinator could not record this notification; deliver it again later", headers: { "retry-after": "5" } };
  }
  process.emitWarning(`notification ${notification.notificationId} answered 500, not recorded: ${String(error)}`);
  return { status: 500, body: "this notification could not be recorded; see the agent's log" };
}

/** The body as received: express.raw() put it in req.body (a Buffer), else it is read from the stream. */
async function rawBody(req: IncomingMessage, parsed: unknown, limit: number): Promise<Buffer | undefined> {
  if (Buffer.isBuffer(parsed)) return parsed.length > limit ? undefined : parsed;
  if (parsed !== undefined && typeof parsed === "object" && Object.keys(parsed as object).length > 0) {
    throw new TypeError("the request body was already parsed (express.json()?): mount the webhook before body parsers, or use express.raw({ type: '*/*' })");
  }
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    size += (chunk as Buffer).length;
    if (size > limit) return undefined;
    chunks.push(chunk as Buffer);
  }
  return Buffer.concat(chunks);
}

/**
 * Express middleware: `app.all("/webhooks/nylas", nylasWebhook({ secret, coordinator, work }))`. Keeps the raw
 * body (works with or without express.raw() before it), verifies, answers at once, runs `work` guarded after.
 */
export function nylasWebhook(options: WebhookOptions): ((req: IncomingMessage & { body?: unknown }, res: ServerResponse, next: (error?: unknown) => void) => void) & WebhookHandler {
  const webhook = new Webhook(options);
  const middleware = (req: IncomingMessage & { body?: unknown }, res: ServerResponse, next: (error?: unknown) => void): void => {
    webhook.handle(req, res, req.body).catch(next);
  };
  return withHandler(middleware, webhook);
}

/** The same for node:http: `http.createServer(nylasWebhookListener({ secret, coordinator, work }))`. */
export function nylasWebhookListener(options: WebhookOptions): ((req: IncomingMessage, res: ServerResponse) => void) & WebhookHandler {
  const webhook = new Webhook(options);
  const listener = (req: IncomingMessage, res: ServerResponse): void => {
    webhook.handle(req, res, undefined).catch((error: unknown) => {
      if (!res.headersSent) res.writeHead(500, { "content-type": "text/plain; charset=utf-8" }).end("internal error");
      process.emitWarning(`the webhook handler failed: ${String(error)}`);
    });
  };
  return withHandler(listener, webhook);
}

// Object.assign would copy `running` once, as a number: define it as a getter of the live count.
function withHandler<F extends object>(fn: F, webhook: Webhook): F & WebhookHandler {
  return Object.defineProperties(fn, {
    running: { get: () => webhook.running },
    drain: { value: () => webhook.drain() },
  }) as F & WebhookHandler;
}
