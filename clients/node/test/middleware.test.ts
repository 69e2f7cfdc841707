// The Express middleware and the node:http listener: challenge, signature, envelope, 200 before the guarded work.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import express from "express";
import { Cluster } from "../src/testing.js";
import { messageSubject, nylasWebhook, nylasWebhookListener, signNylas, type Claim, type Notification, type WebhookHandler, type WebhookOptions } from "../src/index.js";

const SECRET = "middleware-secret";
let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 1 });
});
after(async () => {
  await cluster?.stop();
});

function body(id: string, messageId: string, mailbox: string, type = "message.created"): Buffer {
  return Buffer.from(JSON.stringify({ id, type, data: { object: { id: messageId, grant_id: mailbox, object: "message" } } }));
}

async function listen(server: Server): Promise<string> {
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/webhooks/nylas`;
}

for (const variant of ["express", "node:http"] as const) {
  test(`${variant}: challenge, 401 on a bad signature, 400 on a bad envelope, 413 over the limit, 200 at once and the work after`, async () => {
    const mailbox = `mw-${variant}-${process.pid}`;
    let release!: () => void;
    const gate = new Promise<void>((ok) => (release = ok));
    const worked: { notification: Notification; claim: Claim }[] = [];
    const options: WebhookOptions = {
      secret: SECRET,
      coordinator: cluster.client("agent-mw"),
      ttl: 30,
      maxBodyBytes: 4096,
      work: async (notification, claim) => {
        worked.push({ notification, claim });
        await gate; // the response went out long before this returns
        await claim.send(() => "sent-1");
      },
    };
    let server: Server;
    let handler: WebhookHandler;
    if (variant === "express") {
      const middleware = nylasWebhook(options);
      server = createServer(express().all("/webhooks/nylas", express.raw({ type: "*/*" }), middleware));
      handler = middleware;
    } else {
      const listener = nylasWebhookListener(options);
      server = createServer(listener);
      handler = listener;
    }
    const url = await listen(server);
    try {
      const challenge = await fetch(`${url}?challenge=abc123`);
      assert.equal(challenge.status, 200);
      assert.equal(await challenge.text(), "abc123");
      const post = (raw: Buffer, signature = signNylas(raw, SECRET)) =>
        fetch(url, { method: "POST", body: raw, headers: { "x-nylas-signature": signature, "content-type": "application/json" } });
      const good = body("n1", "m1", mailbox);
      assert.equal((await post(good, signNylas(good, "wrong"))).status, 401);
      assert.equal((await post(good, "abc")).status, 401);
      assert.equal((await post(Buffer.from("{}"))).status, 400);
      assert.equal((await post(Buffer.alloc(5000, 0x20))).status, 413);
      assert.equal(worked.length, 0); // nothing was claimed for any of those

      const answer = await post(good);
      assert.equal(answer.status, 200);
      while (worked.length === 0) await new Promise((ok) => setTimeout(ok, 10));
      assert.equal(worked[0]!.notification.messageId, "m1");
      assert.equal((await cluster.client("probe").status(messageSubject(mailbox, "m1"))).state, "CLAIMED");
      assert.equal((await post(good)).status, 200); // a redelivery is answered 200 and dropped by the claim
      for (let i = 0; i < 200 && handler.running > 1; i++) await new Promise((ok) => setTimeout(ok, 10)); // the redelivery's refusal
      assert.equal(handler.running, 1); // the first delivery's work, still waiting on the gate
      release();
      await handler.drain();
      assert.equal(handler.running, 0);
      let state = "";
      for (let i = 0; i < 100 && state !== "REPLIED"; i++) {
        state = (await cluster.client("probe").status(messageSubject(mailbox, "m1"))).state;
        await new Promise((ok) => setTimeout(ok, 20));
      }
      assert.equal(state, "REPLIED");
      assert.equal(worked.length, 1);
    } finally {
      server.closeAllConnections();
      server.close();
    }
  });
}
