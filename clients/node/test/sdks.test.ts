// The SDKs people already send with, as published on npm (nylas 7.x, resend, agentmail: devDependencies), under the
// guard, through a real coordinator on etcd, each against a local double of its API (test/mailapis.ts): the claim's
// key reaches the API as Idempotency-Key through the SDK's own per-request options (Nylas `overrides.headers`,
// Resend and AgentMail `idempotencyKey`), the claim's stamp and an agent's Auto-Submitted as message headers (Nylas
// `customHeaders`, Resend's and AgentMail's `headers`: claimCustomHeaders / claimHeaders), never Auto-Submitted on a
// person's reply, the caller's own headers kept and winning; the SDK's response passed straight back from claim.send records the sent
// id; a 4xx through the SDK frees the message (FREE) as our own adapters do; a send made inside the guarded work
// without claim.send is said loudly (the nylas SDK's, over node:http, refused before it left; resend's and
// agentmail's, over fetch, warned about).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import NylasSdk from "nylas";
import { Resend } from "resend";
import { AgentMailClient } from "agentmail";
import { Cluster } from "../src/testing.js";
import { claimCustomHeaders, claimHeaders, idempotencyKey, idempotencyOverrides, messageSubject, UNGUARDED_SEND_WARNING, type Coordinator } from "../src/index.js";
import { AgentMailDouble, NylasDouble, ResendDouble, secretOf } from "./mailapis.js";

