// Webhook endpoints for any provider behind the seam (docs/providers.md), for Express (providerWebhook) and plain
// node:http (providerWebhookListener), the Python client's webhook_app: keep the raw body, let the provider check
// it (signature, handshakes) and open it into messages' facts, record each message with the coordinator (the one
// ClaimReply of coordinator.replyTo, or RecordOutgoing for a message the mailbox sent), commit the batch (a
// cursor moves), answer, then run the guarded work in the background on the claims already held.
//
//   any method               413 over maxBodyBytes; what the provider answers a handshake (Nylas GET ?challenge=,
//                            Graph ?validationToken=) or a refusal (401 signature, 400 body, 403 another mailbox)
//   a delivery               the provider's acknowledgement (Nylas 200, Graph 202, Gmail 200) once every message
//                            of it was recorded (and the guarded work runs); 503 when the coordinator or the
//                            provider's API cannot answer within admissionTimeoutMs (the provider delivers it
//                            again), 500 for another error
// Nothing is recorded or claimed before the provider's check passes, and nothing is acknowledged that nothing
// recorded (docs/design.md#no-notification-lost). nylasWebhook and nylasWebhookListener are the same for the Nylas
// provider, with the Notification handed to the work as before.
import type { IncomingMessage, ServerResponse } from "node:http";
import type { Coordinator } from "./client.js";
import type { Claim, ReplyOptions } from "./claim.js";
import type { Notification } from "./envelope.js";
import { ClaimNotGranted, CoordinatorUnavailable, PermissionDenied, QuotaExceeded, ReplyRefused, Unauthenticated } from "./errors.js";
import { NylasProvider } from "./providers/nylas.js";
import { notificationOutcome, notificationStarted, type GuardSpan } from "./tracing.js";
import { Accepted, ProviderError, RangesTaken, retryLater, type Answer, type Batch, type MessageFacts, type Provider } from "./providers/seam.js";

export const DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024;
/** How long a notification waits for the coordinator to record it before it is answered 503 (Nylas waits 10 s). */
export const DEFAULT_ADMISSION_TIMEOUT_MS = 5_000;
/** Milliseconds a failed delivery's cursor ranges get to be given back; past it they wait for their leases. */
const GIVE_BACK_MS = 2_000;
/** The notification types (without variant suffix) the guarded work runs for. */
export const DEFAULT_EVENTS: ReadonlySet<string> = new Set(["message.created", "message.updated"]);

/** The options of providerWebhook / providerWebhookListener. */
export interface ProviderWebhookOptions extends ReplyOptions {
  coordinator: Coordinator;
  /** Runs inside coordinator.replyTo(facts) for each incoming message: dedup + claim, renewed, released afterwards. */
  work: (message: MessageFacts, claim: Claim) => Promise<unknown>;
  /** The messages' events answered (default message.created and message.updated). */
  events?: ReadonlySet<string>;
  maxBodyBytes?: number;
  /**
   * Milliseconds the coordinator (and the provider's API) get to record a delivery before it is answered 503
   * (default 5000, or less than the provider waits: Graph wants its answer within 3 s).
   */
  admissionTimeoutMs?: number;
  /** Called with what the background work threw (default: a process warning); refusals are not errors. */
  onError?: (error: unknown, message: MessageFacts) => void;
  /** Called when a claim was refused (a redelivery, a message someone else answers, an outgoing message...). */
  onRefused?: (refusal: ClaimNotGranted, message: MessageFacts) => void;
  /** Where the provider's lifecycle actions are logged (a Graph subscription renewed...); default: the coordinator's logger. */
  logger?: { info(message: string): void };
}

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
  /** Called when the claim was refused (a redelivery, a message someone else answers, automated mail...). */
  onRefused?: (refusal: ClaimNotGranted, notification: Notification) => void;
  /**
   * The Nylas API key: with it each message is read with its headers for the automated-mail rules (one GET per
   * message notification) and the thread is looked at right before each send (one GET per send); without it only
   * the sender's address tells automated mail (docs/node.md, "Reply storms").
   */
  apiKey?: string;
  /** The Nylas API's base URL (default https://api.us.nylas.com). */
  apiBase?: string;
}

const TEXT = "text/plain; charset=utf-8";

