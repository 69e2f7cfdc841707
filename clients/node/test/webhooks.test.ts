// Webhook signatures, the envelope parser and the Nylas send helper's status rules. What the Python client must
// agree on (the idempotency key, signatures, envelopes) is in conformance/*.json, run by conformance.test.ts.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import {
  nylasChallengeResponse,
  parseNotification,
  signNylas,
  signStandardWebhook,
  verifyNylasSignature,
  verifyStandardWebhook,
  EnvelopeError,
  WebhookVerificationError,
} from "../src/index.js";
import { Nylas, NylasDuplicateSend, NylasSendRejected, NylasSendUnknown } from "../src/nylas.js";

const SECRET = "nylas-webhook-secret";
const BODY = Buffer.from('{"id":"n1","type":"message.created","data":{"object":{"id":"m1","grant_id":"g1"}}}');

test("Nylas signature: the right one passes, a flipped byte, a wrong length or a missing header fail", () => {
  const signature = signNylas(BODY, SECRET);
  verifyNylasSignature(BODY, signature, SECRET);
  verifyNylasSignature(BODY, ` ${signature.toUpperCase()} `, SECRET);
  const flipped = Buffer.from(BODY);
  flipped[5] = flipped[5]! ^ 0x01;
  assert.throws(() => verifyNylasSignature(flipped, signature, SECRET), WebhookVerificationError);
  const wrongDigit = (signature[0] === "a" ? "b" : "a") + signature.slice(1);
  assert.throws(() => verifyNylasSignature(BODY, wrongDigit, SECRET), /does not match/);
  assert.throws(() => verifyNylasSignature(BODY, signature.slice(0, 63), SECRET), /63 characters, expected 64/);
  assert.throws(() => verifyNylasSignature(BODY, signature + "00", SECRET), /66 characters/);
  assert.throws(() => verifyNylasSignature(BODY, "z".repeat(64), SECRET), /not hexadecimal/);
  assert.throws(() => verifyNylasSignature(BODY, undefined, SECRET), /missing x-nylas-signature/);
  assert.throws(() => verifyNylasSignature(BODY, signature, "another-secret"), WebhookVerificationError);
  assert.throws(() => verifyNylasSignature(BODY, signature, ""), TypeError);
});

test("the Nylas challenge is echoed; empty, repeated or oversized ones are refused", () => {
  assert.equal(nylasChallengeResponse(new URLSearchParams("challenge=abc%20def")), "abc def");
  assert.equal(nylasChallengeResponse(new URLSearchParams("other=1")), undefined);
  assert.throws(() => nylasChallengeResponse(new URLSearchParams("challenge=")), /empty/);
  assert.throws(() => nylasChallengeResponse(new URLSearchParams("challenge=a&challenge=b")), /single string/);
  assert.throws(() => nylasChallengeResponse({ challenge: "x".repeat(1025) }), /1025 characters/);
});

test("Standard Webhooks: the specification's test vector, tampering, and the timestamp tolerance", () => {
  const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
  const body = Buffer.from('{"test": 2432232314}');
  const msgId = "msg_p5jXN8AQM9LWM0D4loKWxJek";
  const timestamp = 1614265330;
  const expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
  assert.equal(signStandardWebhook(body, { msgId, timestamp, secret }), expected);
  const headers = { "Webhook-Id": msgId, "webhook-timestamp": String(timestamp), "webhook-signature": `v2,abc ${expected}` };
  verifyStandardWebhook(body, headers, secret, { now: timestamp + 10 });
  verifyStandardWebhook(body, new Headers(headers), secret, { now: timestamp });
  const flipped = Buffer.from(body);
  flipped[3] = flipped[3]! ^ 0x20;
  assert.throws(() => verifyStandardWebhook(flipped, headers, secret, { now: timestamp }), /no v1 signature/);
  assert.throws(() => verifyStandardWebhook(body, { ...headers, "webhook-signature": "v1,AAAA" }, secret, { now: timestamp }), /no well-formed/);
  assert.throws(() => verifyStandardWebhook(body, headers, secret, { now: timestamp + 301 }), /too old/);
  assert.throws(() => verifyStandardWebhook(body, headers, secret, { now: timestamp - 301 }), /too new/);
  const { "Webhook-Id": _dropped, ...withoutId } = headers;
  assert.throws(() => verifyStandardWebhook(body, withoutId, secret, { now: timestamp }), /missing webhook-id/);
});

