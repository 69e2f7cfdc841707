// The SDKs people already send with (the official `nylas` 7.x, `resend`, `agentmail` packages), under the guard
// (docs/node.md, "The SDKs you send with"). Three things, none of which needs the SDK installed:
//
// * Their answers: claim.send(() => nylas.messages.send(...)) resolves to the SDK's response object, not an id. The
//   sent id is read from it (Nylas and Resend `data.id`, AgentMail `messageId`), and Resend's `{ error }` answer,
//   which that SDK returns rather than throws, is an error like the others.
// * Their errors: a 4xx from the API (NylasApiError, AgentMailError and its subclasses, Resend's error object) means
//   nothing was sent: it is a SendRejected, so the message is freed as our own adapters free it; 408 and 409 (the
//   idempotency key is taken: a send went out or is in flight), a 5xx or no answer leave the send in doubt.
// * A send made inside a guarded handler without the commit point (the SDK called directly, not inside
//   claim.send): the guard keeps which claim's work is running (AsyncLocalStorage) and watches the HTTP requests
//   the process makes (node:diagnostics_channel). A POST to a mail API's send path inside the work and outside
//   claim.send is said loudly (a process warning, INBOX_CLAIMS_UNGUARDED_SEND); made with node:http (the nylas SDK,
//   through node-fetch), it is refused as well, before a byte is sent; made with fetch (resend, agentmail), it
//   cannot be stopped from here and is only warned about.
// * The marks a reply carries: claimHeaders() / claimCustomHeaders() give the SDK's message headers the claim's stamp
//   (X-Inbox-Claim: <key>.<token>, what settles an IN_DOUBT send from the sent copy) and, for an agent's claim,
//   Auto-Submitted: auto-replied (never a person's), as the Python client's inbox_claims.sdks does.
import { AsyncLocalStorage } from "node:async_hooks";
import diagnostics from "node:diagnostics_channel";
import type { ClientRequest } from "node:http";
import { agentHeaders } from "./current.js";
import { InboxClaimsError, SendRejected } from "./errors.js";
import { isRecord, STAMP_HEADER } from "./providers/seam.js";

export const UNGUARDED_SEND_WARNING = "INBOX_CLAIMS_UNGUARDED_SEND";

/** The work of one claim, as the guard runs it: `sending` inside claim.send's function. */
interface Scope {
  readonly messageId: string;
  readonly sending: boolean;
  /** The claim's stamp (`<key>.<token>`), for a send that can carry it (Nylas custom_headers, the SDKs' headers). */
  readonly stamp: string;
}

const scope = new AsyncLocalStorage<Scope>();

/** The mail APIs' send paths (POST): Nylas, Resend, AgentMail, Graph, Gmail. */
const SEND_PATHS: readonly RegExp[] = [
  /\/v3\/grants\/[^/]+\/messages\/send$/,
  /\/v3\/grants\/[^/]+\/drafts\/[^/]+$/,
  /^\/emails(\/batch)?$/,
  /\/v0\/inboxes\/[^/]+\/messages\/(send|[^/]+\/(reply|reply-all|forward))$/,
  /\/v0\/inboxes\/[^/]+\/drafts\/[^/]+\/send$/,
  /\/messages\/[^/]+\/send$/,
  /\/sendMail$/,
  /\/gmail\/v1\/users\/[^/]+\/messages\/send$/,
];

/** The send a guarded handler made without claim.send: refused before it left (node:http requests). */
export class UnguardedSend extends InboxClaimsError {
  override name = "UnguardedSend";
}

function unguarded(method: string, path: string): Scope | undefined {
  const current = scope.getStore();
  if (current === undefined || current.sending || method.toUpperCase() !== "POST") return undefined;
  const bare = path.split("?")[0]!;
  return SEND_PATHS.some((pattern) => pattern.test(bare)) ? current : undefined;
}

function say(current: Scope, what: string, refused: boolean): string {
  const message =
    `a send (${what}) was made inside the guarded work on message ${current.messageId} without claim.send: ` +
    (refused ? "it was refused and nothing was sent. " : "it went out unguarded, and the message stays unanswered in the coordinator's eyes. ") +
    "Send inside claim.send((idempotencyKey) => ...), passing the key to the SDK (docs/node.md, \"The SDKs you send with\").";
  process.emitWarning(message, { code: UNGUARDED_SEND_WARNING });
  return message;
}

let watching = false;

/** Starts watching the process's HTTP requests (once, when the first claim's work runs). */
function watch(): void {
  if (watching) return;
  watching = true;
  diagnostics.subscribe("http.client.request.start", (message) => {
    const request = (message as { request: ClientRequest }).request;
    const current = unguarded(request.method, request.path);
    if (current !== undefined) request.destroy(new UnguardedSend(say(current, `${request.method} ${request.host}${request.path}`, true)));
  });
  diagnostics.subscribe("undici:request:create", (message) => {
    const request = (message as { request: { method: string; origin: string; path: string } }).request;
    const current = unguarded(request.method, request.path);
    if (current !== undefined) say(current, `${request.method} ${request.origin}${request.path}`, false);
  });
}

/** Runs a claim's work (`sending` false) or its send function (`sending` true) in the guard's scope. */
export function inScope<T>(messageId: string, sending: boolean, stamp: string, run: () => T): T {
  watch();
  return scope.run({ messageId, sending, stamp }, run);
}