let cluster: Cluster;
let agent: Coordinator;
let person: Coordinator;
before(async () => {
  cluster = await Cluster.start({ replicas: 1 });
  agent = cluster.client("agent-a");
  person = cluster.client("ana@shop.example", { kind: "human" });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
// The package's types declare its class as the module's `default` (CommonJS types), while Node's ESM loader gives the class itself.
const Nylas = NylasSdk as unknown as typeof NylasSdk.default;

/** The process warnings with `code` that `run` causes. */
async function warningsOf(code: string, run: () => Promise<void>): Promise<string[]> {
  const seen: string[] = [];
  const listen = (warning: Error & { code?: string }): void => void (warning.code === code && seen.push(warning.message));
  process.on("warning", listen);
  try {
    await run();
    await new Promise((ok) => setImmediate(ok)); // warnings are emitted on the next tick
  } finally {
    process.off("warning", listen);
  }
  return seen;
}

/**
 * One SDK's cases: `send(key, to, headers)` sends to `to` with the key (undefined: without it), the claim's marks and
 * the caller's own `headers`, and resolves to the SDK's answer.
 */
interface Sdk {
  double: NylasDouble | ResendDouble | AgentMailDouble;
  /** The message the guarded work answers (the double must know it). */
  messageId: string;
  send(idempotencyKey: string | undefined, to: string, headers?: Record<string, string>): Promise<unknown>;
  /** Whether the process can stop the SDK's unguarded send (node:http) or only warn (fetch). */
  refusable: boolean;
  stop(): Promise<void>;
}

async function nylasSdk(): Promise<Sdk> {
  const grant = `grant-${process.pid}-${++counter}`;
  const double = await new NylasDouble(grant).start();
  const nylas = new Nylas({ apiKey: double.apiKey, apiUri: double.url });
  return {
    double,
    messageId: `m-${counter}`,
    send: (key, to, headers = {}) =>
      nylas.messages.send({
        identifier: grant,
        requestBody: {
          to: [{ email: to }],
          subject: "Re: Where is my order?",
          body: "Ships today.",
          replyToMessageId: `m-${counter}`,
          customHeaders: claimCustomHeaders(Object.entries(headers).map(([name, value]) => ({ name, value }))),
        },
        ...(key === undefined ? {} : { overrides: idempotencyOverrides(key) }),
      }),
    refusable: true,
    stop: () => double.stop(),
  };
}

async function resendSdk(): Promise<Sdk> {
  const mailbox = `support-${process.pid}-${++counter}@shop.example`;
  const double = await new ResendDouble(mailbox, secretOf("unused")).start();
  const resend = new Resend(double.apiKey, { baseUrl: double.url });
  return {
    double,
    messageId: `r-${counter}`,
    send: (key, to, headers = {}) =>
      resend.emails.send({ from: mailbox, to: [to], subject: "Re: Where is my order?", text: "Ships today.", headers: claimHeaders(headers) }, key === undefined ? {} : { idempotencyKey: key }),
    refusable: false,
    stop: () => double.stop(),
  };
}

async function agentmailSdk(): Promise<Sdk> {
  const inbox = `support-${process.pid}-${++counter}@agentmail.to`;
  const double = await new AgentMailDouble(inbox, secretOf("unused")).start();
  const client = new AgentMailClient({ apiKey: double.apiKey, baseUrl: double.url, maxRetries: 0 });
  const original = String((double.receive("Bea Costa <bea@example.org>", "Where is my order?").message as Record<string, unknown>).message_id);
  return {
    double,
    messageId: original,
    // AgentMail answers a reply to its sender; `to` stands for a recipient it refuses (an empty text is refused too).
    send: (key, to, headers = {}) =>
      client.inboxes.messages.reply(inbox, original, to.includes("@") ? { text: "Ships today.", headers: claimHeaders(headers) } : {}, key === undefined ? {} : { idempotencyKey: key }),
    refusable: false,
    stop: () => double.stop(),
  };
}

const SDKS = { nylas: nylasSdk, resend: resendSdk, agentmail: agentmailSdk };

for (const [name, make] of Object.entries(SDKS)) {
  test(`${name} SDK: the claim's key reaches the API as Idempotency-Key through the SDK's per-request options, and the SDK's answer passed back records the sent id`, async () => {
    const sdk = await make();
    try {
      const mailbox = `sdk-${name}-${process.pid}-${counter}`;
      const sent = await agent.replyTo({ mailbox, messageId: sdk.messageId, notificationId: `n-${counter}` }, { ttl: 10 }, async (claim) => claim.send((key) => sdk.send(key, "bea@example.org") as Promise<string>));
      assert.equal(sdk.double.sends.length, 1);
      const [reply] = sdk.double.sends;
      assert.equal(reply!.key, idempotencyKey(messageSubject(mailbox, sdk.messageId)));
      assert.equal(sent, reply!.id);
      const recorded = await agent.status(messageSubject(mailbox, sdk.messageId));
      assert.deepEqual([recorded.state, recorded.sentMessageId], ["REPLIED", reply!.id]);
    } finally {
      await sdk.stop();
    }
  });

  test(`${name} SDK: the reply carries the claim's stamp (X-Inbox-Claim: <key>.<token>) and, from an agent, Auto-Submitted: auto-replied; a person's reply is stamped, never marked; the caller's headers are kept and win`, async () => {
    for (const [who, coordinator] of [["agent", agent], ["person", person]] as const) {
      const sdk = await make();
      try {
        const mailbox = `sdk-${name}-${who}-${process.pid}-${counter}`;
        let stamp = "";
        await coordinator.replyTo({ mailbox, messageId: sdk.messageId }, { ttl: 10 }, async (claim) => {
          stamp = `${claim.idempotencyKey}.${claim.token}`;
          return claim.send((key) => sdk.send(key, "bea@example.org", { "X-Ticket": "T-42", "x-inbox-claim-note": "kept" }) as Promise<string>);
        });
        assert.equal(sdk.double.sends.length, 1);
        const headers = Object.fromEntries(Object.entries(sdk.double.sends[0]!.headers).map(([k, v]) => [k.toLowerCase(), v]));
        const key = idempotencyKey(messageSubject(mailbox, sdk.messageId));
        assert.match(stamp.slice(key.length), /^\.[1-9]\d*$/); // the key, then the granted token
        assert.ok(stamp.startsWith(key));
        assert.equal(headers["x-inbox-claim"], stamp);
        assert.equal(headers["auto-submitted"], who === "agent" ? "auto-replied" : undefined);
        assert.deepEqual([headers["x-ticket"], headers["x-inbox-claim-note"]], ["T-42", "kept"]);
      } finally {
        await sdk.stop();
      }
    }
    // A header the caller set wins over ours of the same name, in any case (here outside any claim: no stamp).
    assert.deepEqual(claimHeaders({ "auto-submitted": "no" }), { "auto-submitted": "no" });
    assert.deepEqual(claimCustomHeaders([{ name: "AUTO-SUBMITTED", value: "no" }]), [{ name: "AUTO-SUBMITTED", value: "no" }]);
    assert.deepEqual(claimHeaders(), { "Auto-Submitted": "auto-replied" });
  });

  test(`${name} SDK: a 4xx through the SDK frees the message (FREE, nothing sent), as our own adapters do; a 5xx leaves it in doubt`, async () => {
    const sdk = await make();
    try {
      const mailbox = `sdk-${name}-${process.pid}-${counter}`;
      await assert.rejects(
        agent.replyTo({ mailbox, messageId: sdk.messageId }, { ttl: 10 }, async (claim) => claim.send((key) => sdk.send(key, "not-an-address") as Promise<string>)),
        (error: Error) => error.name === "SendRejected" && /HTTP 4\d\d/.test(error.message),
      );
      assert.equal(sdk.double.sends.length, 0);
      assert.equal((await agent.status(messageSubject(mailbox, sdk.messageId))).state, "FREE");
      sdk.double.sendFailure = "unavailable";
      const other = `${mailbox}-503`;
      await assert.rejects(
        agent.replyTo({ mailbox: other, messageId: sdk.messageId }, { ttl: 10 }, async (claim) => claim.send((key) => sdk.send(key, "bea@example.org") as Promise<string>)),
        (error: Error) => error.name === "SendOutcomeUnknown",
      );
      assert.equal((await agent.status(messageSubject(other, sdk.messageId))).state, "SENDING"); // IN_DOUBT after the send timeout
    } finally {
      await sdk.stop();
    }
  });

  test(`${name} SDK: a send inside the guarded work without claim.send is said loudly${name === "nylas" ? " and refused before it leaves" : ""}; the message stays unanswered in the coordinator`, async () => {
    const sdk = await make();
    try {
      const mailbox = `sdk-${name}-${process.pid}-${counter}`;
      let failure: unknown;
      const warnings = await warningsOf(UNGUARDED_SEND_WARNING, async () => {
        await agent
          .replyTo({ mailbox, messageId: sdk.messageId }, { ttl: 10 }, async () => {
            await sdk.send(undefined, "bea@example.org"); // the SDK called directly: no commit point passed
          })
          .catch((error: unknown) => (failure = error));
      });
      assert.equal(warnings.length, 1, warnings.join("\n"));
      assert.match(warnings[0]!, new RegExp(`without claim\\.send.*${sdk.refusable ? "refused and nothing was sent" : "went out unguarded"}`));
      assert.equal(sdk.double.sends.length, sdk.refusable ? 0 : 1);
      if (sdk.refusable) assert.match(String(failure), /without claim\.send/);
      assert.equal((await agent.status(messageSubject(mailbox, sdk.messageId))).state, "FREE");
      // Outside any guarded work the guard says nothing: a send of another kind (a newsletter) is none of its business.
      const outside = await warningsOf(UNGUARDED_SEND_WARNING, async () => void (await sdk.send(undefined, "bea@example.org")));
      assert.deepEqual(outside, []);
    } finally {
      await sdk.stop();
    }
  });
}
