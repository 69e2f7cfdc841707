// The same agent, guarded by inbox-claims: 5 lines differ from agent-unguarded.mjs (docs/node.md shows the diff).
// One ClaimReply dedups the notification id and claims the message for all replicas; the claim is renewed while
// the LLM drafts; claim.send passes the fenced commit point, sends with the claim's Idempotency-Key, records it.
import crypto from "node:crypto";
import express from "express";
import { ClaimLost, ClaimNotGranted, Coordinator } from "inbox-claims";
import { draftReply } from "./llm.mjs";
import { sendReply } from "./send.mjs";

const app = express();
const SECRET = process.env.NYLAS_WEBHOOK_SECRET ?? "demo-secret";
const seen = new Set(); // this process's memory only
const coord = new Coordinator({ target: process.env.INBOX_COORDINATOR ?? "127.0.0.1:50051", principal: process.env.PRINCIPAL ?? "agent-1" });

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
  await claim.send(() => sendReply(message.grant_id, message, draft, claim.idempotencyKey));
  }).catch((error) => { if (!(error instanceof ClaimNotGranted || error instanceof ClaimLost)) throw error; });
});

const server = app.listen(Number(process.env.PORT ?? 8001), "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