/** The stamp of the claim whose send function runs now (inside claim.send), else undefined. */
export function currentStamp(): string | undefined {
  const current = scope.getStore();
  return current?.sending ? current.stamp : undefined;
}

const rejectable = (status: number): boolean => status >= 400 && status < 500 && status !== 408 && status !== 409;

/** The SDK error classes whose status code says what happened (by name: the SDKs are optional). */
function sdkClass(error: object): string | undefined {
  for (let proto = Object.getPrototypeOf(error) as object | null; proto !== null; proto = Object.getPrototypeOf(proto) as object | null) {
    const name = (proto.constructor as { name?: string } | undefined)?.name;
    if (name === "NylasApiError" || name === "AgentMailError") return name;
  }
  return undefined;
}

/** A thrown SDK error as claim.send reads it: a 4xx is a SendRejected (nothing was sent); anything else as it was. */
export function sdkError(error: unknown): unknown {
  if (typeof error !== "object" || error === null || error instanceof SendRejected) return error;
  const kind = sdkClass(error);
  const status = (error as { statusCode?: unknown }).statusCode;
  if (kind === undefined || typeof status !== "number" || !rejectable(status)) return error;
  const rejected = new SendRejected(`${kind}: the API refused the send (HTTP ${status}), nothing was sent: ${(error as Error).message}`);
  (rejected as { cause?: unknown }).cause = error;
  return rejected;
}

/** Resend's answer: its error object (returned, not thrown) made an error; else undefined. */
function resendError(value: Record<string, unknown>): Error | undefined {
  const error = value.error;
  if (!("data" in value) || typeof error !== "object" || error === null) return undefined;
  const { statusCode, name, message } = error as { statusCode?: unknown; name?: unknown; message?: unknown };
  const what = `Resend answered ${typeof statusCode === "number" ? `HTTP ${statusCode}` : "no status"} (${String(name)}): ${String(message)}`;
  if (typeof statusCode === "number" && rejectable(statusCode)) return new SendRejected(`${what}; nothing was sent`);
  return new InboxClaimsError(`${what}; the reply may have gone out`);
}

/**
 * What a send function returned, as claim.send records it: a string, null or undefined as it is; an SDK's response
 * its sent message's id (Nylas and Resend `data.id`, AgentMail `messageId`). Throws Resend's returned error (a
 * SendRejected for a 4xx). Anything else is given back as it is (claim.send then says it cannot read it).
 */
export function sentIdOf(value: unknown): unknown {
  if (typeof value !== "object" || value === null) return value;
  const record = value as Record<string, unknown>;
  const failed = resendError(record);
  if (failed !== undefined) throw failed;
  const data = record.data;
  if (typeof data === "object" && data !== null && typeof (data as { id?: unknown }).id === "string") return (data as { id: string }).id;
  if (typeof record.messageId === "string") return record.messageId;
  return value;
}

/** Nylas SDK `overrides` carrying the claim's key: `nylas.messages.send({ identifier, requestBody, overrides: idempotencyOverrides(key) })`. */
export function idempotencyOverrides(idempotencyKey: string, overrides: { headers?: Record<string, string> } & Record<string, unknown> = {}): Record<string, unknown> {
  return { ...overrides, headers: { ...overrides.headers, "Idempotency-Key": idempotencyKey } };
}

/**
 * The message headers of a reply sent now, name by name: inside claim.send the claim's stamp (`X-Inbox-Claim`), and
 * `Auto-Submitted: auto-replied` unless the claim is a person's (agentHeaders). A header in `given` wins over ours of
 * the same name (any case), and `given` is kept in full.
 */
function marks(given: Iterable<string>): [string, string][] {
  const names = new Set([...given].map((name) => name.toLowerCase()));
  const stamp = currentStamp();
  return [...(stamp === undefined ? [] : [[STAMP_HEADER, stamp] as const]), ...agentHeaders()]
    .filter(([name]) => !names.has(name.toLowerCase()))
    .map(([name, value]) => [name, value]);
}

/**
 * The `headers` of an email sent through the resend or agentmail SDK inside claim.send: `given` and the claim's
 * marks (the stamp; Auto-Submitted for an agent). `resend.emails.send({ ..., headers: claimHeaders() }, { idempotencyKey: key })`.
 */
export function claimHeaders(given: Readonly<Record<string, string>> = {}): Record<string, string> {
  return { ...given, ...Object.fromEntries(marks(Object.keys(given))) };
}

/** A Nylas custom header (the SDK's `customHeaders`, the API's `custom_headers`). */
export interface CustomHeader {
  name: string;
  value: string;
}

/**
 * The `customHeaders` of a Nylas send inside claim.send (Nylas writes them into the message, where `overrides.headers`
 * go only to the API request): `given` and the claim's marks. Nylas.send's own request uses it too.
 */
export function claimCustomHeaders(given: readonly CustomHeader[] = []): CustomHeader[] {
  // What a caller gave is checked by Nylas, not here: a header without a string name is passed on, never matched.
  const names = given.flatMap((header: unknown) => (isRecord(header) && typeof header.name === "string" ? [header.name] : []));
  return [...given, ...marks(names).map(([name, value]): CustomHeader => ({ name, value }))];
}
