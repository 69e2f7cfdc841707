// The language-neutral conformance vectors (conformance/*.json, docs/conformance.md): every case of every file,
// checked against this client. The Python client's tests (tests/client/test_conformance.py) run the same files,
// so neither client's tests ask the other for an expected value.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { REPO } from "../src/testing.js";
import { answers, BATCH_MAX_CALLS, MAX_BATCHES_IN_FLIGHT, type Rpc } from "../src/batch.js";
import { REASON_MAX_BYTES, resolveSubject, SUMMARY_TEXT_MAX_BYTES } from "../src/claim.js";
import { PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA } from "../src/client.js";
import { DEFAULT_ADMISSION_TIMEOUT_MS, DEFAULT_EVENTS, DEFAULT_MAX_BODY_BYTES } from "../src/middleware.js";
import { DEFAULT_API_BASE, MAX_IDEMPOTENCY_KEY_LENGTH, Nylas, SENT_ATTRIBUTE } from "../src/nylas.js";
import { MAILBOX_ADDRESSES_ENV, SENT_FOLDERS_ENV } from "../src/outgoing.js";
import { RETRY_AFTER_METADATA, RpcFailure } from "../src/rpc.js";
import * as pb from "../src/gen/inbox/coordinator/v1/coordinator_pb.js";
import {
  canonicalMessageId,
  cleanText,
  Coordinator,
  DEFAULT_RETRY,
  DEFAULT_SENT_FOLDERS,
  DEFAULT_TARGET,
  ENVIRONMENT,
  EnvelopeError,
  IDEMPOTENCY_KEY_PREFIX,
  idempotencyKey,
  judgeAutomated,
  MESSAGE_ID_WHITESPACE,
  messageSubject,
  NYLAS_SIGNATURE_HEADER,
  nylasChallengeResponse,
  optionsFromEnv,
  OutgoingRules,
  parseNotification,
  signNylas,
  signStandardWebhook,
  StatusCode,
  summaryOf,
  verifyNylasSignature,
  verifyStandardWebhook,
  WebhookVerificationError,
  type MessageSummary,
  type Notification,
  type OutgoingMatch,
  type RetryPolicy,
  type StatusCodeName,
  type SubjectKind,
} from "../src/index.js";

const DIR = join(REPO, "conformance");
const PROTO = readFileSync(join(REPO, "proto", "inbox", "coordinator", "v1", "coordinator.proto"), "utf8");
type Case = Record<string, unknown> & { name: string };

// -- idempotency_keys.json --------------------------------------------------------------------------------

interface KeyCase { mailbox: string; kind: SubjectKind; id: string; canonical: string; utf8: string; key: string }

// UTF-8 as Python's "surrogatepass" writes it: a 3-byte sequence may stand for a lone surrogate, which
// TextDecoder (and Buffer) would replace with U+FFFD.
function decodeSurrogatePass(bytes: Buffer): string {
  let text = "";
  for (let at = 0; at < bytes.length; ) {
    const lead = bytes[at]!;
    const length = lead < 0x80 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4;
    let codePoint = length === 1 ? lead : lead & (0xff >> (length + 1));
    for (let next = 1; next < length; next++) codePoint = (codePoint << 6) | (bytes[at + next]! & 0x3f);
    text += String.fromCodePoint(codePoint);
    at += length;
  }
  return text;
}

function idempotencyKeys(c: KeyCase): void {
  assert.match(c.key, /^ic1-[0-9a-f]{64}$/);
  assert.equal(idempotencyKey({ mailbox: c.mailbox, kind: c.kind, id: c.id }), c.key);
  // The spelled-out steps must agree with the key too: they are what a third client implements from.
  assert.match(c.utf8, /^(?:[0-9a-f]{2})*$/); // Buffer.from would stop quietly at the first bad digit
  const bytes = Buffer.from(c.utf8, "hex");
  assert.equal(decodeSurrogatePass(bytes), c.canonical);
  assert.equal(IDEMPOTENCY_KEY_PREFIX + createHash("sha256").update(bytes).digest("hex"), c.key);
  // JSON.stringify escapes a lone surrogate, where the key's JSON writes it as it is.
  if (!/\p{Surrogate}/u.test(c.canonical)) assert.equal(JSON.stringify([c.mailbox, c.kind, c.id]), c.canonical);
}

// -- webhook_signatures.json ------------------------------------------------------------------------------

