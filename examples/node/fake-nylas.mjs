// A stand-in for the Nylas v3 send endpoint on a loopback port: checks the bearer key and Idempotency-Key, records
// every send. Idempotency as Nylas documents it: a key seen before with the same payload replays the first answer,
// with another payload 409. `onSend(sent)`, if given, is called with each new send before it is answered (Nylas's
// own notification of a sent message can come before the send's answer).
import { createServer } from "node:http";

export async function startFakeNylas(apiKey, { onSend } = {}) {
  const sends = [];
  const problems = [];
  const keys = new Map();
  const server = createServer((req, res) => {
    const chunks = [];
    req.on("data", (chunk) => chunks.push(chunk));
    req.on("end", () => {
      const body = Buffer.concat(chunks).toString("utf8");
      const match = /^\/v3\/grants\/([^/]+)\/messages\/send$/.exec(req.url ?? "");
      const key = req.headers["idempotency-key"];
      const answer = (status, document) => res.writeHead(status, { "content-type": "application/json" }).end(JSON.stringify(document));
      if (req.method !== "POST" || !match || req.headers.authorization !== `Bearer ${apiKey}` || !key) {
        problems.push(`${req.method} ${req.url} key=${key}`);
        return answer(400, { error: { type: "invalid_request_error", message: "bad request" } });
      }
      const seen = keys.get(`${match[1]} ${key}`);
      if (seen !== undefined) {
        return seen.body === body ? answer(200, seen.answer) : answer(409, { error: { type: "idempotency_key_conflict", message: "key reused" } });
      }
      const payload = JSON.parse(body);
      const id = `sent-${sends.length + 1}`;
      sends.push({ id, grantId: decodeURIComponent(match[1]), idempotencyKey: key, payload });
      const document = { request_id: `req-${id}`, data: { id } };
      keys.set(`${match[1]} ${key}`, { body, answer: document });
      Promise.resolve(onSend?.(sends[sends.length - 1])).finally(() => answer(200, document));
    });
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  return {
    apiBase: `http://127.0.0.1:${server.address().port}`,
    sends,
    problems,
    sendsFor: (messageId) => sends.filter((s) => s.payload.reply_to_message_id === messageId),
    close: () => new Promise((ok) => server.close(ok)),
  };
}
