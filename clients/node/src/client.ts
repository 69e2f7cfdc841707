// The coordinator client: connect-es over real gRPC (HTTP/2), retries with backoff, request ids, and the Batch coalescing.
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { isIP } from "node:net";
import { setTimeout as sleep } from "node:timers/promises";
import { create, type Message } from "@bufbuild/protobuf";
import { timestampDate, timestampFromDate } from "@bufbuild/protobuf/wkt";
import { createClient, type Client } from "@connectrpc/connect";
import { createConnectTransport, createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import * as pb from "./gen/inbox/coordinator/v1/coordinator_pb.js";
import { BATCH_MAX_CALLS, BATCHABLE, batchOf, answers, Coalescer, RESEND, type Rpc } from "./batch.js";
import { RpcFailure } from "./rpc.js";
import { callStarted, type GuardSpan } from "./tracing.js";
import {
  callerFromPb,
  claimResultFromPb,
  deliveryResultFromPb,
  fenceFromPb,
  incomingFromPb,
  outgoingFromPb,
  pageFromPb,
  stateToPb,
  statusFromPb,
  subjectToPb,
  summaryToPb,
  takeoverFromPb,
  watchItemFromPb,
  type CallerIdentity,
  type ClaimResult,
  type ClaimsPage,
  type DeliveryResult,
  type FenceResult,
  type HolderKind,
  type IncomingResult,
  type MessageSummary,
  type OutgoingResult,
  type Subject,
  type SubjectState,
  type SubjectStatus,
  type TakeoverResult,
  type WatchItem,
} from "./types.js";
import { AUTOMATED_REASON_MAX_BYTES, Claim, cleanText, resolveSubject, SUMMARY_TEXT_MAX_BYTES, summaryOf, type ReplyOptions, type ReplyTarget } from "./claim.js";
import { parseNotification, type Notification } from "./envelope.js";
import { factsOf } from "./providers/nylas.js";
import { isMessageFacts, type CursorRange, type Cursors, type MessageFacts } from "./providers/seam.js";
import { judgeAutomated } from "./automated.js";
import { MAILBOX_ADDRESSES_ENV, OutgoingRules, SENT_FOLDERS_ENV } from "./outgoing.js";

export const DEFAULT_TARGET = "127.0.0.1:50051";
export const PRINCIPAL_METADATA = "x-inbox-principal";
export const PRINCIPAL_KIND_METADATA = "x-inbox-principal-kind";

/** Every call is safe to repeat (its retries carry its request id); these codes say "try again". */
const RETRYABLE = new Set(["UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED"]);

/**
 * How calls are retried on UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED and CANCELLED, and on RESOURCE_EXHAUSTED that
 * carries a `retry-after-ms` hint. `attempts` counts the first try; the wait before retry n (from 0) is drawn
 * uniformly from [cap/2, cap] with cap = min(maxBackoffMs, initialBackoffMs * multiplier^n), and is never
 * shorter than the coordinator's hint. The Python client's RetryPolicy, in milliseconds.
 */
export interface RetryPolicy {
  attempts: number;
  initialBackoffMs: number;
  maxBackoffMs: number;
  multiplier: number;
}

export const DEFAULT_RETRY: RetryPolicy = { attempts: 6, initialBackoffMs: 100, maxBackoffMs: 2000, multiplier: 2 };

export interface CoordinatorOptions {
  /** HOST:PORT of the coordinator (default 127.0.0.1:50051), or an http:// / https:// URL. */
  target?: string;
  /** Development mode: the principal named in the `x-inbox-principal` metadata. */
  principal?: string;
  /** "agent" (default) or "human" (`x-inbox-principal-kind`). */
  kind?: HolderKind;
  /** A bearer token (`authorization: Bearer <token>`), for a coordinator with a token file. */
  token?: string;
  /** TLS with the system's roots (implied by the certificate options). */
  tls?: boolean;
  /** PEM of the CA that signed the coordinator's certificate. */
  rootCertificates?: string | Buffer;
  /** Mutual TLS: this client's certificate chain and key (PEM), both or neither. */
  clientCertificate?: string | Buffer;
  clientKey?: string | Buffer;
  /** The deadline of each attempt of each call (default 10 000 ms). */
  timeoutMs?: number;
  retry?: Partial<RetryPolicy>;
  /** Concurrent calls sent together in one Batch RPC, at most (1..256, default 64); 1 sends every call alone. */
  maxBatch?: number;
  /**
   * How replyTo tells a message the mailbox sent (never answered, reported with recordOutgoing) from one it
   * received: folder ids of sent mail besides Google's SENT (Microsoft, IMAP: Nylas.sentFolderIds), as strings
   * or one comma-separated string. Default: the environment variable INBOX_SENT_FOLDERS.
   */
  sentFolders?: string | readonly string[];
  /** The mailbox's own addresses (a message from one is outgoing). Default: INBOX_MAILBOX_ADDRESSES. */
  mailboxAddresses?: string | readonly string[];
  /** Where the guard's log lines go (why a notification was not handed to your work); default: console. */
  logger?: { info(message: string): void };
  /**
   * "grpc" (default): gRPC over HTTP/2 to the coordinator's gRPC port. "http-json": the coordinator's HTTP/JSON
   * face (its --http-listen port; the Connect protocol with JSON bodies over HTTP/1.1), where only HTTP/1.1 gets
   * through (a proxy, a gateway). The same calls, errors and traces either way (docs/node.md#over-http-json).
   */
  protocol?: "grpc" | "http-json";
}

/** A raw Nylas envelope as JSON.parse gives it (replyTo parses it), told from a parsed Notification and a ReplyTarget. */
export type Envelope = Readonly<Record<string, unknown>> & { readonly type: unknown; readonly data: unknown };

export interface ClaimOptions {
  /** Seconds; 0 (default) is the server's default TTL. */
  ttl?: number;
  /** The notification's id: delivery dedup and claim in one call. */
  notificationId?: string;
  /** Shown to the people watching the mailbox. */
  note?: string;
  /** Which email it is (subject line, sender, received time), shown to the people watching the mailbox. */
  summary?: MessageSummary;
  /**
   * The message's thread and when it was received (both or neither, as the provider says): a reply written
   * outside the coordinator in that thread afterwards ends the claim.
   */
  threadId?: string;
  receivedAt?: Date;
  /**
   * The sender's address (`ana@example.com`), for the agents' reply budget per correspondent
   * (docs/design.md#reply-storms); compared without case, up to 320 bytes. Empty: only the thread's budget applies.
   */
  correspondent?: string;
}

/** RecordIncoming's options. */
export interface IncomingOptions {
  /** The delivery's dedup key (the notification id). */
  notificationId?: string;
  /** Which email it is, shown to people. */
  summary?: MessageSummary;
  /** Why agents leave it ("Auto-Submitted: auto-replied"); empty: a customer's message (found by looking before a send). */
  automated?: string;
}

/** RecordOutgoing's options. */
export interface OutgoingOptions {
  /** "Name <address>", as the message's From says. */
  sender?: string;
  /** The delivery's dedup key (the notification id). */
  notificationId?: string;
  /**
   * The fencing token of the claim stamp the message carries (docs/providers.md, "The claim stamp"): a SENDING or
   * IN_DOUBT send of its thread with that token is settled by it (REPLIED, with this message's id).
   */
  claimToken?: bigint;
}

export interface Op<R> {
  readonly method: string;
  readonly request: Message;
  readonly decode: (response: Message) => R;
}

export function newRequestId(): string {
  return randomUUID().replaceAll("-", "");
}

/** An enum value's name (TAKEN, COVERED...), refusing the values this client does not know. */
function enumLabel(values: Record<number, string>, value: number): string {
  const name = values[value];
  if (name === undefined || name.endsWith("UNSPECIFIED")) throw new Error(`the coordinator sent ${value}, unknown to this client`);
  return name;
}

function ttlSecondsOf(ttl: number): number {
  if (!Number.isInteger(ttl) || ttl < 0) throw new RangeError(`a cursor range's ttlSeconds must be a whole number of seconds (0: the coordinator's 60), not ${ttl}`);
  return ttl;
}

function ttlSeconds(ttl: number): number {
  if (!Number.isInteger(ttl) || ttl < 0) {
    throw new RangeError(`ttl must be a whole number of seconds >= 0 (0 means the server's default), not ${ttl}`);
  }
  return ttl;
}

function fencingToken(token: bigint): bigint {
  if (typeof token !== "bigint" || token <= 0n) {
    throw new RangeError(`fencing token must be a positive bigint (the one a claim granted), not ${String(token)}`);
  }
  return token;
}

function asciiMetadata(name: string, value: string): string {
  if (!value || !/^[\x20-\x7e]+$/.test(value)) {
    throw new TypeError(`${name} must be non-empty printable ASCII (it travels in gRPC metadata), not ${JSON.stringify(value)}`);
  }
  return value;
}

function isLoopback(host: string): boolean {
  const bare = host.replace(/^\[|\]$/g, "");
  if (bare === "localhost") return true;
  if (isIP(bare) === 4) return bare.startsWith("127.");
  return bare === "::1";
}

const lowerFirst = (name: string): string => name.charAt(0).toLowerCase() + name.slice(1);

/**
 * The environment variables a client is configured by, the same as the Python client's `from_env()` and
 * `inboxctl` read (clients/python/inbox_claims/_settings.py): one set of names for every agent and tool.
 */
export const ENVIRONMENT = {
  target: "INBOX_COORDINATOR_TARGET",
  principal: "INBOX_PRINCIPAL",
  kind: "INBOX_PRINCIPAL_KIND",
  token: "INBOX_TOKEN",
  tls: "INBOX_TLS",
  caFile: "INBOX_CA_FILE",
  certFile: "INBOX_CERT_FILE",
  keyFile: "INBOX_KEY_FILE",
  callTimeout: "INBOX_CALL_TIMEOUT",
} as const;

/** The per-call timeout fromEnv() gives when INBOX_CALL_TIMEOUT is unset (the Python client's from_env default). */
/** The coordinator's limit on ClaimReply's correspondent (CORRESPONDENT_MAX_BYTES). */
export const CORRESPONDENT_MAX_BYTES = 320;

export const ENV_DEFAULT_TIMEOUT_MS = 5_000;

function readPem(path: string, variable: string): Buffer {
  try {
    return readFileSync(path);
  } catch (error) {
    throw new TypeError(`cannot read ${variable}=${path}: ${(error as NodeJS.ErrnoException).code ?? String(error)}`);
  }
}

/** The options fromEnv() takes from `env` (an empty variable counts as unset). */
export function optionsFromEnv(env: Record<string, string | undefined> = process.env): CoordinatorOptions {
  const get = (name: string): string | undefined => env[name] || undefined;
  const options: CoordinatorOptions = { target: get(ENVIRONMENT.target) ?? DEFAULT_TARGET };
  const principal = get(ENVIRONMENT.principal);
  if (principal !== undefined) options.principal = principal;
  const kind = get(ENVIRONMENT.kind) ?? "agent"; // inboxctl's default is a person at a terminal; this is an agent
  if (kind !== "agent" && kind !== "human") throw new TypeError(`${ENVIRONMENT.kind} must be "agent" or "human", not ${JSON.stringify(kind)}`);
  options.kind = kind;
  const token = get(ENVIRONMENT.token);
  if (token !== undefined) options.token = token;
  const tls = get(ENVIRONMENT.tls);
  if (tls !== undefined) options.tls = ["1", "true", "yes", "on"].includes(tls.toLowerCase());
  const ca = get(ENVIRONMENT.caFile), cert = get(ENVIRONMENT.certFile), key = get(ENVIRONMENT.keyFile);
  if (ca !== undefined) options.rootCertificates = readPem(ca, ENVIRONMENT.caFile);
  if (cert !== undefined) options.clientCertificate = readPem(cert, ENVIRONMENT.certFile);
  if (key !== undefined) options.clientKey = readPem(key, ENVIRONMENT.keyFile);
  const seconds = get(ENVIRONMENT.callTimeout);
  if (seconds === undefined) options.timeoutMs = ENV_DEFAULT_TIMEOUT_MS;
  else {
    const parsed = Number(seconds);
    if (!(parsed > 0)) throw new TypeError(`${ENVIRONMENT.callTimeout} must be a number of seconds, not ${JSON.stringify(seconds)}`);
    options.timeoutMs = parsed * 1000;
  }
  return options;
}

/** A client of the Inbox Coordinator. One per process is enough: concurrent calls share Batch RPCs. Call close() when done. */
export class Coordinator {
  /**
   * A client configured by the environment, as the Python client's `AsyncCoordinator.from_env()`:
   * INBOX_COORDINATOR_TARGET (default 127.0.0.1:50051), INBOX_TOKEN (a bearer token) or, in development mode,
   * INBOX_PRINCIPAL (with INBOX_PRINCIPAL_KIND, default "agent"), INBOX_TLS, INBOX_CA_FILE, INBOX_CERT_FILE,
   * INBOX_KEY_FILE, INBOX_CALL_TIMEOUT (seconds per call, default 5). `overrides` win over them. Throws, naming
   * the variables to set, when neither INBOX_TOKEN nor INBOX_PRINCIPAL says who the client is.
   */
  static fromEnv(overrides: CoordinatorOptions = {}, env: Record<string, string | undefined> = process.env): Coordinator {
    const options = { ...optionsFromEnv(env), ...overrides };
    if (options.principal === undefined && options.token === undefined) {
      throw new TypeError(
        `Coordinator.fromEnv() found no identity: set ${ENVIRONMENT.token} (a bearer token) or, in development mode, ${ENVIRONMENT.principal} (the agent's name)`,
      );
    }
    return new Coordinator(options);
  }

  readonly target: string;
  readonly principal: string | undefined;
  readonly kind: HolderKind;
  readonly timeoutMs: number;
  readonly retry: RetryPolicy;
  readonly maxBatch: number;
  /** How replyTo tells outgoing messages (sentFolders, mailboxAddresses). */
  readonly outgoing: OutgoingRules;
  readonly logger: { info(message: string): void };
  private readonly headers: Record<string, string> = {};
  private readonly sessions: Http2SessionManager;
  private readonly client: Client<typeof pb.Coordinator>;
  private readonly coalescer: Coalescer;
  private flushScheduled = false;
  private closed = false;

  constructor(options: CoordinatorOptions = {}) {
    this.target = options.target ?? DEFAULT_TARGET;
    this.principal = options.principal;
    this.kind = options.kind ?? "agent";
    if (this.kind !== "agent" && this.kind !== "human") throw new TypeError(`kind must be "agent" or "human", not ${JSON.stringify(this.kind)}`);
    this.timeoutMs = Math.ceil(options.timeoutMs ?? 10_000);
    if (!(this.timeoutMs > 0)) throw new RangeError(`timeoutMs must be a positive number of milliseconds, not ${this.timeoutMs}`);
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    if (!(this.retry.attempts >= 1) || this.retry.initialBackoffMs < 0 || this.retry.maxBackoffMs < this.retry.initialBackoffMs || this.retry.multiplier < 1) {
      throw new RangeError("retry needs attempts >= 1, 0 <= initialBackoffMs <= maxBackoffMs and multiplier >= 1");
    }
    this.outgoing = new OutgoingRules(options.sentFolders ?? process.env[SENT_FOLDERS_ENV], options.mailboxAddresses ?? process.env[MAILBOX_ADDRESSES_ENV]);
    this.logger = options.logger ?? console;
    this.maxBatch = options.maxBatch ?? 64;
    if (!Number.isInteger(this.maxBatch) || this.maxBatch < 1 || this.maxBatch > BATCH_MAX_CALLS) {
      throw new RangeError(`maxBatch must be 1..${BATCH_MAX_CALLS} (the coordinator's limit per batch), not ${this.maxBatch}`);
    }
    if ((options.clientCertificate === undefined) !== (options.clientKey === undefined)) {
      throw new TypeError("mutual TLS needs both clientCertificate and clientKey (PEM)");
    }
    const wantsTls = options.tls === true || options.rootCertificates !== undefined || options.clientCertificate !== undefined;
    let url: URL;
    if (/^https?:\/\//.test(this.target)) url = new URL(this.target);
    else if (this.target) url = new URL(`${wantsTls ? "https" : "http"}://${this.target}`);
    else throw new TypeError("target must be HOST:PORT, e.g. '127.0.0.1:50051'");
    if (this.principal !== undefined) {
      this.headers[PRINCIPAL_METADATA] = asciiMetadata("principal", this.principal);
      this.headers[PRINCIPAL_KIND_METADATA] = this.kind;
    }
    if (options.token !== undefined) {
      this.headers["authorization"] = "Bearer " + asciiMetadata("token", options.token);
      if (url.protocol === "http:" && !isLoopback(url.hostname)) {
        process.emitWarning(`sending a bearer token to ${this.target} over a plaintext channel; pass tls: true`);
      }
    }
    const nodeOptions =
      url.protocol === "https:"
        ? { ca: options.rootCertificates, cert: options.clientCertificate, key: options.clientKey }
        : {};
    // No HTTP/2 keepalive pings (the Python client sends none either): a gRPC server allows one ping per 5 minutes
    // on a connection without data by default and answers more with GOAWAY ENHANCE_YOUR_CALM, which would end
    // a quiet Watch stream.
    this.sessions = new Http2SessionManager(url, {}, nodeOptions);
    const baseUrl = url.toString().replace(/\/$/, "");
    const protocol = options.protocol ?? "grpc";
    if (protocol !== "grpc" && protocol !== "http-json") throw new TypeError(`protocol must be "grpc" or "http-json", not ${JSON.stringify(protocol)}`);
    const transport =
      protocol === "grpc"
        ? createGrpcTransport({ baseUrl, sessionManager: this.sessions })
        : createConnectTransport({ baseUrl, httpVersion: "1.1", useBinaryFormat: false, nodeOptions });
    this.client = createClient(pb.Coordinator, transport);
    this.coalescer = new Coalescer(this.maxBatch);
  }

  /** Closes the connection. Claims still open stop renewing (their renewal fails) and expire by TTL. */
  close(): void {
    this.closed = true;
    this.sessions.abort();
  }

  // -- the retry loop ------------------------------------------------------------------------------------

  /**
   * Runs `op` with retries (the same request, so the same request id). `deadline` (a performance.now() value)
   * bounds every attempt and the waits. `parent`: the guard's span the call is made for (else the active span).
   */
  async call<R>(op: Op<R>, deadline?: number, parent?: GuardSpan): Promise<R> {
    const span = callStarted(op.method, op.request, parent);
    try {
      for (let attempt = 1; ; attempt++) {
        let timeoutMs = this.timeoutMs;
        // grpc-timeout takes whole units: a fractional millisecond count is refused by the server (INTERNAL).
        if (deadline !== undefined) timeoutMs = Math.max(Math.floor(Math.min(timeoutMs, deadline - performance.now())), 1);
        let response: Message;
        try {
          response = await this.perform({ method: op.method, request: op.request, timeoutMs, headers: span?.headers });
        } catch (error) {
          if (!(error instanceof RpcFailure)) throw error;
          const delay = this.retryDelay(error, attempt, deadline);
          if (delay === undefined) {
            span?.failed(error.code, attempt);
            throw error.error(op.method, attempt);
          }
          span?.retrying(error.code, attempt, delay);
          await sleep(delay);
          continue;
        }
        span?.answered(response);
        return op.decode(response);
      }
    } finally {
      span?.end();
    }
  }

  /** Milliseconds to wait before trying again after `attempt` failed attempts; undefined: give up. */
  retryDelay(failure: RpcFailure, attempt: number, deadline?: number): number | undefined {
    const policy = this.retry;
    const retryable = RETRYABLE.has(failure.code) || (failure.code === "RESOURCE_EXHAUSTED" && failure.retryAfterMs !== undefined);
    if (!retryable || attempt >= policy.attempts) return undefined;
    const cap = Math.min(policy.maxBackoffMs, policy.initialBackoffMs * policy.multiplier ** Math.min(attempt - 1, 64));
    const delay = Math.max(cap / 2 + Math.random() * (cap / 2), failure.retryAfterMs ?? 0);
    if (deadline !== undefined && performance.now() + delay >= deadline) return undefined;
    return delay;
  }

  // -- one attempt: alone, or with the calls made at the same time -------------------------------------

  private perform(rpc: Rpc): Promise<Message> {
    if (this.closed) return Promise.reject(new Error("this Coordinator is closed; make a new one"));
    if (this.maxBatch > 1 && BATCHABLE.has(rpc.method) && this.coalescer.supported) return this.batched(rpc);
    return this.unary(rpc);
  }

  private async unary(rpc: Rpc): Promise<Message> {
    const method = (this.client as unknown as Record<string, (request: Message, options: object) => Promise<Message>>)[lowerFirst(rpc.method)];
    if (method === undefined) throw new TypeError(`no RPC ${rpc.method}`);
    try {
      const headers = rpc.headers === undefined ? this.headers : { ...this.headers, ...rpc.headers };
      return await method(rpc.request, { timeoutMs: rpc.timeoutMs, headers });
    } catch (error) {
      throw RpcFailure.from(error);
    }
  }

  private async batched(rpc: Rpc): Promise<Message> {
    const answer = await new Promise<Message | typeof RESEND>((resolve, reject) => {
      this.coalescer.add(rpc, { resolve, reject });
      this.flushSoon();
    });
    return answer === RESEND ? this.unary(rpc) : answer;
  }

  private flushSoon(): void {
    // After the current turn's promise callbacks, not now: the callers woken together by the last batch's
    // answers all get to queue their next call first, and go in one batch rather than one alone and the rest.
    if (this.flushScheduled) return;
    this.flushScheduled = true;
    setImmediate(() => {
      this.flushScheduled = false;
      for (let batch = this.coalescer.nextBatch(); batch !== undefined; batch = this.coalescer.nextBatch()) {
        void this.sendBatch(batch);
      }
    });
  }

  private async sendBatch(batch: [Rpc, { resolve(value: Message | typeof RESEND): void; reject(error: unknown): void }][]): Promise<void> {
    const calls = batch.map(([rpc]) => rpc);
    let results: (Message | RpcFailure | typeof RESEND)[];
    try {
      results = answers(calls, await this.unary(batchOf(calls)));
    } catch (error) {
      results = error instanceof RpcFailure ? this.coalescer.failed(calls, error) : calls.map(() => error as RpcFailure);
    } finally {
      this.coalescer.finished();
      if (this.coalescer.pending.length > 0) this.flushSoon();
    }
    batch.forEach(([, waiter], index) => {
      const result = results[index];
      if (result instanceof Error) waiter.reject(result);
      else waiter.resolve(result as Message | typeof RESEND);
    });
  }

  // -- operations (the guard builds these once and runs them with call(), keeping their request ids) -----

  claimOp(subject: Subject, options: ClaimOptions = {}): Op<ClaimResult> & { subject: Subject } {
    const request = create(pb.ClaimReplyRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      notificationId: options.notificationId ?? "",
      ttlSeconds: ttlSeconds(options.ttl ?? 0),
      note: options.note ?? "",
      summary: summaryToPb(options.summary),
      threadId: options.threadId ?? "",
      receivedAt: options.receivedAt === undefined ? undefined : timestampFromDate(options.receivedAt),
      correspondent: options.correspondent ?? "",
    });
    return { method: "ClaimReply", request, decode: (r) => claimResultFromPb(r as pb.ClaimReplyResponse), subject };
  }

  recordOutgoingOp(mailbox: string, messageId: string, threadId: string, sentAt: Date, options: OutgoingOptions = {}): Op<OutgoingResult> {
    const request = create(pb.RecordOutgoingRequestSchema, {
      requestId: newRequestId(),
      mailbox,
      notificationId: options.notificationId ?? "",
      messageId,
      threadId,
      sentAt: timestampFromDate(sentAt),
      sender: options.sender ?? "",
      claimToken: options.claimToken ?? 0n,
    });
    return { method: "RecordOutgoing", request, decode: (r) => outgoingFromPb(r as pb.RecordOutgoingResponse) };
  }

  recordIncomingOp(mailbox: string, messageId: string, threadId: string, receivedAt: Date, options: IncomingOptions = {}): Op<IncomingResult> {
    const request = create(pb.RecordIncomingRequestSchema, {
      requestId: newRequestId(),
      mailbox,
      notificationId: options.notificationId ?? "",
      messageId,
      threadId,
      receivedAt: timestampFromDate(receivedAt),
      summary: summaryToPb(options.summary),
      automated: options.automated ?? "",
    });
    return { method: "RecordIncoming", request, decode: (r) => incomingFromPb(r as pb.RecordIncomingResponse) };
  }

  renewOp(subject: Subject, token: bigint, ttl = 0): Op<FenceResult> {
    const request = create(pb.RenewClaimRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      fencingToken: fencingToken(token),
      ttlSeconds: ttlSeconds(ttl),
    });
    return { method: "RenewClaim", request, decode: (r) => fenceFromPb(r as pb.RenewClaimResponse) };
  }

  releaseOp(subject: Subject, token: bigint, redeliverable = false): Op<FenceResult> {
    const request = create(pb.ReleaseClaimRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      fencingToken: fencingToken(token),
      redeliverable,
    });
    return { method: "ReleaseClaim", request, decode: (r) => fenceFromPb(r as pb.ReleaseClaimResponse) };
  }

  beginSendOp(subject: Subject, token: bigint): Op<FenceResult> {
    const request = create(pb.BeginSendRequestSchema, { requestId: newRequestId(), subject: subjectToPb(subject), fencingToken: fencingToken(token) });
    return { method: "BeginSend", request, decode: (r) => fenceFromPb(r as pb.BeginSendResponse) };
  }

  confirmSentOp(subject: Subject, token: bigint, sentMessageId = ""): Op<FenceResult> {
    const request = create(pb.ConfirmSentRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      fencingToken: fencingToken(token),
      sentMessageId,
    });
    return { method: "ConfirmSent", request, decode: (r) => fenceFromPb(r as pb.ConfirmSentResponse) };
  }

  markRepliedOp(subject: Subject, token: bigint, sentMessageId = "", note = ""): Op<FenceResult> {
    const request = create(pb.MarkRepliedRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      fencingToken: fencingToken(token),
      sentMessageId,
      note,
    });
    return { method: "MarkReplied", request, decode: (r) => fenceFromPb(r as pb.MarkRepliedResponse) };
  }

  abortSendOp(subject: Subject, token: bigint, reason = "", redeliverable = false): Op<FenceResult> {
    const request = create(pb.AbortSendRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      fencingToken: fencingToken(token),
      reason,
      redeliverable,
    });
    return { method: "AbortSend", request, decode: (r) => fenceFromPb(r as pb.AbortSendResponse) };
  }

  // -- the RPCs --------------------------------------------------------------------------------------------

  /** Delivery dedup on its own: isNew on the first sighting. Prefer replyTo, which dedups and claims in one call. */
  recordDelivery(mailbox: string, notificationId: string): Promise<DeliveryResult> {
    const request = create(pb.RecordDeliveryRequestSchema, { requestId: newRequestId(), mailbox, notificationId });
    return this.call({ method: "RecordDelivery", request, decode: (r) => deliveryResultFromPb(r as pb.RecordDeliveryResponse) });
  }

  /** ClaimReply: GRANTED, HELD, ALREADY_REPLIED or DUPLICATE_DELIVERY; nothing is renewed for you (agents use replyTo). */
  claim(subject: Subject, options: ClaimOptions = {}): Promise<ClaimResult> {
    return this.call(this.claimOp(subject, options));
  }

  /**
   * RecordOutgoing: a message the mailbox sent (in a sent folder, or from one of its own addresses). The
   * coordinator answers whether it is the mailbox's own reply (OWN_REPLY) or one written outside it
   * (ANSWERED_OUTSIDE: it ended the claims on the messages of its thread received at or before `sentAt`).
   * replyTo calls it for you on every outgoing notification; never answer such a message.
   */
  recordOutgoing(mailbox: string, messageId: string, threadId: string, sentAt: Date, options: OutgoingOptions = {}): Promise<OutgoingResult> {
    return this.call(this.recordOutgoingOp(mailbox, messageId, threadId, sentAt, options));
  }

  /**
   * RecordIncoming (role `report`): an inbound message nobody claims (docs/design.md#reply-storms): automated mail
   * agents leave (`automated` says why, shown to people), or a customer's newer message found by looking at the
   * thread before a send. A claim on an older message of the thread then gets BeginSend REFUSED
   * (ConversationMovedOn). replyTo calls it for you on every automated message.
   */
  recordIncoming(mailbox: string, messageId: string, threadId: string, receivedAt: Date, options: IncomingOptions = {}): Promise<IncomingResult> {
    return this.call(this.recordIncomingOp(mailbox, messageId, threadId, receivedAt, options));
  }

  renew(subject: Subject, token: bigint, ttl = 0): Promise<FenceResult> {
    return this.call(this.renewOp(subject, token, ttl));
  }

  release(subject: Subject, token: bigint, options: { redeliverable?: boolean } = {}): Promise<FenceResult> {
    return this.call(this.releaseOp(subject, token, options.redeliverable ?? false));
  }

  beginSend(subject: Subject, token: bigint): Promise<FenceResult> {
    return this.call(this.beginSendOp(subject, token));
  }

  confirmSent(subject: Subject, token: bigint, sentMessageId = ""): Promise<FenceResult> {
    return this.call(this.confirmSentOp(subject, token, sentMessageId));
  }

  /**
   * MarkReplied: the holder answered without the coordinator (in a mail client, by phone): CLAIMED becomes
   * REPLIED, so later claims answer ALREADY_REPLIED. Fenced like beginSend (ok false: not yours any more).
   */
  markReplied(subject: Subject, token: bigint, options: { sentMessageId?: string; note?: string } = {}): Promise<FenceResult> {
    return this.call(this.markRepliedOp(subject, token, options.sentMessageId ?? "", options.note ?? ""));
  }

  abortSend(subject: Subject, token: bigint, reason = "", options: { redeliverable?: boolean } = {}): Promise<FenceResult> {
    return this.call(this.abortSendOp(subject, token, reason, options.redeliverable ?? false));
  }

  /** GetCaller: who the coordinator takes this client's credentials to be (principal, kind, roles, mailboxes). */
  caller(): Promise<CallerIdentity> {
    return this.call({ method: "GetCaller", request: create(pb.GetCallerRequestSchema), decode: (r) => callerFromPb(r as pb.GetCallerResponse) });
  }

  status(subject: Subject): Promise<SubjectStatus> {
    const request = create(pb.GetStatusRequestSchema, { subject: subjectToPb(subject) });
    return this.call({ method: "GetStatus", request, decode: (r) => statusFromPb((r as pb.GetStatusResponse).status) });
  }

  listClaims(mailbox: string, options: { states?: SubjectState[]; pageSize?: number; pageToken?: string } = {}): Promise<ClaimsPage> {
    const request = create(pb.ListClaimsRequestSchema, {
      mailbox,
      states: (options.states ?? []).map(stateToPb),
      pageSize: options.pageSize ?? 0,
      pageToken: options.pageToken ?? "",
    });
    return this.call({ method: "ListClaims", request, decode: (r) => pageFromPb(r as pb.ListClaimsResponse) });
  }

  /** Every subject listClaims would list, page after page (each page read at its own revision). */
  async *iterClaims(mailbox: string, options: { states?: SubjectState[]; pageSize?: number } = {}): AsyncGenerator<SubjectStatus> {
    let pageToken = "";
    do {
      const page = await this.listClaims(mailbox, { ...options, pageToken });
      yield* page.subjects;
      pageToken = page.nextPageToken;
    } while (pageToken);
  }

  /**
   * Watch: a snapshot of the mailbox, then an event for every transition, until you stop iterating (or
   * `signal` aborts). With `reconnect` (the default) a stream that ends with UNAVAILABLE (the coordinator
   * restarted, or lost its etcd watch) is opened again with the retry policy's backoff, and resumes after the
   * revision of the last snapshot or event received: the events missed meanwhile arrive, without a new
   * snapshot (one comes only when etcd no longer has that revision, so be ready for one). Every item received
   * renews the retry budget.
   */
  async *watch(mailbox: string, options: { reconnect?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<WatchItem> {
    let revision = 0n; // of the last snapshot or event received: a reconnection resumes after it
    let failures = 0;
    for (;;) {
      const request = create(pb.WatchRequestSchema, { mailbox, afterRevision: revision });
      try {
        for await (const message of this.client.watch(request, { headers: this.headers, signal: options.signal })) {
          failures = 0;
          const item = watchItemFromPb(message);
          revision = item.revision;
          yield item;
        }
        return;
      } catch (error) {
        if (options.signal?.aborted) return;
        const failure = RpcFailure.from(error);
        failures += 1;
        const delay = options.reconnect === false ? undefined : this.retryDelay(failure, failures);
        if (delay === undefined) throw failure.error("Watch", failures);
        await sleep(delay);
      }
    }
  }

  // -- cursors (docs/design.md#cursors): what the providers' batches take and advance ----------------------

  /** GetCursor: a mailbox's named cursor (its value and position) and the range in progress, if any. */
  getCursor(mailbox: string, name: string): Promise<{ value: string; position: bigint; range: { holder: string; expiresAt: Date | undefined; token: bigint } | undefined }> {
    const request = create(pb.GetCursorRequestSchema, { mailbox, name });
    return this.call({
      method: "GetCursor",
      request,
      decode: (r) => {
        const response = r as pb.GetCursorResponse;
        const range = response.range;
        return {
          value: response.value,
          position: response.position,
          range: range === undefined ? undefined : { holder: range.holder, expiresAt: range.expiresAt === undefined ? undefined : timestampDate(range.expiresAt), token: range.rangeToken },
        };
      },
    });
  }

  /** TakeCursorRange: TAKEN (this worker's range, on a lease of `ttlSeconds`), COVERED (at or past `throughPosition`) or BUSY. */
  takeCursorRange(mailbox: string, name: string, throughPosition: bigint, ttlSeconds: number): Promise<CursorRange> {
    const request = create(pb.TakeCursorRangeRequestSchema, { requestId: newRequestId(), mailbox, name, throughPosition, ttlSeconds: ttlSecondsOf(ttlSeconds) });
    return this.call({
      method: "TakeCursorRange",
      request,
      decode: (r) => {
        const response = r as pb.TakeCursorRangeResponse;
        const expiresAt = response.busy?.expiresAt;
        return {
          outcome: enumLabel(pb.TakeCursorRangeResponse_Result, response.result) as CursorRange["outcome"],
          value: response.value,
          position: response.position,
          token: response.rangeToken,
          holder: response.busy?.holder ?? "",
          expiresInMs: expiresAt === undefined ? 0 : Math.max(timestampDate(expiresAt).getTime() - Date.now(), 0),
        };
      },
    });
  }

  /** AdvanceCursor: moves the cursor to the end of a range this worker still holds (false: STALE_RANGE, not moved). */
  advanceCursor(mailbox: string, name: string, taken: CursorRange, value: string, position: bigint): Promise<boolean> {
    const request = create(pb.AdvanceCursorRequestSchema, { requestId: newRequestId(), mailbox, name, rangeToken: taken.token, value, position });
    return this.call({ method: "AdvanceCursor", request, decode: (r) => (r as pb.AdvanceCursorResponse).result === pb.AdvanceCursorResponse_Result.OK });
  }

  /** This client's cursors as the provider seam takes them (a provider's open() reads and moves them). */
  get cursors(): Cursors {
    return {
      take: (mailbox, name, throughPosition, ttlSeconds) => this.takeCursorRange(mailbox, name, throughPosition, ttlSeconds),
      advance: (mailbox, name, taken, value, position) => this.advanceCursor(mailbox, name, taken, value, position),
    };
  }

  /** Takeover (humans only): the agent's token goes stale at once and the caller holds the subject. */
  takeover(subject: Subject, options: { ttl?: number; note?: string; summary?: MessageSummary } = {}): Promise<TakeoverResult> {
    const request = create(pb.TakeoverRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      ttlSeconds: ttlSeconds(options.ttl ?? 0),
      note: options.note ?? "",
      summary: summaryToPb(options.summary),
    });
    return this.call({ method: "Takeover", request, decode: (r) => takeoverFromPb(r as pb.TakeoverResponse) });
  }

  /** ResolveInDoubt: after someone checked the sent folder, sent: true records REPLIED, false frees the subject. */
  resolveInDoubt(subject: Subject, options: { sent: boolean; sentMessageId?: string; note?: string }): Promise<SubjectStatus> {
    const request = create(pb.ResolveInDoubtRequestSchema, {
      requestId: newRequestId(),
      subject: subjectToPb(subject),
      outcome: options.sent ? pb.ResolveInDoubtRequest_Outcome.SENT : pb.ResolveInDoubtRequest_Outcome.NOT_SENT,
      sentMessageId: options.sentMessageId ?? "",
      note: options.note ?? "",
    });
    return this.call({ method: "ResolveInDoubt", request, decode: (r) => statusFromPb((r as pb.ResolveInDoubtResponse).status) });
  }

  // -- the guard -------------------------------------------------------------------------------------------

  /**
   * A guarded claim on the message a notification is about, for as long as `work` runs:
   *
   *     await coord.replyTo(notification, { ttl: 60 }, async (claim) => {
   *       const draft = await writeReply(notification, { signal: claim.signal });
   *       await claim.send(() => nylas.send(grantId, reply, { idempotencyKey: claim.idempotencyKey }));
   *     });
   *
   * ONE ClaimReply records the delivery (the notification id) and claims the message (scope "thread": the
   * thread); a refusal rejects with DuplicateDelivery, ReplyHeld or AlreadyReplied (all ClaimNotGranted) and
   * `work` never runs. While `work` runs the claim is renewed every ttl/3; `claim.signal` aborts (reason: a
   * ClaimLost) when the claim is found lost or taken over. `claim.send(fn)` passes the fenced commit point.
   * When `work` returns without sending, the claim is released; when it throws, released as redeliverable
   * (a redelivery of the notification may claim again). Resolves to what `work` returned.
   */
  async replyTo<T>(target: Notification | Envelope | ReplyTarget | MessageFacts, options: ReplyOptions, work: (claim: Claim) => Promise<T>): Promise<T> {
    const claim = await this.admit(target, options);
    return claim.run(work);
  }

  /**
   * @internal replyTo's first half: the claim entered (its one ClaimReply made, or the outgoing message
   * reported and refused), renewed from now on, its work not started. The webhook adapters answer the provider
   * in between, so that no notification is acknowledged that nothing recorded. `deadline` (a performance.now()
   * value) bounds the call with its retries. Past the first lines it reads only the message's facts (a Nylas
   * notification's are the Nylas provider's), or the explicit target.
   */
  async admit(target: Notification | Envelope | ReplyTarget | MessageFacts, options: ReplyOptions, deadline?: number): Promise<Claim> {
    const given = isEnvelope(target) ? parseNotification(target) : target;
    let facts: MessageFacts | undefined;
    let explicit: ReplyTarget | undefined;
    if (isMessageFacts(given)) facts = given;
    else if ("objectKind" in given) {
      if (given.objectKind !== "message") throw new TypeError(`a ${given.type} notification is not about a message: there is nothing to reply to`);
      facts = factsOf(given);
      // A message notification without a message id can still name its thread (scope "thread").
      if (facts === undefined) explicit = { mailbox: given.mailbox ?? "", threadId: given.threadId, notificationId: given.notificationId };
    } else explicit = given;
    const { subject, notificationId } = resolveSubject(facts ?? explicit!, options.scope ?? "message", options.mailbox);
    const summary = options.summary ?? summaryOf(facts);
    // The thread and the message's date come from the facts (or, without them, from the target); without a
    // date, neither is sent (the coordinator needs both).
    const receivedAt = facts !== undefined ? facts.receivedAt : explicit!.receivedAt;
    const threadId = receivedAt === undefined ? undefined : (facts ?? explicit!).threadId;
    // An address over the coordinator's 320 bytes is no address (RFC 5321 allows 254): only the thread's budget then.
    const sender = facts !== undefined ? (facts.fromAddresses[0] ?? "") : (explicit!.correspondent ?? "");
    const correspondent = Buffer.byteLength(sender, "utf8") <= CORRESPONDENT_MAX_BYTES ? sender : "";
    const claim = new Claim(this, subject, notificationId, options.ttl ?? 60, options.note ?? "", summary, threadId, receivedAt, correspondent);
    if (facts !== undefined && options.provider !== undefined) claim.look = { facts, provider: options.provider };
    const why = facts === undefined ? undefined : (facts.outgoing ?? this.outgoing.judge(facts.folders, facts.fromAddresses));
    // A provider that could not read the headers (a Nylas notification without the API key): the sender's rules alone.
    const automated = facts === undefined ? undefined : (facts.automated ?? judgeAutomated(undefined, facts.fromAddresses[0]));
    if (facts !== undefined && why !== undefined) {
      const report =
        facts.messageId && threadId && receivedAt
          ? this.recordOutgoingOp(subject.mailbox, facts.messageId, threadId, receivedAt, {
              sender: cleanText(facts.sender, SUMMARY_TEXT_MAX_BYTES),
              notificationId,
              // The stamp is evidence of our send only on a message in the mailbox's sent mail: a From can be
              // forged, and so can a header (docs/design.md#providers).
              claimToken: why.rule === "sent_folder" ? (facts.stamp?.token ?? 0n) : 0n,
            })
          : undefined;
      claim.outgoing = { why, report };
    } else if (facts !== undefined && automated?.automated) {
      // Automated mail is recorded for the people watching (a person may still answer it), never claimed by an agent.
      const report =
        facts.messageId && threadId && receivedAt
          ? this.recordIncomingOp(subject.mailbox, facts.messageId, threadId, receivedAt, {
              notificationId,
              summary,
              automated: cleanText(automated.why, AUTOMATED_REASON_MAX_BYTES),
            })
          : undefined;
      claim.automated = { why: automated.why, report };
    }
    await claim.enter(deadline);
    return claim;
  }
}

function isEnvelope(target: object): target is Envelope {
  return "type" in target && "data" in target && !("objectKind" in target) && !isMessageFacts(target);
}