interface SignatureCase {
  scheme: "nylas" | "standard_webhooks";
  operation: "sign" | "verify" | "challenge";
  outcome: "valid" | "rejected" | "misconfigured";
  message: string | null;
  secret?: string;
  body?: string;
  signature?: string | null;
  msg_id?: string;
  timestamp?: number;
  header?: string | null;
  headers?: Record<string, string>;
  now?: number;
  tolerance?: number | null;
  query?: Record<string, unknown>;
  answer?: string | null;
}

function outcomeOf(run: () => unknown): { outcome: SignatureCase["outcome"]; message: string | null; value: unknown } {
  try {
    return { outcome: "valid", message: null, value: run() };
  } catch (error) {
    if (error instanceof WebhookVerificationError) return { outcome: "rejected", message: error.message, value: undefined };
    if (error instanceof TypeError || error instanceof RangeError) return { outcome: "misconfigured", message: error.message, value: undefined };
    throw error;
  }
}

function webhookSignatures(c: SignatureCase): void {
  const body = (): Buffer => Buffer.from(c.body!, "utf8");
  let run: () => unknown;
  if (c.operation === "sign") {
    run = c.scheme === "nylas" ? () => signNylas(body(), c.secret!) : () => signStandardWebhook(body(), { msgId: c.msg_id!, timestamp: c.timestamp!, secret: c.secret! });
  } else if (c.operation === "verify") {
    run =
      c.scheme === "nylas"
        ? () => verifyNylasSignature(body(), c.header ?? undefined, c.secret!)
        : () => verifyStandardWebhook(body(), c.headers!, c.secret!, { now: c.now!, ...(c.tolerance === null ? {} : { toleranceSeconds: c.tolerance! }) });
  } else {
    assert.equal(c.scheme, "nylas");
    run = () => nylasChallengeResponse(c.query!);
  }
  const got = outcomeOf(run);
  assert.equal(got.outcome, c.outcome, got.message ?? "");
  assert.equal(c.message === null, c.outcome === "valid", "a message is given exactly for a failure");
  if (c.message !== null) assert.ok(got.message?.includes(c.message), `${JSON.stringify(got.message)} does not contain ${JSON.stringify(c.message)}`);
  if (c.operation === "sign") {
    assert.equal(got.value ?? null, c.signature);
    if (c.scheme === "nylas" && c.signature) verifyNylasSignature(body(), c.signature, c.secret!);
  }
  if (c.operation === "challenge") assert.equal(got.value ?? null, c.answer);
}

// -- notifications.json and summaries.json ----------------------------------------------------------------

function summaryJson(summary: MessageSummary | undefined): unknown {
  if (summary === undefined) return null;
  return { subject_line: summary.subjectLine ?? "", sender: summary.sender ?? "", received_at: summary.receivedAt === undefined ? null : summary.receivedAt.getTime() / 1000 };
}

function notificationJson(n: Notification): unknown {
  return {
    notification_id: n.notificationId,
    type: n.type,
    base_type: n.baseType,
    variant: n.variant,
    object_kind: n.objectKind,
    action: n.action,
    source: n.source ?? null,
    specversion: n.specversion ?? null,
    time: n.time ?? null,
    delivery_attempt: n.deliveryAttempt ?? null,
    application_id: n.applicationId ?? null,
    object_id: n.objectId ?? null,
    grant_id: n.grantId ?? null,
    thread_id: n.threadId ?? null,
    mailbox: n.mailbox ?? null,
    message_id: n.messageId ?? null,
    is_message_event: n.isMessageEvent,
    answered: DEFAULT_EVENTS.has(n.baseType) && n.isMessageEvent,
    summary: summaryJson(summaryOf(n)),
  };
}

interface NotificationCase { document?: Record<string, unknown>; body?: string; notification?: unknown; error?: { field: string | null; message: string } }

function notifications(c: NotificationCase): void {
  const inputs = c.body !== undefined ? [Buffer.from(c.body, "utf8")] : [c.document!, Buffer.from(JSON.stringify(c.document), "utf8")];
  for (const input of inputs) {
    if (c.error === undefined) {
      assert.deepEqual(notificationJson(parseNotification(input)), c.notification);
      continue;
    }
    const { field, message } = c.error;
    assert.throws(
      () => parseNotification(input),
      (error: unknown) => {
        assert.ok(error instanceof EnvelopeError, String(error));
        assert.ok(error.message.includes(message), error.message);
        if (field !== null) assert.ok(error.message.includes(`'${field}'`), error.message);
        return true;
      },
    );
  }
}

