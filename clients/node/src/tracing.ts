// The client's spans, when @opentelemetry/api is installed (an optional peer dependency: the application's own
// OpenTelemetry set-up brings it, and the tracer provider it registered is the one used). The Python client's
// inbox_claims._tracing, the same names: each call (its retries included) is one CLIENT span, named as the
// coordinator names its own (inbox.coordinator.v1.Coordinator/ClaimReply), the child of the active span; each
// retry is an event with its wait; its W3C trace context goes with every attempt (traceparent/tracestate
// metadata, or the BatchCall's fields in a Batch), so the coordinator's span of the call continues it
// (docs/operations.md#traces). Without @opentelemetry/api, or with no trace to record or continue: nothing.
import { createRequire } from "node:module";
import { createRegistry, isMessage, type Message } from "@bufbuild/protobuf";
import type * as OtelApi from "@opentelemetry/api";
import * as pb from "./gen/inbox/coordinator/v1/coordinator_pb.js";

const SERVICE = "inbox.coordinator.v1.Coordinator";

function load(): typeof OtelApi | undefined {
  try {
    // Synchronously, and the package's CommonJS build: @opentelemetry/api keeps its state (the registered
    // provider and context manager) on a global, shared with the ESM build the application imports.
    return createRequire(import.meta.url)("@opentelemetry/api") as typeof OtelApi;
  } catch {
    return undefined;
  }
}

/** @opentelemetry/api, or undefined when it is not installed. */
export const otel: typeof OtelApi | undefined = load();

const registry = createRegistry(pb.file_inbox_coordinator_v1_coordinator);

const snake = (name: string): string => name.replace(/(?<!^)(?=[A-Z])/g, "_").toUpperCase();

/** An enum field's value name without its type's prefix, lower-cased (SUBJECT_KIND_THREAD is "thread"). */
function enumLabel(message: Message, field: string): string | undefined {
  const schema = registry.getMessage(message.$typeName);
  const described = schema?.fields.find((candidate) => candidate.name === field);
  if (described?.fieldKind !== "enum") return undefined;
  const value = (message as unknown as Record<string, number>)[described.localName] ?? 0;
  const name = described.enum.values.find((candidate) => candidate.number === value)?.name;
  return name === undefined ? String(value) : name.replace(new RegExp(`^${snake(described.enum.name)}_`), "").toLowerCase();
}

/** The response's result as the coordinator's metrics label it ("granted", "stale_token"); "ok" without one. */
export function resultLabel(response: Message): string {
  return enumLabel(response, "result") ?? "ok";
}

const PLAIN_FIELDS: [string, string][] = [
  ["requestId", "inbox.request_id"],
  ["mailbox", "inbox.mailbox"],
  ["notificationId", "inbox.notification_id"],
  ["threadId", "inbox.thread_id"],
  ["messageId", "inbox.message_id"],
];

/** The span attributes of a request: the named fields only (never a summary, a fencing token or a credential). */
export function requestAttributes(request: Message): Record<string, string> {
  const fields = request as unknown as Record<string, unknown>;
  const attributes: Record<string, string> = {};
  for (const [field, attribute] of PLAIN_FIELDS) {
    const value = fields[field];
    if (typeof value === "string" && value) attributes[attribute] = value;
  }
  const subject = fields["subject"];
  if (isMessage(subject, pb.SubjectSchema)) {
    attributes["inbox.mailbox"] = subject.mailbox;
    attributes["inbox.subject.kind"] = enumLabel(subject, "kind") ?? "";
    attributes["inbox.subject.id"] = subject.id;
  }
  return attributes;
}

/** One call's span, and the metadata that carries its trace context. */
export class CallSpan {
  private done = false;

  constructor(
    private readonly span: OtelApi.Span,
    readonly headers: Readonly<Record<string, string>>,
  ) {}

  retrying(code: string, attempt: number, delayMs: number): void {
    this.span.addEvent("retry", { "rpc.grpc.status_code_name": code, "inbox.attempt": attempt, "inbox.retry_delay_ms": Math.round(delayMs * 10) / 10 });
  }

  answered(response: Message): void {
    this.span.setAttributes({ "inbox.result": resultLabel(response), "rpc.grpc.status_code": 0 });
    this.end();
  }

  failed(code: string, attempts: number): void {
    this.span.setAttributes({ "inbox.result": code.toLowerCase(), "inbox.attempts": attempts });
    this.span.setStatus({ code: 2, message: code }); // SpanStatusCode.ERROR
    this.end();
  }

  /** Ends the span, once (a call that ended without an answer ends it as it is). */
  end(): void {
    if (this.done) return;
    this.done = true;
    this.span.end();
  }
}

let tracer: OtelApi.Tracer | undefined;

// A proxy until the application registers its provider, and that provider's tracer afterwards.
const getTracer = (api: typeof OtelApi): OtelApi.Tracer => (tracer ??= api.trace.getTracer("inbox-claims"));