/** The handler both variants share; `running` counts background work; `drain()` waits for it (on shutdown). */
export interface WebhookHandler {
  readonly running: number;
  drain(): Promise<void>;
  /** Runs the provider's periodic check now (Gmail: what a dropped push would have said); its answer, as a delivery's. */
  periodicCheck(): Promise<Answer>;
  /**
   * Admits a delivery the agent opened itself (an IMAP watcher's wake), as a webhook request's: recorded, committed,
   * its work started; the answer it would have had.
   */
  deliver(accepted: Accepted): Promise<Answer>;
  /** Stops the periodic check and waits for the running work (on shutdown). */
  close(): Promise<void>;
}


class TimedOut extends Error {
  override name = "TimedOut";
}

/** `promise`, or TimedOut once `deadline` (a performance.now() value) passed. */
async function within<T>(promise: Promise<T>, deadline: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, fail) => {
    timer = setTimeout(() => fail(new TimedOut(`${what} took longer than the admission bound`)), Math.max(deadline - performance.now(), 1));
  });
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}

class Webhook implements WebhookHandler {
  private readonly tasks = new Set<Promise<void>>();
  readonly maxBodyBytes: number;
  readonly events: ReadonlySet<string>;
  readonly admissionTimeoutMs: number;
  private readonly timer: NodeJS.Timeout | undefined;
  private checking = false;

  constructor(
    readonly provider: Provider,
    readonly options: ProviderWebhookOptions,
  ) {
    this.maxBodyBytes = options.maxBodyBytes ?? DEFAULT_MAX_BODY_BYTES;
    this.events = options.events ?? DEFAULT_EVENTS;
    const bound = provider.answerWithinMs;
    this.admissionTimeoutMs = options.admissionTimeoutMs ?? Math.min(DEFAULT_ADMISSION_TIMEOUT_MS, bound - 500);
    if (!(this.admissionTimeoutMs > 0 && this.admissionTimeoutMs < bound)) {
      throw new RangeError(`admissionTimeoutMs must be between 0 and ${bound} (${provider.name} waits ${bound / 1000} s), not ${this.admissionTimeoutMs}`);
    }
    // A provider whose pushes can be dropped (Gmail): its periodic check, admitted as a delivery, one interval after
    // the handler is made and every interval after (close() stops it).
    const every = provider.periodicIntervalMs ?? 0;
    if (provider.periodic !== undefined && every > 0) {
      this.timer = setInterval(() => {
        if (!this.checking) void this.periodicCheck();
      }, every).unref(); // a check never keeps the process alive
    }
  }

  async periodicCheck(): Promise<Answer> {
    if (this.provider.periodic === undefined) return this.provider.acknowledge(); // nothing can be dropped
    this.checking = true;
    try {
      const answer = await this.accept(this.provider.periodic());
      if (answer.status >= 300) process.emitWarning(`the ${this.provider.name} periodic check found nothing recorded (${answer.status}: ${answer.body}); it runs again`);
      return answer;
    } finally {
      this.checking = false;
    }
  }

  deliver(accepted: Accepted): Promise<Answer> {
    return this.accept(accepted);
  }

  async close(): Promise<void> {
    clearInterval(this.timer);
    await this.drain();
  }

  get running(): number {
    return this.tasks.size;
  }

  async drain(): Promise<void> {
    while (this.tasks.size > 0) await Promise.allSettled([...this.tasks]);
  }

  private refused(refusal: ClaimNotGranted, facts: MessageFacts): void {
    this.options.onRefused?.(refusal, facts);
  }