test("the envelope parser: the two ids, the variants, and errors that name the field", () => {
  const document = {
    specversion: "1.0",
    type: "message.updated.truncated",
    id: "notif-1",
    time: 1723821985,
    webhook_delivery_attempt: 2,
    data: { application_id: "app", object: { id: "msg-1", grant_id: "grant-1", thread_id: "t-1", subject: "Hi" } },
  };
  const n = parseNotification(Buffer.from(JSON.stringify(document)));
  assert.equal(n.notificationId, "notif-1");
  assert.equal(n.messageId, "msg-1");
  assert.equal(n.mailbox, "grant-1");
  assert.equal(n.threadId, "t-1");
  assert.equal(n.baseType, "message.updated");
  assert.equal(n.variant, "truncated");
  assert.equal(n.deliveryAttempt, 2);
  assert.equal(parseNotification({ ...document, type: "message.created.cleaned" }).variant, "cleaned");
  assert.equal(parseNotification({ ...document, type: "message.created.transformed" }).variant, "transformed");
  assert.equal(parseNotification({ ...document, type: "grant.expired", data: {} }).messageId, undefined);
  assert.throws(() => parseNotification({ ...document, data: { object: { grant_id: "g" } } }), /'data.object.id'.*required for message.updated/);
  assert.throws(() => parseNotification({ ...document, id: 7 }), /top-level 'id' must be a string, not a number/);
  assert.throws(() => parseNotification({ ...document, type: "message" }), /not of the form/);
  assert.throws(() => parseNotification("{not json"), EnvelopeError);
  assert.throws(() => parseNotification("[1]"), /must be a JSON object, not an array/);
});

test("the Nylas send helper: 2xx returns the id, 409 is unknown (never 'not sent'), other 4xx rejected, 5xx and timeouts unknown", async () => {
  const seen: { key: string | undefined; auth: string | undefined; body: string }[] = [];
  let answer = { status: 200, body: '{"request_id":"r1","data":{"id":"sent-1"}}' };
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (chunk: Buffer) => (body += chunk.toString()));
    req.on("end", () => {
      seen.push({ key: req.headers["idempotency-key"] as string | undefined, auth: req.headers.authorization, body });
      if (answer.status === 0) return; // never answer: the client's timeout decides
      res.writeHead(answer.status, { "content-type": "application/json" }).end(answer.body);
    });
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const apiBase = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  const nylas = new Nylas("api-key", { apiBase, timeoutMs: 10_000 });
  const reply = { replyToMessageId: "m1", to: ["customer@example.com"], subject: "Re: Hi", body: "Hello" };
  try {
    assert.equal(await nylas.send("grant/1", reply, { idempotencyKey: "ic1-abc" }), "sent-1");
    assert.equal(seen[0]!.key, "ic1-abc");
    assert.equal(seen[0]!.auth, "Bearer api-key");
    // An agent's reply, marked so (RFC 3834); reply_to_message_id makes Nylas write In-Reply-To and References.
    const sentBody = { custom_headers: [{ name: "Auto-Submitted", value: "auto-replied" }], reply_to_message_id: "m1", to: [{ email: "customer@example.com" }], subject: "Re: Hi", body: "Hello" };
    assert.deepEqual(JSON.parse(seen[0]!.body), sentBody);
    answer = { status: 409, body: '{"error":{"type":"idempotency_key_conflict","message":"in flight"}}' };
    await assert.rejects(nylas.send("g", reply, { idempotencyKey: "k" }), (e: unknown) => e instanceof NylasDuplicateSend && e.statusCode === 409);
    for (const status of [400, 401, 404, 422, 429]) {
      answer = { status, body: '{"error":{"type":"invalid_request_error","message":"bad"}}' };
      await assert.rejects(nylas.send("g", reply, { idempotencyKey: "k" }), (e: unknown) => e instanceof NylasSendRejected && e.statusCode === status);
    }
    for (const status of [500, 502, 503]) {
      answer = { status, body: "oops" };
      await assert.rejects(nylas.send("g", reply, { idempotencyKey: "k" }), (e: unknown) => e instanceof NylasSendUnknown && !(e instanceof NylasDuplicateSend) && e.statusCode === status);
    }
    answer = { status: 0, body: "" };
    const impatient = new Nylas("api-key", { apiBase, timeoutMs: 300 });
    await assert.rejects(impatient.send("g", reply, { idempotencyKey: "k" }), (e: unknown) => e instanceof NylasSendUnknown && e.statusCode === undefined && /timed out/.test(e.message));
    await assert.rejects(nylas.send("g", reply, { idempotencyKey: "" }), TypeError);
  } finally {
    server.closeAllConnections();
    server.close();
  }
});
