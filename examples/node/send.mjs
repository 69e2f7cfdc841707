// Sends a reply through the Nylas v3 API (NYLAS_API_BASE, default https://api.us.nylas.com) with inbox-claims'
// fetch helper: 409 / 5xx / timeouts throw "outcome unknown", other 4xx throw SendRejected.
import { randomUUID } from "node:crypto";
import { Nylas } from "inbox-claims/nylas";

const nylas = new Nylas(process.env.NYLAS_API_KEY ?? "demo-key", { apiBase: process.env.NYLAS_API_BASE ?? "https://api.us.nylas.com", timeoutMs: 30_000 });

export function sendReply(grantId, message, draft, idempotencyKey = randomUUID()) {
  const to = (message.reply_to?.length ? message.reply_to : message.from ?? []).filter((p) => p.email);
  const reply = { replyToMessageId: message.id, to, subject: `Re: ${message.subject ?? ""}`, body: draft };
  return nylas.send(grantId, reply, { idempotencyKey });
}