interface SummaryCase { check: "summary" | "text"; message?: Record<string, unknown>; summary?: unknown; text?: string; max_bytes?: number; cut?: string; cut_bytes?: number }

function summaries(c: SummaryCase): void {
  if (c.check === "summary") {
    const notification = parseNotification({ id: "conformance", type: "message.created", data: { object: { id: "m-1", ...c.message } } });
    assert.deepEqual(summaryJson(summaryOf(notification)), c.summary);
  } else {
    const cut = cleanText(c.text!, c.max_bytes!);
    assert.equal(cut, c.cut);
    assert.equal(Buffer.byteLength(cut, "utf8"), c.cut_bytes);
  }
}

// -- status_codes.json and backoff.json -------------------------------------------------------------------

interface PolicyJson { attempts: number; initial_backoff_ms: number; max_backoff_ms: number; multiplier: number }
const policyOf = (p: PolicyJson): RetryPolicy => ({ attempts: p.attempts, initialBackoffMs: p.initial_backoff_ms, maxBackoffMs: p.max_backoff_ms, multiplier: p.multiplier });

function withCoordinator<T>(retry: RetryPolicy | undefined, run: (coordinator: Coordinator) => T): T {
  const coordinator = new Coordinator({ principal: "conformance", ...(retry === undefined ? {} : { retry }) });
  try {
    return run(coordinator);
  } finally {
    coordinator.close();
  }
}

// The wait is random: hold Math.random at its ends to see the bounds themselves.
function withRandom<T>(value: number, run: () => T): T {
  const random = Math.random;
  Math.random = () => value;
  try {
    return run();
  } finally {
    Math.random = random;
  }
}
const NEARLY_ONE = 1 - 2 ** -53;
const near = (got: number | undefined, want: number, what: string): void => assert.ok(got !== undefined && Math.abs(got - want) < 1e-6, `${what}: ${got} is not ${want}`);

interface StatusCase {
  check: "decision" | "trailer" | "batch_error";
  code: StatusCodeName;
  reason?: string;
  retry_after_ms: number | null;
  retried: boolean;
  wait_ms?: [number, number] | null;
  error?: string;
  trailer?: string | null;
  code_number?: number;
  call_error_retry_after_ms?: number;
}

function statusCodes(c: StatusCase): void {
  // Python's runner fails on a code name or hint of the wrong kind by itself; this one must look.
  assert.ok(Object.hasOwn(StatusCode, c.code), `no status code ${c.code}`);
  assert.ok(c.retry_after_ms === null || Number.isInteger(c.retry_after_ms), "retry_after_ms is whole milliseconds or null");
  if (c.reason) assert.match(PROTO, new RegExp(`\\b${c.reason}\\b`), "the proto lists no such reason");
  let failure: RpcFailure;
  if (c.check === "decision") {
    failure = new RpcFailure(c.code, "details", c.retry_after_ms ?? undefined);
    assert.equal(failure.error("ClaimReply", 1).name, c.error);
  } else if (c.check === "trailer") {
    const error = new ConnectError("over the call rate", Code.ResourceExhausted, c.trailer === null ? undefined : { [RETRY_AFTER_METADATA]: c.trailer! });
    failure = RpcFailure.from(error);
  } else {
    const rpc: Rpc = { method: "ClaimReply", request: create(pb.ClaimReplyRequestSchema, {}), timeoutMs: 1000 };
    const result = { result: { case: "error" as const, value: create(pb.CallErrorSchema, { code: c.code_number!, message: "details", retryAfterMs: BigInt(c.call_error_retry_after_ms!), reason: c.reason! }) } };
    const answered = answers([rpc, rpc], create(pb.BatchResponseSchema, { results: [result, result] }))[0];
    assert.ok(answered instanceof RpcFailure);
    failure = answered;
  }
  assert.equal(failure.code, c.code);
  assert.equal(failure.retryAfterMs ?? null, c.retry_after_ms);
  withCoordinator(undefined, (coordinator) => {
    assert.equal(coordinator.retryDelay(failure, 1) !== undefined, c.retried);
    if (c.check !== "decision") return;
    assert.equal(c.wait_ms === null, !c.retried, "a wait is given exactly for a retry");
    if (c.wait_ms === null) return;
    const [least, most] = c.wait_ms!;
    near(withRandom(0, () => coordinator.retryDelay(failure, 1)), least, "the shortest wait");
    near(withRandom(NEARLY_ONE, () => coordinator.retryDelay(failure, 1)), most, "the longest wait");
  });
}