/** A span context's W3C trace context as headers (traceparent, and tracestate when it has one). */
function contextHeaders(context: OtelApi.SpanContext): Record<string, string> {
  const flags = (context.traceFlags & 0xff).toString(16).padStart(2, "0");
  const headers: Record<string, string> = { traceparent: `00-${context.traceId}-${context.spanId}-${flags}` };
  const state = context.traceState?.serialize();
  if (state) headers["tracestate"] = state;
  return headers;
}

/**
 * The span of a call of `method` with `request`; undefined without @opentelemetry/api, or with nothing to record or
 * continue. `parent`: the guard's span the call is made for (a renewal runs on its own), else the active span.
 */
export function callStarted(method: string, request: Message, parent?: GuardSpan): CallSpan | undefined {
  if (otel === undefined) return undefined;
  const span = getTracer(otel).startSpan(`${SERVICE}/${method}`, { kind: otel.SpanKind.CLIENT }, parent?.context);
  const context = span.spanContext();
  if (!otel.isSpanContextValid(context)) return undefined;
  if (span.isRecording()) {
    span.setAttributes({ "rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method, ...requestAttributes(request) });
  }
  return new CallSpan(span, contextHeaders(context));
}

// -- the guard's spans (docs/operations.md#traces, the Python client's inbox_claims._tracing) -----------------------

/**
 * A guard's span (a notification's, a reply's, an MCP tool call's) and the context that makes it the parent of what
 * runs for it. Only identifiers and outcomes are set on it: never a summary, a credential or a header's value.
 */
export class GuardSpan {
  private done = false;
  readonly context: OtelApi.Context;

  constructor(
    private readonly api: typeof OtelApi,
    readonly span: OtelApi.Span,
  ) {
    this.context = api.trace.setSpan(api.context.active(), span);
  }

  set(attributes: Record<string, string | number>): void {
    if (this.span.isRecording()) this.span.setAttributes(attributes);
  }

  event(name: string, attributes?: Record<string, string | number>): void {
    this.span.addEvent(name, attributes);
  }

  /** Runs `fn` with this span active (the user's spans, a provider's request beneath it). */
  active<T>(fn: () => T): T {
    return this.api.context.with(this.context, fn);
  }

  /** Ends the span, once, with its inbox.outcome; `error`: what ended it when it failed (its type only: a message may quote a summary). */
  end(outcome: string, error?: unknown): void {
    if (this.done) return;
    this.done = true;
    this.span.setAttribute("inbox.outcome", outcome);
    if (error !== undefined) failedBy(this.span, error);
    this.span.end();
  }
}

function failedBy(span: OtelApi.Span, error: unknown): void {
  const type = error instanceof Error ? error.constructor.name : typeof error;
  span.setAttribute("error.type", type);
  span.setStatus({ code: 2, message: type }); // SpanStatusCode.ERROR
}

function guardSpan(name: string, attributes: Record<string, string>): GuardSpan | undefined {
  if (otel === undefined) return undefined;
  const span = getTracer(otel).startSpan(name, { kind: otel.SpanKind.INTERNAL });
  if (!otel.isSpanContextValid(span.spanContext())) return undefined; // nothing to record or continue
  if (span.isRecording()) span.setAttributes(attributes);
  return new GuardSpan(otel, span);
}

/** The span of one guarded reply ("inbox reply"), the child of the active span (the notification's in the webhook adapters). */
export function replyStarted(subject: { mailbox: string; kind: string; id: string }, notificationId: string): GuardSpan | undefined {
  const attributes: Record<string, string> = { "inbox.mailbox": subject.mailbox, "inbox.subject.kind": subject.kind, "inbox.subject.id": subject.id };
  if (notificationId) attributes["inbox.notification_id"] = notificationId;
  return guardSpan("inbox reply", attributes);
}

/** The span of one webhook delivery ("inbox notification"), the child of the active span (a web framework's). */
export function notificationStarted(provider: string): GuardSpan | undefined {
  return guardSpan("inbox notification", { "inbox.provider": provider });
}

/** A delivery's outcome by the answer the provider gets (as the Python adapters say it). */
export function notificationOutcome(status: number): string {
  if (status < 300) return "acknowledged";
  if (status === 503) return "retry_later";
  return status < 500 ? "refused" : "failed";
}

/** Runs `fn` in a span beneath `parent` ("inbox send"), active meanwhile; a throw marks it failed, by its type only. */
export async function inChild<T>(parent: GuardSpan | undefined, name: string, fn: () => Promise<T>): Promise<T> {
  if (parent === undefined || otel === undefined) return fn();
  const api = otel;
  const span = getTracer(api).startSpan(name, { kind: api.SpanKind.INTERNAL }, parent.context);
  try {
    return await api.context.with(api.trace.setSpan(parent.context, span), fn);
  } catch (error) {
    failedBy(span, error);
    throw error;
  } finally {
    span.end();
  }
}

/** The active span's W3C trace context as HTTP headers, for a request to a provider; empty without one. */
export function traceHeaders(): Record<string, string> {
  if (otel === undefined) return {};
  const context = otel.trace.getActiveSpan()?.spanContext();
  return context !== undefined && otel.isSpanContextValid(context) ? contextHeaders(context) : {};
}
