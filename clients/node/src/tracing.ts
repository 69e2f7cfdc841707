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

/** The span of a call of `method` with `request`; undefined without @opentelemetry/api, or with nothing to record or continue. */
export function callStarted(method: string, request: Message): CallSpan | undefined {
  if (otel === undefined) return undefined;
  // A proxy until the application registers its provider, and that provider's tracer afterwards.
  tracer ??= otel.trace.getTracer("inbox-claims");
  const span = tracer.startSpan(`${SERVICE}/${method}`, { kind: otel.SpanKind.CLIENT });
  const context = span.spanContext();
  if (!otel.isSpanContextValid(context)) return undefined;
  if (span.isRecording()) {
    span.setAttributes({ "rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method, ...requestAttributes(request) });
  }
  const flags = (context.traceFlags & 0xff).toString(16).padStart(2, "0");
  const headers: Record<string, string> = { traceparent: `00-${context.traceId}-${context.spanId}-${flags}` };
  const state = context.traceState?.serialize();
  if (state) headers["tracestate"] = state;
  return new CallSpan(span, headers);
}