interface BackoffCase {
  check: "waits" | "invalid" | "deadline";
  policy?: PolicyJson;
  waits?: { retry: number; min_ms: number; max_ms: number }[];
  gives_up_after_attempt?: number;
  code?: StatusCodeName;
  retry_after_ms?: number | null;
  deadline_in_ms?: number;
  retried?: boolean;
}

function backoff(c: BackoffCase): void {
  const unavailable = new RpcFailure("UNAVAILABLE", "");
  if (c.check === "invalid") {
    assert.throws(() => withCoordinator(policyOf(c.policy!), () => undefined), RangeError);
  } else if (c.check === "waits") {
    withCoordinator(policyOf(c.policy!), (coordinator) => {
      for (const wait of c.waits!) {
        near(withRandom(0, () => coordinator.retryDelay(unavailable, wait.retry + 1)), wait.min_ms, `retry ${wait.retry}, the shortest wait`);
        near(withRandom(NEARLY_ONE, () => coordinator.retryDelay(unavailable, wait.retry + 1)), wait.max_ms, `retry ${wait.retry}, the longest wait`);
      }
      const last = c.gives_up_after_attempt!;
      for (let attempt = 1; attempt <= last + 1; attempt++) {
        assert.equal(coordinator.retryDelay(unavailable, attempt) !== undefined, attempt < last, `after attempt ${attempt}`);
      }
    });
  } else {
    const failure = new RpcFailure(c.code!, "", c.retry_after_ms ?? undefined);
    withCoordinator(undefined, (coordinator) => assert.equal(coordinator.retryDelay(failure, 1, performance.now() + c.deadline_in_ms!) !== undefined, c.retried));
  }
}

// -- outgoing.json ----------------------------------------------------------------------------------------

interface OutgoingCase { settings: { sent_folders: string[]; mailbox_addresses: string[] }; message: Record<string, unknown>; match: OutgoingMatch | null }

function outgoing(c: OutgoingCase): void {
  const rules = new OutgoingRules(c.settings.sent_folders, c.settings.mailbox_addresses);
  assert.deepEqual(rules.match(c.message) ?? null, c.match);
}

// -- wire_constants.json ----------------------------------------------------------------------------------

const snake = (name: string): string => name.replace(/[A-Z]/g, (upper) => "_" + upper.toLowerCase());
const CONSTANTS: Record<string, () => unknown> = {
  principal_metadata_key: () => PRINCIPAL_METADATA,
  principal_kind_metadata_key: () => PRINCIPAL_KIND_METADATA,
  retry_after_metadata_key: () => RETRY_AFTER_METADATA,
  batch_max_calls: () => BATCH_MAX_CALLS,
  default_max_batch: () => withCoordinator(undefined, (coordinator) => coordinator.maxBatch),
  max_batches_in_flight: () => MAX_BATCHES_IN_FLIGHT,
  default_target: () => DEFAULT_TARGET,
  default_call_timeout_ms: () => withCoordinator(undefined, (coordinator) => coordinator.timeoutMs),
  from_env_call_timeout_ms: () => optionsFromEnv({}).timeoutMs,
  from_env_kind: () => optionsFromEnv({}).kind,
  environment_variables: () => ({
    ...Object.fromEntries(Object.entries(ENVIRONMENT).map(([setting, variable]) => [snake(setting), variable])),
    sent_folders: SENT_FOLDERS_ENV,
    mailbox_addresses: MAILBOX_ADDRESSES_ENV,
  }),
  default_retry_policy: () => ({ attempts: DEFAULT_RETRY.attempts, initial_backoff_ms: DEFAULT_RETRY.initialBackoffMs, max_backoff_ms: DEFAULT_RETRY.maxBackoffMs, multiplier: DEFAULT_RETRY.multiplier }),
  idempotency_key_prefix: () => IDEMPOTENCY_KEY_PREFIX,
  nylas_max_idempotency_key_length: () => MAX_IDEMPOTENCY_KEY_LENGTH,
  nylas_signature_header: () => NYLAS_SIGNATURE_HEADER,
  nylas_default_api_base: () => DEFAULT_API_BASE,
  nylas_send_timeout_ms: () => new Nylas("conformance").timeoutMs,
  nylas_sent_folder_attribute: () => SENT_ATTRIBUTE,
  default_sent_folders: () => [...DEFAULT_SENT_FOLDERS].sort(),
  answered_events: () => [...DEFAULT_EVENTS].sort(),
  webhook_max_body_bytes: () => DEFAULT_MAX_BODY_BYTES,
  webhook_admission_timeout_ms: () => DEFAULT_ADMISSION_TIMEOUT_MS,
  summary_subject_line_max_bytes: () => SUMMARY_TEXT_MAX_BYTES,
  summary_sender_max_bytes: () => SUMMARY_TEXT_MAX_BYTES,
  note_max_bytes: () => REASON_MAX_BYTES,
};

