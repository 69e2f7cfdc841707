// Typed parsing of the Nylas v3 webhook notification envelope, as the Python client's inbox_claims._envelope.
//
// Two ids, two jobs: the notification id (top-level `id`) identifies one notification, and a redelivery repeats
// it: it is the key for delivery dedup. The message id (`data.object.id` of a `message.*` event) identifies the
// email: it is what an agent claims. One message produces several notifications (message.created, then
// message.updated...), each with its own notification id: never dedup on the message id, never claim on the
// notification id. Verify the signature on the raw body before parsing it.

export class EnvelopeError extends Error {
  override name = "EnvelopeError";
}

/** Which form of the object a notification carries, from the suffix of its `type`. */
export type NotificationVariant = "full" | "truncated" | "cleaned" | "transformed";
const SUFFIXES = new Set(["truncated", "cleaned", "transformed"]);
// Types about one email that are useless without its id: parsing them without data.object.id fails.
const MESSAGE_ID_REQUIRED = new Set(["message.created", "message.updated"]);

export interface Notification {
  /** The delivery dedup key (a redelivery repeats it). */
  readonly notificationId: string;
  /** The full type, e.g. "message.created.truncated". */
  readonly type: string;
  /** The type without its variant suffix, e.g. "message.created". */
  readonly baseType: string;
  /** "truncated": the message exceeded 1 MB and Nylas dropped the body (fetch the message); "cleaned" / "transformed": Clean Conversations variants. */
  readonly variant: NotificationVariant;
  /** First dotted part of the type: "message", "thread", "grant"... */
  readonly objectKind: string;
  /** The rest of the base type: "created", "updated"... */
  readonly action: string;
  readonly source: string | undefined;
  readonly specversion: string | undefined;
  /** Unix seconds at which Nylas generated the notification. */
  readonly time: number | undefined;
  /** webhook_delivery_attempt: 1 for the first delivery, more on retries. */
  readonly deliveryAttempt: number | undefined;
  readonly applicationId: string | undefined;
  /** data.object.id: the message id for message events. */
  readonly objectId: string | undefined;
  readonly grantId: string | undefined;
  readonly threadId: string | undefined;
  /** The grant id: the mailbox the notification is about. */
  readonly mailbox: string | undefined;
  /** The id to claim: objectId for message events, undefined otherwise. */
  readonly messageId: string | undefined;
  readonly isMessageEvent: boolean;
  readonly object: Readonly<Record<string, unknown>>;
  readonly raw: Readonly<Record<string, unknown>>;
}

type Json = Record<string, unknown>;

function jsonType(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  switch (typeof value) {
    case "boolean":
      return "a boolean";
    case "number":
      return "a number";
    case "string":
      return "a string";
    case "object":
      return "an object";
    default:
      return typeof value;
  }
}

const isObject = (value: unknown): value is Json => typeof value === "object" && value !== null && !Array.isArray(value);
const where = (path: string): string => (path.includes(".") ? `'${path}'` : `top-level '${path}'`);

function requiredStr(container: Json, path: string, why = ""): string {
  const value = container[path.split(".").pop()!];
  if (value === undefined || value === null) throw new EnvelopeError(`notification envelope has no ${where(path)}${why}`);
  if (typeof value !== "string") throw new EnvelopeError(`notification ${where(path)} must be a string, not ${jsonType(value)}`);
  if (!value) throw new EnvelopeError(`notification ${where(path)} is empty${why}`);
  return value;
}

function optionalStr(container: Json, path: string): string | undefined {
  const value = container[path.split(".").pop()!];
  return value === undefined || value === null ? undefined : requiredStr(container, path);
}

function optionalInt(container: Json, path: string): number | undefined {
  const value = container[path.split(".").pop()!];
  if (value === undefined || value === null) return undefined;
  if (typeof value !== "number" || !Number.isInteger(value)) throw new EnvelopeError(`notification ${where(path)} must be an integer, not ${jsonType(value)}`);
  return value;
}

function deepFreeze<T>(value: T): T {
  if (typeof value === "object" && value !== null) {
    for (const inner of Object.values(value)) deepFreeze(inner);
    Object.freeze(value);
  }
  return value;
}

/**
 * Parses a Nylas v3 webhook body (raw bytes, text, or an already-decoded object). Strict on what matters:
 * `id` and `type` are non-empty strings, `type` is `<object>.<action>[.<variant>]`, `data` is an object, and
 * message.created / message.updated (any variant) carry data.object.id. Throws EnvelopeError naming the field.
 */
export function parseNotification(raw: Buffer | Uint8Array | string | Json): Notification {
  let document: unknown;
  if (typeof raw === "string" || raw instanceof Uint8Array) {
    const text = typeof raw === "string" ? raw : Buffer.from(raw).toString("utf8");
    try {
      document = JSON.parse(text);
    } catch (error) {
      throw new EnvelopeError(`notification body is not valid JSON: ${(error as Error).message}`);
    }
  } else if (isObject(raw)) {
    document = structuredClone(raw);
  } else {
    throw new TypeError(`notification must be bytes, a string or an object, not ${jsonType(raw)}`);
  }
  if (!isObject(document)) throw new EnvelopeError(`notification body must be a JSON object, not ${jsonType(document)}`);

  const notificationId = requiredStr(document, "id");
  const type = requiredStr(document, "type");
  let parts = type.split(".");
  let variant: NotificationVariant = "full";
  if (parts.length >= 3 && SUFFIXES.has(parts[parts.length - 1]!)) {
    variant = parts[parts.length - 1] as NotificationVariant;
    parts = parts.slice(0, -1);
  }
  if (parts.length < 2 || parts.some((part) => !part)) {
    throw new EnvelopeError(`notification top-level 'type' ${JSON.stringify(type.slice(0, 80))} is not of the form '<object>.<action>[.<variant>]'`);
  }
  const baseType = parts.join(".");
  const data = document["data"];
  if (data === undefined || data === null) throw new EnvelopeError("notification envelope has no top-level 'data' object");
  if (!isObject(data)) throw new EnvelopeError(`notification 'data' must be an object, not ${jsonType(data)}`);
  let object = data["object"] ?? {};
  if (!isObject(object)) throw new EnvelopeError(`notification 'data.object' must be an object, not ${jsonType(object)}`);
  object = object as Json;
  const objectId = MESSAGE_ID_REQUIRED.has(baseType)
    ? requiredStr(object as Json, "data.object.id", ` (required for ${baseType} notifications: it is the message id)`)
    : optionalStr(object as Json, "data.object.id");
  const objectKind = parts[0]!;
  const grantId = optionalStr(object as Json, "data.object.grant_id");
  const isMessageEvent = objectKind === "message";
  return Object.freeze({
    notificationId,
    type,
    baseType,
    variant,
    objectKind,
    action: parts.slice(1).join("."),
    source: optionalStr(document, "source"),
    specversion: optionalStr(document, "specversion"),
    time: optionalInt(document, "time"),
    deliveryAttempt: optionalInt(document, "webhook_delivery_attempt"),
    applicationId: optionalStr(data, "data.application_id"),
    objectId,
    grantId,
    threadId: optionalStr(object as Json, "data.object.thread_id"),
    mailbox: grantId,
    messageId: isMessageEvent ? objectId : undefined,
    isMessageEvent,
    object: deepFreeze(object as Json),
    raw: deepFreeze(document),
  });
}