  /**
   * Opens the delivery, records each message (a claim entered, renewed from now on), commits the batch and starts
   * each claim's work; the answer to give. A delivery only partly recorded is not acknowledged (the provider
   * delivers it again, and what was recorded answers DUPLICATE_DELIVERY then); the claims it did grant are worked.
   */
  async accept(accepted: Accepted): Promise<Answer> {
    const { coordinator, ttl, scope, note, mailbox } = this.options;
    const deadline = performance.now() + this.admissionTimeoutMs;
    const granted: [MessageFacts, Claim][] = [];
    let batch: Batch | undefined;
    let answer: Answer;
    const ranges = new RangesTaken(coordinator.cursors);
    try {
      batch = await within(this.provider.open(accepted, ranges), deadline, `reading the ${this.provider.name} delivery`);
      for (const found of batch.facts) {
        const facts = { ...found, outgoing: found.outgoing ?? coordinator.outgoing.judge(found.folders, found.fromAddresses, this.provider.mailboxAddresses) };
        if (!this.events.has(facts.event)) continue;
        try {
          granted.push([facts, await coordinator.admit(facts, { ttl, scope, note, mailbox, provider: this.provider }, deadline)]);
        } catch (error) {
          if (!(error instanceof ClaimNotGranted)) throw error;
          this.refused(error, facts); // recorded: a redelivery, a message someone else answers, an outgoing message
        }
      }
      await within(batch.commit(), deadline, "moving the cursor");
      for (const action of batch.actions) (this.options.logger ?? coordinator.logger).info(`inbox-claims: ${this.provider.name}: ${action}`);
      answer = this.provider.acknowledge();
    } catch (error) {
      // A cursor's range is given back unmoved, also when the provider failed (or ran out of time) before its batch
      // was made: the next delivery takes it at once rather than waiting out its lease.
      const givingBack = (async () => {
        try {
          await batch?.abandon();
        } finally {
          await ranges.giveBack();
        }
      })();
      await within(givingBack, performance.now() + GIVE_BACK_MS, "giving the cursor ranges back").catch(() => undefined);
      answer = unrecorded(`a ${this.provider.name} delivery`, error);
    }
    for (const [facts, claim] of granted) this.start(facts, claim);
    return answer;
  }

  private start(facts: MessageFacts, claim: Claim): void {
    const task = claim
      .run(() => this.options.work(facts, claim))
      .then(
        () => undefined,
        (error: unknown) => {
          // BeginSend refused by the reply rules: expected, and said in the one line claim.send logged (as Python's guard).
          if (error instanceof ReplyRefused) return;
          if (error instanceof ClaimNotGranted) this.refused(error, facts);
          else if (this.options.onError) this.options.onError(error, facts);
          else process.emitWarning(`the work on message ${facts.messageId} (notification ${facts.dedupKey}) failed: ${String(error)}`);
        },
      )
      .finally(() => this.tasks.delete(task));
    this.tasks.add(task);
  }

  async handle(req: IncomingMessage, res: ServerResponse, parsedBody: unknown): Promise<void> {
    // A delivery's span (a POST's), active while it is checked and recorded: the claims it admits are beneath it.
    const notification = req.method === "POST" ? notificationStarted(this.provider.name) : undefined;
    let answer: Answer;
    try {
      answer = await (notification === undefined ? this.answer(req, parsedBody) : notification.active(() => this.answer(req, parsedBody, notification)));
    } catch (error) {
      notification?.end("failed", error);
      throw error;
    }
    notification?.set({ "http.response.status_code": answer.status });
    notification?.end(notificationOutcome(answer.status));
    res.writeHead(answer.status, { "content-type": answer.contentType ?? TEXT, ...answer.headers });
    res.end(req.method === "HEAD" ? undefined : answer.body);
  }

  private async answer(req: IncomingMessage, parsedBody: unknown, notification?: GuardSpan): Promise<Answer> {
    const method = req.method ?? "GET";
    const body = method === "POST" ? await rawBody(req, parsedBody, this.maxBodyBytes) : Buffer.alloc(0);
    if (body === undefined) return { status: 413, body: `request body over ${this.maxBodyBytes} bytes` };
    const url = new URL(req.url ?? "/", "http://localhost");
    const headers: Record<string, string> = {};
    for (const [name, value] of Object.entries(req.headers)) if (value !== undefined) headers[name.toLowerCase()] = Array.isArray(value) ? value.join(",") : value;
    let checked: Answer | Accepted;
    try {
      checked = await this.provider.check({ method, query: url.search.replace(/^\?/, ""), headers, body });
    } catch (error) {
      return unrecorded(`a ${this.provider.name} webhook`, error); // the provider's keys could not be read
    }
    if (!(checked instanceof Accepted)) return checked;
    notification?.event("verified");
    const answer = await this.accept(checked);
    if (answer.status < 300) notification?.event("recorded");
    return answer;
  }
}

/**
 * A delivery the coordinator did not record is never acknowledged: the provider then delivers it again (503 while
 * the coordinator or the provider's API cannot answer; 403 when the coordinator refuses this agent the mailbox,
 * which an operator fixes in the token file, and the provider's next attempt then gets through; 500 for anything else).
 */
