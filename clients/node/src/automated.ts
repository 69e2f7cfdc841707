// Automated mail: the rules that tell agents to leave a message (docs/design.md#reply-storms), the Node twin of the
// Python client's inbox_claims automated rules. Both clients run the one list of vectors, conformance/automated.json.
//
// An agent that answers an auto-reply gets one back: two machines answering each other is the storm this prevents.
// A message is automated when (first match wins, and names the rule and value for the people watching):
//   Auto-Submitted present and not "no" (RFC 3834)           "Auto-Submitted: auto-replied"
//   Precedence bulk / list / junk / auto_reply               "Precedence: bulk"
//   List-Id or List-Unsubscribe present (RFC 2919, 2369)     "List-Id"
//   X-Autoreply, X-Autorespond, X-Auto-Response-Suppress     "X-Autoreply"
//   a delivery status notification (RFC 3464: multipart/report, or from mailer-daemon@ / postmaster@)
//                                                            "delivery status notification"
//   a no-reply sender (noreply@, no-reply@, donotreply@ ...) "no-reply sender noreply@shop.example"
import type { Automated } from "./providers/seam.js";

/** The headers of a message, as a provider gives them: {name: value}, or a list of {name, value} / [name, value]. */
export type HeaderSource = Readonly<Record<string, string>> | Iterable<{ readonly name: string; readonly value: string } | readonly [string, string]>;

const PRECEDENCE = new Set(["bulk", "list", "junk", "auto_reply"]);
// Presence alone counts: a list or an autoresponder sets these, a person's mail client never does.
const PRESENT = ["List-Id", "List-Unsubscribe", "X-Autoreply", "X-Autorespond", "X-Auto-Response-Suppress"] as const;
const BOUNCERS = new Set(["mailer-daemon", "postmaster"]);
// "no-reply" or "do-not-reply" as a whole word of the local part: "notifications-noreply" and "noreply.orders" are
// automated senders, "bruno.reply" and "noreplies" are people.
const NO_REPLY = /(?:^|[._+-])(?:no|do[._-]?not)[._-]?reply(?:$|[._+-])/;

/** Not automated: the one value for every message no rule matched. */
export const NOT_AUTOMATED: Automated = Object.freeze({ automated: false, why: "" });

function headerMap(headers: HeaderSource | undefined): Map<string, string> {
  const map = new Map<string, string>();
  if (headers === undefined) return map;
  const entries: Iterable<unknown> = Symbol.iterator in headers ? (headers as Iterable<unknown>) : Object.entries(headers);
  for (const entry of entries) {
    let name: unknown, value: unknown;
    if (Array.isArray(entry)) [name, value] = entry as unknown[];
    else if (typeof entry === "object" && entry !== null) ({ name, value } = entry as { name: unknown; value: unknown });
    if (typeof name !== "string" || typeof value !== "string") continue;
    const key = name.trim().toLowerCase();
    if (!map.has(key)) map.set(key, value.trim()); // the first of a repeated header, as providers list them top-down
  }
  return map;
}

/** A structured value's keyword: before any parameter (;) or comment ((), without case. */
const keyword = (value: string): string => value.split(/[;(]/, 1)[0]!.trim().toLowerCase();

/** The address of `Name <address>` (or of a bare address), lower-case. */
function addressOf(sender: string): string {
  const match = /<([^<>\s]*)>\s*$/.exec(sender);
  return (match ? match[1]! : sender).trim().toLowerCase();
}

/**
 * Whether a message is automated mail and why (`why` names the rule and value; empty when not), as the Python
 * client's automated_reason. `headers`: the message's headers (names without case); `sender`: its From, an address
 * or "Name <address>"; `contentType`: its top-level Content-Type when known apart from the headers.
 */
export function judgeAutomated(headers: HeaderSource | undefined, sender: string | null | undefined, contentType?: string | null): Automated {
  const map = headerMap(headers);
  const submitted = map.get("auto-submitted");
  if (submitted !== undefined) {
    const value = keyword(submitted);
    if (value !== "no") return { automated: true, why: value ? `${AUTO_SUBMITTED_HEADER}: ${value}` : AUTO_SUBMITTED_HEADER };
  }
  const precedence = (map.get("precedence") ?? "").toLowerCase();
  if (PRECEDENCE.has(precedence)) return { automated: true, why: `Precedence: ${precedence}` };
  for (const name of PRESENT) if (map.has(name.toLowerCase())) return { automated: true, why: name };
  const media = keyword(contentType ?? map.get("content-type") ?? "");
  const address = addressOf(sender ?? "");
  const local = address.includes("@") ? address.slice(0, address.lastIndexOf("@")) : address;
  if (media === "multipart/report" || BOUNCERS.has(local)) return { automated: true, why: "delivery status notification" };
  if (local && NO_REPLY.test(local)) return { automated: true, why: `no-reply sender ${address}` };
  return NOT_AUTOMATED;
}

/** The header a reply of an agent carries (RFC 3834 section 5): auto-replied, so that other machines leave it. */
export const AUTO_SUBMITTED_HEADER = "Auto-Submitted";
export const AUTO_SUBMITTED_VALUE = "auto-replied";
