// Webhook signature checks, as the Python client's inbox_claims._webhooks:
// * Nylas v3: `x-nylas-signature` is the hex HMAC-SHA256 of the raw body keyed by the webhook secret; a new
//   endpoint is first verified with GET ?challenge=<value>, answered by echoing the value.
// * Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature`; the signature covers
//   "{id}.{timestamp}." + body and the timestamp bounds replays.
// Always pass the body exactly as received (a Buffer), never re-serialised JSON. Request problems throw
// WebhookVerificationError (answer 400/401); configuration problems (empty secret) throw TypeError/RangeError.
import { createHmac, timingSafeEqual } from "node:crypto";

export const NYLAS_SIGNATURE_HEADER = "x-nylas-signature";
const NYLAS_HEX_LENGTH = 64;
const MAX_CHALLENGE_LENGTH = 1024;
const SHA256_LENGTH = 32;

export class WebhookVerificationError extends Error {
  override name = "WebhookVerificationError";
}

type Body = Buffer | Uint8Array;
type Headers = Record<string, string | string[] | undefined> | { get(name: string): string | null };

function bodyBytes(raw: Body): Buffer {
  if (raw instanceof Uint8Array) return Buffer.from(raw.buffer, raw.byteOffset, raw.byteLength);
  throw new TypeError(`rawBody must be the request body as received (a Buffer), not ${typeof raw}; re-encoded or re-serialised bodies do not match their signature`);
}

function nylasKey(secret: string | Buffer): Buffer {
  const key = typeof secret === "string" ? Buffer.from(secret, "utf8") : Buffer.from(secret);
  if (key.length === 0) throw new TypeError("webhook secret is empty: check the server's configuration");
  return key;
}

function standardKey(secret: string): Buffer {
  const encoded = secret.trim().replace(/^whsec_/, "");
  if (!/^[A-Za-z0-9+/]*={0,2}$/.test(encoded) || encoded.length % 4 !== 0) {
    throw new TypeError("Standard Webhooks secret is not valid base64 (expected 'whsec_<base64>'): check the server's configuration");
  }
  const key = Buffer.from(encoded, "base64");
  if (key.length === 0) throw new TypeError("Standard Webhooks secret is empty: check the server's configuration");
  return key;
}

function header(headers: Headers, name: string): string | undefined {
  if (typeof (headers as { get?: unknown }).get === "function") return (headers as { get(name: string): string | null }).get(name) ?? undefined;
  const record = headers as Record<string, string | string[] | undefined>;
  const key = Object.keys(record).find((k) => k.toLowerCase() === name);
  const value = key === undefined ? undefined : record[key];
  return Array.isArray(value) ? value.join(", ") : value;
}

/** The x-nylas-signature value for rawBody: lower-case hex HMAC-SHA256 (for tests and local tooling). */
export function signNylas(rawBody: Body, secret: string | Buffer): string {
  return createHmac("sha256", nylasKey(secret)).update(bodyBytes(rawBody)).digest("hex");
}

/**
 * Checks a Nylas v3 webhook's x-nylas-signature header (undefined when the request had none); returns if
 * authentic. Surrounding whitespace is ignored and hex digits may be either case; the length is checked before
 * the constant-time comparison (timingSafeEqual needs equal lengths). Throws WebhookVerificationError.
 */
export function verifyNylasSignature(rawBody: Body, signatureHeader: string | undefined | null, secret: string | Buffer): void {
  const body = bodyBytes(rawBody);
  const key = nylasKey(secret);
  if (signatureHeader === undefined || signatureHeader === null) throw new WebhookVerificationError(`missing ${NYLAS_SIGNATURE_HEADER} header`);
  const received = signatureHeader.trim();
  if (!received) throw new WebhookVerificationError(`${NYLAS_SIGNATURE_HEADER} header is empty`);
  if (received.length !== NYLAS_HEX_LENGTH) {
    throw new WebhookVerificationError(`${NYLAS_SIGNATURE_HEADER} header has ${received.length} characters, expected ${NYLAS_HEX_LENGTH} hex digits (HMAC-SHA256)`);
  }
  if (!/^[0-9a-fA-F]+$/.test(received)) throw new WebhookVerificationError(`${NYLAS_SIGNATURE_HEADER} header is not hexadecimal`);
  const expected = createHmac("sha256", key).update(body).digest();
  if (!timingSafeEqual(expected, Buffer.from(received, "hex"))) {
    throw new WebhookVerificationError(`${NYLAS_SIGNATURE_HEADER} does not match the request body (wrong secret, or the body was altered or re-serialised)`);
  }
}

/**
 * The body to answer a Nylas endpoint-verification request (GET ?challenge=<value>: 200, the value as
 * text/plain), or undefined when there is no challenge parameter. Throws WebhookVerificationError when it is
 * empty, repeated, or longer than 1024 characters.
 */
export function nylasChallengeResponse(query: URLSearchParams | Record<string, unknown>): string | undefined {
  let value: unknown;
  if (query instanceof URLSearchParams) {
    if (!query.has("challenge")) return undefined;
    const all = query.getAll("challenge");
    value = all.length === 1 ? all[0] : all;
  } else {
    if (!("challenge" in query)) return undefined;
    value = query["challenge"];
  }
  if (typeof value !== "string") throw new WebhookVerificationError("'challenge' query parameter must be a single string");
  if (!value) throw new WebhookVerificationError("'challenge' query parameter is empty");
  // Characters are code points, as the Python client counts them: .length would count an emoji twice.
  const length = [...value].length;
  if (length > MAX_CHALLENGE_LENGTH) {
    throw new WebhookVerificationError(`'challenge' query parameter is ${length} characters long, more than the ${MAX_CHALLENGE_LENGTH} allowed`);
  }
  return value;
}