function unrecorded(what: string, error: unknown): Answer {
  if (error instanceof PermissionDenied || error instanceof Unauthenticated) {
    process.emitWarning(`${what} answered 403, not recorded: the coordinator refused this agent: ${error.details}`);
    return { status: 403, body: `the coordinator refused this agent, nothing recorded: ${error.details}` };
  }
  if (error instanceof CoordinatorUnavailable || error instanceof QuotaExceeded || error instanceof ProviderError || error instanceof TimedOut) {
    process.emitWarning(`${what} answered 503, the coordinator did not record it: ${String(error)}; the provider delivers it again`);
    return retryLater("the coordinator could not record this notification");
  }
  process.emitWarning(`${what} answered 500, not recorded: ${String(error)}`);
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

type Middleware = (req: IncomingMessage & { body?: unknown }, res: ServerResponse, next: (error?: unknown) => void) => void;
type Listener = (req: IncomingMessage, res: ServerResponse) => void;

function middlewareOf(webhook: Webhook): Middleware & WebhookHandler {
  const middleware: Middleware = (req, res, next) => {
    webhook.handle(req, res, req.body).catch(next);
  };
  return withHandler(middleware, webhook);
}

function listenerOf(webhook: Webhook): Listener & WebhookHandler {
  const listener: Listener = (req, res) => {
    webhook.handle(req, res, undefined).catch((error: unknown) => {
      if (!res.headersSent) res.writeHead(500, { "content-type": TEXT }).end("internal error");
      process.emitWarning(`the webhook handler failed: ${String(error)}`);
    });
  };
  return withHandler(listener, webhook);
}

/**
 * Express middleware for any provider: `app.all("/webhook", providerWebhook(graph, { coordinator, work }))`. Keeps
 * the raw body (with or without express.raw() before it), lets the provider check and open it, records every
 * message before the provider's answer, runs `work(facts, claim)` guarded after.
 */
export function providerWebhook(provider: Provider, options: ProviderWebhookOptions): Middleware & WebhookHandler {
  return middlewareOf(new Webhook(provider, options));
}

/** The same for node:http: `http.createServer(providerWebhookListener(gmail, { coordinator, work }))`. */
export function providerWebhookListener(provider: Provider, options: ProviderWebhookOptions): Listener & WebhookHandler {
  return listenerOf(new Webhook(provider, options));
}

/** The Nylas provider and options of nylasWebhook: its work, onError and onRefused get the Notification, as always. */
function nylasWebhookOf(options: WebhookOptions): Webhook {
  if (typeof options.secret === "string" ? !options.secret : options.secret.length === 0) {
    throw new TypeError("webhook secret is empty: check the server's configuration");
  }
  const { secret, work, onError, onRefused, apiKey, apiBase, ...rest } = options;
  const source = (facts: MessageFacts): Notification => facts.source as Notification;
  return new Webhook(new NylasProvider(secret, { apiKey, apiBase }), {
    ...rest,
    work: (facts, claim) => work(source(facts), claim),
    onError: onError && ((error, facts) => onError(error, source(facts))),
    onRefused: onRefused && ((refusal, facts) => onRefused(refusal, source(facts))),
  });
}

/**
 * Express middleware: `app.all("/webhooks/nylas", nylasWebhook({ secret, coordinator, work }))`. Keeps the raw
 * body (works with or without express.raw() before it), verifies, answers at once, runs `work` guarded after.
 */
export function nylasWebhook(options: WebhookOptions): Middleware & WebhookHandler {
  return middlewareOf(nylasWebhookOf(options));
}

/** The same for node:http: `http.createServer(nylasWebhookListener({ secret, coordinator, work }))`. */
export function nylasWebhookListener(options: WebhookOptions): Listener & WebhookHandler {
  return listenerOf(nylasWebhookOf(options));
}

// Object.assign would copy `running` once, as a number: define it as a getter of the live count.
function withHandler<F extends object>(fn: F, webhook: Webhook): F & WebhookHandler {
  return Object.defineProperties(fn, {
    running: { get: () => webhook.running },
    drain: { value: () => webhook.drain() },
    periodicCheck: { value: () => webhook.periodicCheck() },
    deliver: { value: (accepted: Accepted) => webhook.deliver(accepted) },
    close: { value: () => webhook.close() },
  }) as F & WebhookHandler;
}
