// The mailbox's own messages, as the Python client handles them, against a real coordinator pair on a real etcd: an
// outgoing message never reaches the work, the agent's own reply is recognised when it comes back, a person
// answering from "Gmail" stops the agent drafting (its signal aborts), and the middleware answers 503 while the
// coordinator cannot record a notification. The rules' shared cases (conformance/outgoing.json) run in
// conformance.test.ts.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { setTimeout as sleep } from "node:timers/promises";
import { Cluster } from "../src/testing.js";
import { Nylas } from "../src/nylas.js";
import {
  ClaimLost,
  Coordinator,
  OutgoingMessage,
  OutgoingRules,
  messageSubject,
  nylasWebhookListener,
  signNylas,
  type Claim,
  type Envelope,
} from "../src/index.js";

test("the settings come from the options or the environment, and a bad one is refused", () => {
  process.env["INBOX_SENT_FOLDERS"] = "AAMkSent, INBOX.Sent";
  process.env["INBOX_MAILBOX_ADDRESSES"] = "Support@Shop.example";
  try {
    const fromEnv = new Coordinator({ principal: "agent-1" });
    assert.deepEqual([...fromEnv.outgoing.sentFolders], ["SENT", "AAMkSent", "INBOX.Sent"]);
    assert.deepEqual([...fromEnv.outgoing.mailboxAddresses], ["support@shop.example"]);
    fromEnv.close();
    const given = new Coordinator({ principal: "agent-1", sentFolders: ["Sent"], mailboxAddresses: [] });
    assert.deepEqual([...given.outgoing.sentFolders], ["SENT", "Sent"]);
    assert.equal(given.outgoing.mailboxAddresses.size, 0);
    given.close();
  } finally {
    delete process.env["INBOX_SENT_FOLDERS"];
    delete process.env["INBOX_MAILBOX_ADDRESSES"];
  }
  assert.throws(() => new OutgoingRules([], ["support"]), /mailboxAddresses: "support" is not an email address/);
});

let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 2, minTtl: 2 });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
const unique = (name: string): string => `${name}-${process.pid}-${++counter}`;
const ASKED = 1_700_000_000;
const ANSWERED = 1_700_000_300;

/** A Nylas v3 message notification, as JSON.parse gives it. */
function envelope(mailbox: string, messageId: string, threadId: string, options: { date?: number; folders?: string[]; from?: string; name?: string } = {}): Envelope {
  return {
    specversion: "1.0",
    type: "message.created",
    id: unique("notif"),
    time: (options.date ?? ASKED) + 2,
    data: {
      object: {
        id: messageId,
        grant_id: mailbox,
        thread_id: threadId,
        object: "message",
        subject: "Where is my order?",
        date: options.date ?? ASKED,
        folders: options.folders ?? ["INBOX"],
        from: [{ name: options.name ?? "Bea Costa", email: options.from ?? "bea@example.org" }],
      },
    },
  };
}

const fromGmail = (mailbox: string, threadId: string): Envelope =>
  envelope(mailbox, unique("gmail"), threadId, { date: ANSWERED, folders: ["SENT"], from: "ana@shop.example", name: "Ana Lima" });

class Lines {
  readonly lines: string[] = [];
  info(message: string): void {
    this.lines.push(message);
  }
}