function wireConstants(c: { name: string; value: unknown; meaning: string }): void {
  const constant = CONSTANTS[c.name];
  assert.ok(constant !== undefined, `this client has no constant ${c.name}`);
  assert.deepEqual(constant(), c.value);
  assert.ok(c.meaning.length > 0);
}

// -- message_ids.json -------------------------------------------------------------------------------------

function messageIds(c: { whitespace?: string[]; id?: string; canonical?: string }): void {
  if (c.whitespace !== undefined) {
    assert.deepEqual([...MESSAGE_ID_WHITESPACE].map((ch) => `U+${ch.codePointAt(0)!.toString(16).toUpperCase().padStart(4, "0")}`), c.whitespace);
    return;
  }
  const id = c.id!;
  const canonical = c.canonical!;
  assert.equal(canonicalMessageId(id), canonical);
  // Where ids enter: a message's subject, and replyTo's.
  assert.equal(messageSubject("grant-1", id).id, canonical);
  if (canonical !== "") assert.equal(resolveSubject({ mailbox: "grant-1", messageId: id }, "message").subject.id, canonical);
}

// -- the runner -------------------------------------------------------------------------------------------

// -- automated.json ----------------------------------------------------------------------------------------

interface AutomatedCase { headers: Record<string, string>; sender: string | null; content_type?: string; expect: { automated: boolean; reason: string | null } }

function automated(c: AutomatedCase): void {
  const verdict = judgeAutomated(c.headers, c.sender, "content_type" in c ? c.content_type : undefined);
  assert.deepEqual({ automated: verdict.automated, reason: verdict.automated ? verdict.why : null }, c.expect);
  // Headers as a provider lists them ({name, value}, Graph's and Gmail's shape) are judged alike.
  const listed = judgeAutomated(Object.entries(c.headers).map(([name, value]) => ({ name, value })), c.sender, c.content_type);
  assert.deepEqual(listed, verdict);
}

const RUNNERS: Record<string, (c: never) => void> = {
  "automated.json": automated,
  "backoff.json": backoff,
  "idempotency_keys.json": idempotencyKeys,
  "message_ids.json": messageIds,
  "notifications.json": notifications,
  "outgoing.json": outgoing,
  "status_codes.json": statusCodes,
  "summaries.json": summaries,
  "webhook_signatures.json": webhookSignatures,
  "wire_constants.json": wireConstants,
};
const FILES = readdirSync(DIR).filter((file) => file.endsWith(".json")).sort();

test("every vector file has a runner here, and every runner a file", () => {
  assert.deepEqual(FILES, Object.keys(RUNNERS).sort());
});

test("every constant of this client's table is named by wire_constants.json", () => {
  const named = (JSON.parse(readFileSync(join(DIR, "wire_constants.json"), "utf8")) as { cases: Case[] }).cases.map((c) => c.name);
  assert.deepEqual(Object.keys(CONSTANTS).sort(), [...named].sort());
});

for (const file of FILES) {
  const { about, cases } = JSON.parse(readFileSync(join(DIR, file), "utf8")) as { about: string; cases: Case[] };
  test(`${file} says what its vectors mean, and names each case once`, () => {
    assert.ok(about.length > 100);
    assert.ok(cases.length > 0);
    assert.equal(new Set(cases.map((c) => c.name)).size, cases.length);
  });
  for (const vector of cases) {
    test(`conformance/${file}: ${vector.name}`, () => {
      // Every field must be read by the check: a field nothing reads would be a claim nothing tests.
      const read = new Set(["name"]);
      const seen = new Proxy(vector, {
        get(target, key, receiver) {
          if (typeof key === "string") read.add(key);
          return Reflect.get(target, key, receiver);
        },
      });
      RUNNERS[file]!(seen as never);
      assert.deepEqual(Object.keys(vector).filter((key) => !read.has(key)), [], "fields no check read");
    });
  }
}
