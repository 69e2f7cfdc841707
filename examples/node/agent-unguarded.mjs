// A Nylas webhook agent as the well-known examples write it: verify the signature, answer 200, skip
// notification ids already seen, draft with an LLM, send. It replies twice when Nylas redelivers to another
// replica, when message.created and message.updated both arrive, or when a human is already answering.
import crypto from "node:crypto";
import express from "express";
import { draftReply } from "./llm.mjs";

const app = express();
const SECRET = process.env.NYLAS_WEBHOOK_SECRET ?? "demo-secret";
const NYLAS_API = process.env.NYLAS_API_BASE ?? "https://api.us.nylas.com";
const seen = new Set(); // this process's memory only

async function sendReply(grantId, message, draft) {
  const response = await fetch(`${NYLAS_API}/v3/grants/${encodeURIComponent(grantId)}/messages/send`, {
    method: "POST",
    headers: { authorization: `Bearer ${process.env.NYLAS_API_KEY}`, "content-type": "application/json" },
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
  const draft = await draftReply(message);
  await sendReply(message.grant_id, message, draft);
});

const server = app.listen(Number(process.env.PORT ?? 8001), "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