test("an outgoing message never reaches the work, is recorded, and says why in one log line", async () => {
  const mailbox = unique("out");
  const lines = new Lines();
  const agent = cluster.client("agent-a", { mailboxAddresses: ["support@shop.example"], logger: lines });
  const other = cluster.client("agent-b", { replica: 1, mailboxAddresses: ["support@shop.example"], logger: lines });
  const thread = unique("thread");
  let ran = 0;
  await agent.replyTo(envelope(mailbox, "m-1", thread), { ttl: 30 }, async (claim) => {
    const refusal = await other
      .replyTo(fromGmail(mailbox, thread), {}, async () => {
        ran += 1;
      })
      .then(
        () => undefined,
        (error: unknown) => error,
      );
    assert.ok(refusal instanceof OutgoingMessage, String(refusal));
    assert.equal(refusal.result?.outcome, "ANSWERED_OUTSIDE");
    assert.deepEqual(refusal.result?.subjects.map((status) => status.subject.id), ["m-1"]);
    // From the mailbox's own address, in a folder the rules do not know: outgoing too.
    const own = envelope(mailbox, unique("outlook"), thread, { date: ANSWERED, folders: ["AAMk-sent"], from: "support@shop.example" });
    await assert.rejects(other.replyTo(own, {}, async () => void (ran += 1)), OutgoingMessage);
    assert.ok(claim.status !== undefined);
  });
  assert.equal(ran, 0);
  const status = await agent.status(messageSubject(mailbox, "m-1"));
  assert.equal(status.state, "REPLIED");
  assert.equal(status.repliedOutside, true);
  assert.equal(status.holder, "Ana Lima <ana@shop.example>");
  assert.equal(status.outsideReply?.stoppedHolder, "agent-a");
  assert.equal(lines.lines.length, 2);
  assert.match(lines.lines[0]!, /it is outgoing, it is in the sent folder "SENT"; recorded as a reply written outside the coordinator; it answered message "m-1"/);
  assert.match(lines.lines[1]!, /it is from the mailbox's own address "support@shop.example"/);
});

test("the agent's own reply coming back is recognised and not answered", async () => {
  const mailbox = unique("echo");
  const agent = cluster.client("agent-a", { logger: new Lines() });
  const thread = unique("thread");
  await agent.replyTo(envelope(mailbox, "m-1", thread), { ttl: 30 }, async (claim) => {
    await claim.send(() => "sent-1");
  });
  const echo = envelope(mailbox, "sent-1", thread, { date: ASKED + 5, folders: ["SENT"], from: "support@shop.example" });
  const refusal = await agent.replyTo(echo, {}, async () => assert.fail("never")).then(
    () => undefined,
    (error: unknown) => error,
  );
  assert.ok(refusal instanceof OutgoingMessage);
  assert.equal(refusal.result?.outcome, "OWN_REPLY");
  const status = await agent.status(messageSubject(mailbox, "m-1"));
  assert.equal(status.repliedOutside, false);
  assert.equal(status.holder, "agent-a");
});

test("a person answering from Gmail aborts the drafting agent's signal; its send is refused", async () => {
  const mailbox = unique("gmail");
  const agent = cluster.client("agent-a", { logger: new Lines() });
  const webhook = cluster.client("agent-b", { replica: 1, logger: new Lines() });
  const thread = unique("thread");
  let sends = 0;
  const error = await agent
    .replyTo(envelope(mailbox, "m-1", thread), { ttl: 3 }, async (claim) => {
      await assert.rejects(webhook.replyTo(fromGmail(mailbox, thread), {}, async () => undefined), OutgoingMessage);
      // drafting: the renewal (every second) learns that a person answered and aborts the signal
      await untilAborted(claim);
      await claim.send(async () => {
        sends += 1;
        return "never";
      });
    })
    .then(
      () => undefined,
      (e: unknown) => e,
    );
  assert.ok(error instanceof ClaimLost, String(error));
  assert.equal(error.reason, "answered_outside");
  assert.match(error.message, /someone answered it from the mailbox: Ana Lima <ana@shop.example> at /);
  assert.equal(sends, 0);
  // A question asked in the thread after the person's reply is new: it is answered.
  let answered = 0;
  await agent.replyTo(envelope(mailbox, "m-2", thread, { date: ANSWERED + 60 }), { ttl: 30 }, async () => void (answered += 1));
  assert.equal(answered, 1);
});

test("a claim made without its notification, given the thread and when the message arrived, is ended by a reply from the mailbox too", async () => {
  const mailbox = unique("target");
  const agent = cluster.client("agent-a", { logger: new Lines() });
  const relay = cluster.client("helpdesk-relay", { replica: 1, logger: new Lines() });
  const thread = unique("thread");
  const asked = new Date((ANSWERED - 300) * 1000);
  let sends = 0;
  const error = await agent
    .replyTo({ mailbox, messageId: "m-1", threadId: thread, receivedAt: asked }, { ttl: 3 }, async (claim) => {
      await relay.recordOutgoing(mailbox, unique("gmail"), thread, new Date(ANSWERED * 1000), { sender: "ana@shop.example" });
      await untilAborted(claim);
      await claim.send(async () => String((sends += 1)));
    })
    .then(
      () => undefined,
      (e: unknown) => e,
    );
  assert.ok(error instanceof ClaimLost, String(error));
  assert.equal(error.reason, "answered_outside");
  assert.equal(sends, 0);
  // Without the arrival time the claim is in no thread: the same reply leaves it, and its send goes out.
  await agent.replyTo({ mailbox, messageId: "m-2", threadId: thread }, { ttl: 30 }, async (claim) => {
    await relay.recordOutgoing(mailbox, unique("gmail"), thread, new Date((ANSWERED + 60) * 1000), { sender: "ana@shop.example" });
    await claim.send(async () => "sent-m-2");
  });
});

/** While the agent drafts: until the claim's signal aborts (8 s at most), which it must. */
async function untilAborted(claim: Claim): Promise<void> {
  await new Promise<void>((resolve) => {
    const timer = setTimeout(resolve, 8_000);
    claim.signal.addEventListener("abort", () => (clearTimeout(timer), resolve()), { once: true });
  });
  assert.ok(claim.signal.aborted, "the signal never aborted");
}

async function listen(server: Server): Promise<string> {
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/webhooks/nylas`;
}

test("the middleware answers 503 while the coordinator cannot record a notification, and the redelivery is answered once", async () => {
  const mailbox = unique("lost");
  const SECRET = "lost-secret";
  const sends: string[] = [];
  const coordinator = cluster.client("agent-lost", { replica: 1, retry: { attempts: 3, initialBackoffMs: 50, maxBackoffMs: 200 }, timeoutMs: 500, logger: new Lines() });
  const warnings: string[] = [];
  const onWarning = (warning: Error): void => void warnings.push(warning.message);
  process.on("warning", onWarning);
  const listener = nylasWebhookListener({
    secret: SECRET,
    coordinator,
    admissionTimeoutMs: 1000,
    work: async (notification, claim) => {
      await claim.send(() => {
        sends.push(notification.messageId ?? "");
        return `sent-${sends.length}`;
      });
    },
  });
  const server = createServer(listener);
  const url = await listen(server);
  const body = Buffer.from(JSON.stringify(envelope(mailbox, "m-1", unique("thread"))));
  const post = (): Promise<Response> => fetch(url, { method: "POST", body, headers: { "x-nylas-signature": signNylas(body, SECRET) } });
  try {
    await cluster.stopReplica(1);
    const started = performance.now();
    const refused = await post();
    assert.ok(performance.now() - started < 2500, "the answer took longer than the admission bound");
    assert.equal(refused.status, 503);
    assert.equal(refused.headers.get("retry-after"), "5");
    assert.equal(sends.length, 0);
    await cluster.startReplica(1);
    let status = 0;
    for (let attempt = 0; attempt < 10 && status !== 200; attempt++) {
      status = (await post()).status; // Nylas delivers again until it gets a 2xx
      if (status !== 200) await sleep(200);
    }
    assert.equal(status, 200);
    assert.equal((await post()).status, 200); // once more, a duplicate
    await listener.drain();
    assert.deepEqual(sends, ["m-1"]);
    assert.ok(warnings.some((warning) => /answered 503, the coordinator did not record it/.test(warning)));
  } finally {
    process.off("warning", onWarning);
    server.closeAllConnections();
    server.close();
  }
});

test("Nylas.sentFolderIds finds the grant's sent folders by their attribute, across pages", async () => {
  const folders = [
    { id: "AAMkInbox", attributes: ["\\Inbox"] },
    { id: "AAMkSent", attributes: ["\\Sent"] },
    { id: "AAMkArchive" },
    { id: "INBOX.Sent", attributes: ["\\HasNoChildren", "\\Sent"] },
  ];
  const server = createServer((req, res) => {
    const url = new URL(req.url ?? "/", "http://x");
    assert.equal(req.headers.authorization, "Bearer nyk");
    assert.equal(url.pathname, "/v3/grants/grant%2F1/folders");
    const start = Number(url.searchParams.get("page_token") ?? "0");
    const page = { data: folders.slice(start, start + 2), ...(start + 2 < folders.length ? { next_cursor: String(start + 2) } : {}) };
    res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify(page));
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  try {
    const nylas = new Nylas("nyk", { apiBase: `http://127.0.0.1:${(server.address() as AddressInfo).port}` });
    assert.deepEqual(await nylas.sentFolderIds("grant/1"), ["AAMkSent", "INBOX.Sent"]);
  } finally {
    server.close();
  }
});