function standardDigest(key: Buffer, msgId: string, timestamp: number, body: Buffer): Buffer {
  return createHmac("sha256", key).update(Buffer.concat([Buffer.from(`${msgId}.${timestamp}.`, "utf8"), body])).digest();
}

/** A webhook-signature value ("v1,<base64>") for a Standard Webhooks message (for tests and local tooling). */
export function signStandardWebhook(rawBody: Body, options: { msgId: string; timestamp: number; secret: string }): string {
  if (!Number.isInteger(options.timestamp) || options.timestamp < 0) throw new RangeError("timestamp must be a non-negative integer (unix seconds)");
  if (!options.msgId) throw new TypeError("msgId must be a non-empty string");
  return "v1," + standardDigest(standardKey(options.secret), options.msgId, options.timestamp, bodyBytes(rawBody)).toString("base64");
}

function requiredHeader(headers: Headers, name: string): string {
  const value = header(headers, name)?.trim();
  if (value === undefined) throw new WebhookVerificationError(`missing ${name} header`);
  if (!value) throw new WebhookVerificationError(`${name} header is empty`);
  return value;
}

/**
 * Checks a Standard Webhooks request; returns if authentic and fresh. `webhook-signature` is a space-separated
 * list of "<version>,<base64>"; other versions are ignored and one v1 entry must match. `webhook-timestamp` must
 * be within `toleranceSeconds` (default 300) of `now` (unix seconds, default the current time).
 */
export function verifyStandardWebhook(rawBody: Body, headers: Headers, secret: string, options: { toleranceSeconds?: number; now?: number } = {}): void {
  const body = bodyBytes(rawBody);
  const key = standardKey(secret);
  const tolerance = options.toleranceSeconds ?? 300;
  if (!(Number.isFinite(tolerance) && tolerance >= 0)) throw new RangeError("toleranceSeconds must be a finite, non-negative number");
  const msgId = requiredHeader(headers, "webhook-id");
  const timestampText = requiredHeader(headers, "webhook-timestamp");
  const signatureText = requiredHeader(headers, "webhook-signature");
  if (!/^[0-9]+$/.test(timestampText)) throw new WebhookVerificationError("webhook-timestamp header is not an integer number of unix seconds");
  const timestamp = Number(timestampText);
  const now = options.now ?? Date.now() / 1000;
  if (timestamp < now - tolerance) {
    throw new WebhookVerificationError(`webhook-timestamp is too old: ${Math.round(now - timestamp)}s in the past, tolerance is ${tolerance}s (replayed or delayed message, or clock skew)`);
  }
  if (timestamp > now + tolerance) {
    throw new WebhookVerificationError(`webhook-timestamp is too new: ${Math.round(timestamp - now)}s in the future, tolerance is ${tolerance}s (clock skew?)`);
  }
  const candidates: Buffer[] = [];
  for (const entry of signatureText.split(/\s+/)) {
    const comma = entry.indexOf(",");
    if (comma < 0 || entry.slice(0, comma) !== "v1") continue; // other versions are ignored, per the spec
    const encoded = entry.slice(comma + 1);
    if (!/^[A-Za-z0-9+/]*={0,2}$/.test(encoded) || encoded.length % 4 !== 0) continue;
    const decoded = Buffer.from(encoded, "base64");
    if (decoded.length === SHA256_LENGTH) candidates.push(decoded);
  }
  if (candidates.length === 0) throw new WebhookVerificationError("webhook-signature header has no well-formed 'v1,<base64>' signature");
  const expected = standardDigest(key, msgId, timestamp, body);
  let matched = false;
  for (const candidate of candidates) matched = timingSafeEqual(expected, candidate) || matched; // no early exit
  if (!matched) throw new WebhookVerificationError("no v1 signature in webhook-signature matches the request (wrong secret, or the id, timestamp or body was altered)");
}

/**
 * Checks a request signed by Svix (AgentMail, Resend): Standard Webhooks under other header names (`svix-id`,
 * `svix-timestamp`, `svix-signature`); a request carrying the `webhook-*` names is checked as they are. Throws
 * WebhookVerificationError as verifyStandardWebhook does.
 */
export function verifySvixWebhook(rawBody: Body, headers: Headers, secret: string, options: { toleranceSeconds?: number; now?: number } = {}): void {
  const names = ["id", "timestamp", "signature"] as const;
  // The Standard Webhooks names are read only when a request carries them; a request with neither is refused naming svix-id.
  const standard = !names.some((name) => header(headers, `svix-${name}`) !== undefined) && header(headers, "webhook-id") !== undefined;
  if (standard) return verifyStandardWebhook(rawBody, headers, secret, options);
  const mapped: Record<string, string | undefined> = {};
  for (const name of names) mapped[`webhook-${name}`] = header(headers, `svix-${name}`);
  try {
    verifyStandardWebhook(rawBody, mapped, secret, options);
  } catch (error) {
    if (error instanceof WebhookVerificationError) throw new WebhookVerificationError(error.message.replaceAll("webhook-", "svix-"));
    throw error;
  }
}
