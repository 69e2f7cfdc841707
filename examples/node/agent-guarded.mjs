// The same agent, guarded by inbox-claims: 7 lines differ from agent-unguarded.mjs, 4 added and 3 changed
// (docs/node.md shows the diff). One ClaimReply dedups the notification id and claims the message for all
// replicas; the claim is renewed while the LLM drafts; claim.send passes the fenced commit point and hands the
// send the claim's idempotency key, which goes out as Nylas's Idempotency-Key header; ConfirmSent records it.
import crypto from "node:crypto";
import express from "express";
import { ClaimLost, ClaimNotGranted, Coordinator } from "inbox-claims";
import { draftReply } from "./llm.mjs";

const app = express();
const SECRET = process.env.NYLAS_WEBHOOK_SECRET ?? "demo-secret";
const NYLAS_API = process.env.NYLAS_API_BASE ?? "https://api.us.nylas.com";
const seen = new Set(); // this process's memory only
const coord = Coordinator.fromEnv(); // INBOX_COORDINATOR_TARGET, INBOX_TOKEN or INBOX_PRINCIPAL, as in Python

async function sendReply(grantId, message, draft, idempotencyKey) {
  const response = await fetch(`${NYLAS_API}/v3/grants/${encodeURIComponent(grantId)}/messages/send`, {
    method: "POST",
    headers: { authorization: `Bearer ${process.env.NYLAS_API_KEY}`, "content-type": "application/json", "idempotency-key": idempotencyKey },
    body: JSON.stringify({ reply_to_message_id: message.id, to: message.reply_to?.length ? message.reply_to : message.from, subject: `Re: ${message.subject ?? ""}`, body: draft }),
  });
  if (!response.ok) throw new Error(`Nylas answered ${response.status}: ${await response.text()}`);
  return (await response.json()).data.id;
}

app.get("/webhooks/nylas", (req, res) => res.status(200).type("text/plain").send(req.query.challenge));

app.post("/webhooks/nylas", express.raw({ type: "*/*" }), async (req, res) => {
  const signature = req.get("x-nylas-signature") ?? "";
  const expected = crypto.createHmac("sha256", SECRET).update(req.body).digest("hex");
  if (signature.length !== expected.length || !crypto.timingSafeEqual(Buffer.from(signature), Buffer.from(expected))) {
    return res.status(401).end();
  }
  res.status(200).end();
  const notification = JSON.parse(req.body.toString("utf8"));
  if (seen.has(notification.id)) return;
  seen.add(notification.id);
  if (!["message.created", "message.updated"].includes(notification.type)) return;
  const message = notification.data.object;
  await coord.replyTo(notification, { ttl: 30 }, async (claim) => {
  const draft = await draftReply(message);
  await claim.send((idempotencyKey) => sendReply(message.grant_id, message, draft, idempotencyKey));
  }).catch((error) => { if (!(error instanceof ClaimNotGranted || error instanceof ClaimLost)) throw error; });
});

const server = app.listen(Number(process.env.PORT ?? 8001), "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
