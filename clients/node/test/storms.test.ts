// Reply storms (docs/design.md#reply-storms) through the Node client, against a real coordinator pair on a real etcd
// (the coordinator's own tests: tests/server/test_reply_storms.py): the agents' reply budget per thread and per
// correspondent refused at the commit point with its own exception (and across both replicas exactly one agent gets
// the last unit), a conversation that moved on, automated mail recorded for people and never handed to the work,
// and the look before a send (Nylas, on the repository's Nylas API double, tests/providers/fake_nylas_api.py) that
// finds the customer's newer message or a person's reply first. People are never refused.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { Cluster } from "../src/testing.js";
import { Double } from "./doubles.js";
import { Nylas, replyTo as nylasReply } from "../src/nylas.js";
import {
  AutomatedMessage,
  ClaimLost,
  ConversationMovedOn,
  Coordinator,
  messageSubject,
  nylasWebhookListener,
  parseNotification,
  ReplyBudgetSpent,
  ReplyRefused,
  signNylas,
  type Claim,
  type Envelope,
  type Notification,
} from "../src/index.js";

let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 2, minTtl: 2 });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
const unique = (name: string): string => `${name}-${process.pid}-${++counter}`;
const ASKED = 1_796_220_000; // a message's date, unix seconds

interface Person {
  name?: string;
  email: string;
}

/** A Nylas message object as the API and the notifications give it (`headers` only read with fields=include_headers). */
interface NylasMessage {
  id: string;
  grant_id: string;
  thread_id: string;
  object: "message";
  subject: string;
  from: Person[];
  reply_to: Person[];
  to: Person[];
  date: number;
  folders: string[];
  headers?: { name: string; value: string }[];
}

function message(grant: string, id: string, thread: string, options: { date?: number; from?: Person; folders?: string[]; headers?: Record<string, string> } = {}): NylasMessage {
  return {
    id,
    grant_id: grant,
    thread_id: thread,
    object: "message",
    subject: "Where is my order?",
    from: [options.from ?? { name: "Bea Costa", email: "bea@example.org" }],
    reply_to: [],
    to: [{ email: "support@shop.example" }],
    date: options.date ?? ASKED,
    folders: options.folders ?? ["INBOX"],
    headers: Object.entries({ "Message-ID": `<${id}@mail.example>`, ...options.headers }).map(([name, value]) => ({ name, value })),
  };
}

/** The message.created notification of `m`: as Nylas sends it, without the message's headers. */
function notificationOf(m: NylasMessage): Envelope {
  const { headers: _headers, ...object } = m;
  return { specversion: "1.0", type: "message.created", id: unique("notif"), time: m.date + 2, data: { application_id: "app-1", object } };
}

const KEY = "nylas-key";
type Doc = Record<string, unknown> & { id: string; thread_id: string };
interface Sent { by: "agent" | "person"; id: string; in_reply_to: string }

/** The repository's Nylas API double (tests/providers/fake_nylas_api.py, run by test/doubles.py) for a grant of its own. */
async function nylasDouble(): Promise<{ double: Double; grant: string }> {
  const grant = unique("grant");
  return { double: await Double.start("nylas", { grant_id: grant, api_key: KEY }), grant };
}

/** A message arriving in the double's mailbox (with `headers` of its own), dated `date` (the double's clock is now). */
async function arrives(double: Double, date: number, sender: string, subject: string, thread = "", headers: Record<string, string> = {}): Promise<Doc> {
  const found = await double.callWith<Doc>("receive", [sender, subject, thread], { headers });
  return dated(double, found, date);
}

/** `message` in the double dated `date`: the look's received_after is in seconds, and a test is quicker than one. */
async function dated(double: Double, message: Doc, date: number): Promise<Doc> {
  await double.callAt(["messages", message.id], "__setitem__", "date", date);
  return { ...message, date };
}

/** One agent's reply to a message of `thread` through replyTo and claim.send; what its send function was given. */
async function agentReply(
  agent: Coordinator,
  mailbox: string,
  messageId: string,
  thread: string,
  options: { date?: number; correspondent?: string; beforeSend?: () => Promise<void> } = {},
): Promise<string | undefined> {
  const target = { mailbox, messageId, threadId: thread, receivedAt: new Date((options.date ?? ASKED) * 1000), notificationId: unique("n"), correspondent: options.correspondent };
  return agent.replyTo(target, { ttl: 30 }, async (claim) => {
    await options.beforeSend?.();
    return claim.send(() => `sent-${messageId}`);
  });
}

test("a thread's fourth agent reply within the hour is refused at the commit point: ReplyBudgetSpent, nothing sent, the claim released; a person still answers", async () => {
  const mailbox = unique("budget");
  const thread = unique("thread");
  const agents = [cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })];
  for (let i = 1; i <= 3; i++) assert.equal(await agentReply(agents[i % 2]!, mailbox, `m-${i}`, thread, { date: ASKED + i }), `sent-m-${i}`);
  let called = false;
  let claimed: Claim | undefined;
  const refused = await agents[0]!
    .replyTo({ mailbox, messageId: "m-4", threadId: thread, receivedAt: new Date((ASKED + 4) * 1000), notificationId: unique("n") }, { ttl: 30 }, async (claim) => {
      claimed = claim;
      await claim.send(() => ((called = true), "never"));
    })
    .then(
      () => undefined,
      (error: unknown) => error,
    );
  assert.ok(refused instanceof ReplyBudgetSpent, String(refused));
  assert.ok(refused instanceof ReplyRefused);
  assert.equal(called, false, "the send function ran");
  assert.equal(refused.kind, "REPLY_BUDGET_SPENT");
  assert.equal(refused.scope, "thread");
  assert.equal(refused.limit, 3);
  assert.equal(refused.windowSeconds, 3600);
  assert.equal(refused.counted, 3);
  assert.ok(refused.freesAt instanceof Date);
  assert.match(refused.reason, /^agents stopped: 3 agent replies to this conversation in the last hour — a person should look$/);
  assert.match(refused.message, /agents stopped/);
  // Released, not left held: the other agent is granted the message at once, and refused the same way.
  const subject = messageSubject(mailbox, "m-4");
  const status = await agents[1]!.status(subject);
  assert.notEqual(status.state, "CLAIMED");
  assert.ok(claimed !== undefined && claimed.token > 0n);
  // The refusal is on the claim while it is held (for the people watching), as BeginSend answered it.
  assert.equal(refused.status?.agentsStopped?.kind, "REPLY_BUDGET_SPENT");
  assert.match(refused.status?.agentsStopped?.reason ?? "", /a person should look/);
  await assert.rejects(agentReply(agents[1]!, mailbox, "m-4", thread, { date: ASKED + 4 }), ReplyBudgetSpent);
  // A person's claim and send are never refused, nor counted.
  const person = cluster.client("ana@shop.example", { kind: "human", replica: 1 });
  assert.equal(await agentReply(person, mailbox, "m-4", thread, { date: ASKED + 4 }), "sent-m-4");
  assert.equal((await person.status(subject)).state, "REPLIED");
});

test("24 agents on two replicas race the thread budget's last unit: exactly one sends, the others get ReplyBudgetSpent", async () => {
  const mailbox = unique("race");
  const thread = unique("thread");
  const agents = Array.from({ length: 24 }, (_, i) => cluster.client(`agent-${i}`, { replica: i % 2 }));
  for (let i = 1; i <= 2; i++) await agentReply(agents[i]!, mailbox, `m-${i}`, thread, { date: ASKED + i });
  // Every agent holds its claim on a message of the same burst (same date: none moved on) before any sends.
  let claimed = 0;
  let release!: () => void;
  const allClaimed = new Promise<void>((ok) => (release = ok));
  const outcomes = await Promise.allSettled(
    agents.map((agent, i) =>
      agentReply(agent, mailbox, `burst-${i}`, thread, {
        date: ASKED + 10,
        beforeSend: async () => {
          if (++claimed === agents.length) release();
          await allClaimed;
        },
      }),
    ),
  );
  const sent = outcomes.filter((o) => o.status === "fulfilled");
  const refusals = outcomes.filter((o): o is PromiseRejectedResult => o.status === "rejected").map((o) => o.reason as Error);
  assert.equal(sent.length, 1, refusals.map(String).join("\n"));
  assert.equal(refusals.length, 23);
  for (const refusal of refusals) assert.ok(refusal instanceof ReplyBudgetSpent && refusal.scope === "thread", String(refusal));
});

test("the correspondent's budget spans threads: the eleventh agent reply to one sender in a day is refused, the address compared without case", async () => {
  const mailbox = unique("correspondent");
  const agent = cluster.client("agent-c");
  for (let i = 1; i <= 10; i++) {
    const m = message(mailbox, `c-${i}`, unique("t"), { from: { email: i % 2 ? "Carl@Example.net" : "carl@example.net" } });
    assert.equal(await agent.replyTo(notificationOf(m), { ttl: 30 }, (claim) => claim.send(() => `sent-${i}`)), `sent-${i}`);
  }
  const eleventh = message(mailbox, "c-11", unique("t"), { from: { email: "CARL@example.NET" } });
  const refused = await agent.replyTo(notificationOf(eleventh), { ttl: 30 }, (claim) => claim.send(() => "never")).catch((error: unknown) => error);
  assert.ok(refused instanceof ReplyBudgetSpent, String(refused));
  assert.equal(refused.scope, "correspondent");
  assert.equal(refused.limit, 10);
  assert.equal(refused.windowSeconds, 86400);
  assert.match(refused.reason, /^agents stopped: 10 agent replies to carl@example\.net in the last day — a person should look$/);
});

test("the customer wrote again while the agent drafted: its send is ConversationMovedOn, the claim released; the newer message's claim sends", async () => {
  const mailbox = unique("moved");
  const thread = unique("thread");
  const first = cluster.client("agent-first");
  const second = cluster.client("agent-second", { replica: 1 });
  let drafted!: () => void;
  const drafting = new Promise<void>((ok) => (drafted = ok));
  let called = false;
  const stale = first
    .replyTo({ mailbox, messageId: "m-1", threadId: thread, receivedAt: new Date(ASKED * 1000), notificationId: unique("n") }, { ttl: 30 }, async (claim) => {
      await drafting;
      await claim.send(() => ((called = true), "never"));
    })
    .catch((error: unknown) => error);
  await new Promise((ok) => setTimeout(ok, 200)); // the first agent holds m-1 and drafts
  // The customer's second message arrives and is claimed by another agent: the thread's newest inbound message.
  const newer = second.replyTo({ mailbox, messageId: "m-2", threadId: thread, receivedAt: new Date((ASKED + 60) * 1000), notificationId: unique("n") }, { ttl: 30 }, async (claim) => {
    drafted();
    const refused = await stale;
    assert.ok(refused instanceof ConversationMovedOn, String(refused));
    return claim.send(() => "sent-m-2");
  });
  assert.equal(await newer, "sent-m-2");
  const refused = (await stale) as ConversationMovedOn;
  assert.equal(called, false, "the stale draft was sent");
  assert.equal(refused.newerMessageId, "m-2");
  assert.equal(refused.newerReceivedAt?.getTime(), (ASKED + 60) * 1000);
  assert.match(refused.reason, /the customer wrote again; draft again with the new message/);
  assert.equal((await first.status(messageSubject(mailbox, "m-1"))).state, "FREE");
  // RecordIncoming (a message nobody claims) moves the conversation on just the same.
  await first.recordIncoming(mailbox, "m-3", thread, new Date((ASKED + 120) * 1000));
  await assert.rejects(agentReply(first, mailbox, "m-2b", thread, { date: ASKED + 90 }), (error: unknown) => error instanceof ConversationMovedOn && error.newerMessageId === "m-3");
});

/** The guarded Nylas endpoint of one agent on node:http, sending through the double's API. */
async function nylasAgent(double: Double, coordinator: Coordinator, secret: string, options: { apiKey?: boolean; draft?: () => Promise<void> } = {}) {
  const nylas = new Nylas(KEY, { apiBase: double.url });
  const ran: string[] = [];
  const refused: Error[] = [];
  const failed: unknown[] = [];
  const listener = nylasWebhookListener({
    secret,
    coordinator,
    ...(options.apiKey === false ? {} : { apiKey: KEY, apiBase: double.url }),
    onRefused: (refusal) => void refused.push(refusal),
    onError: (error) => void failed.push(error),
    work: async (notification: Notification, claim: Claim) => {
      ran.push(notification.messageId ?? "");
      await options.draft?.();
      await claim.send((key) => nylas.send(notification.grantId!, nylasReply(notification, { body: "Here it is." }), { idempotencyKey: key }));
    },
  });
  const server = createServer(listener);
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  server.unref();
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/webhooks/nylas`;
  const deliver = async (message: Doc): Promise<number> => {
    const body = Buffer.from(JSON.stringify(await double.call<Envelope>("notification", message)));
    return (await fetch(url, { method: "POST", body, headers: { "x-nylas-signature": signNylas(body, secret) } })).status;
  };
  const stop = async (): Promise<void> => {
    await listener.drain();
    server.closeAllConnections();
    server.close();
  };
  return { ran, refused, failed, deliver, listener, stop };
}

const calls = async (double: Double): Promise<Record<string, number>> => double.get<Record<string, number>>("calls");
const sends = async (double: Double): Promise<Sent[]> => double.get<Sent[]>("sends");
const headersOf = (copy: Record<string, unknown>): Record<string, string> =>
  Object.fromEntries((copy.headers as { name: string; value: string }[]).map(({ name, value }) => [name, value]));

test("nylas: an out-of-office (Auto-Submitted in the headers read with the API key) is recorded for people and never handed to the work; a person can answer it", async () => {
  const { double, grant } = await nylasDouble();
  const agent = await nylasAgent(double, cluster.client("agent-n"), "nylas-secret");
  try {
    const ooo = await arrives(double, ASKED, "bea@example.org", "Out of office", "", { "Auto-Submitted": "auto-replied" });
    assert.equal(await agent.deliver(ooo), 200);
    await agent.listener.drain();
    assert.deepEqual(agent.ran, []);
    assert.deepEqual(await sends(double), []);
    assert.deepEqual(await calls(double), { "messages.get": 1 }); // the one read of its headers
    assert.ok(agent.refused[0] instanceof AutomatedMessage, String(agent.refused[0]));
    assert.match(agent.refused[0].message, /automated message \(Auto-Submitted: auto-replied\): agents leave it/);
    const recorded = agent.refused[0].result;
    assert.equal(recorded?.outcome, "RECORDED");
    assert.equal(recorded?.status?.automated, "Auto-Submitted: auto-replied");
    const person = cluster.client("ana@shop.example", { kind: "human", replica: 1 });
    // What the people watching see, through the other replica: agents leave it.
    assert.equal((await person.status(messageSubject(grant, ooo.id))).automated, "Auto-Submitted: auto-replied");
    // A redelivery of its notification is a duplicate: recorded once.
    assert.equal(await agent.deliver(ooo), 200);
    await agent.listener.drain();
    assert.equal((agent.refused[1] as AutomatedMessage).result?.outcome, "DUPLICATE_DELIVERY");
    assert.deepEqual(agent.ran, []);
    assert.equal(await person.replyTo({ mailbox: grant, messageId: ooo.id }, { ttl: 30 }, (claim) => claim.send(() => "by-hand")), "by-hand");
    // An ordinary customer's message is answered, and the agent's reply is marked Auto-Submitted, in its thread.
    const asked = await arrives(double, ASKED + 60, "carl@example.net", "Where is my order?");
    assert.equal(await agent.deliver(asked), 200);
    await agent.listener.drain();
    assert.deepEqual(agent.ran, [asked.id]);
    assert.deepEqual(agent.failed, []);
    assert.deepEqual((await sends(double)).map((sent) => [sent.by, sent.in_reply_to]), [["agent", asked.id]]);
    const copy = await double.call<Doc>("sent_copy", asked.id);
    assert.equal(headersOf(copy)["Auto-Submitted"], "auto-replied");
    assert.equal(copy.thread_id, asked.thread_id); // reply_to_message_id threads it (Nylas writes In-Reply-To, References)
  } finally {
    await agent.stop();
    await double.stop();
  }
});

test("nylas without the API key: a no-reply sender is still left (the sender's rules), a customer answered", async () => {
  const { double } = await nylasDouble();
  const agent = await nylasAgent(double, cluster.client("agent-k"), "nylas-secret", { apiKey: false });
  try {
    const notice = await arrives(double, ASKED, "no-reply@orders.example", "Your order shipped");
    assert.equal(await agent.deliver(notice), 200);
    await agent.listener.drain();
    assert.deepEqual(agent.ran, []);
    assert.deepEqual(await calls(double), {}); // nothing read without the key
    assert.ok(agent.refused[0] instanceof AutomatedMessage, String(agent.refused[0]));
    assert.equal(agent.refused[0].why, "no-reply sender no-reply@orders.example");
    assert.equal(agent.refused[0].result?.status?.automated, "no-reply sender no-reply@orders.example");
    const asked = await arrives(double, ASKED + 60, "carl@example.net", "Where is my order?");
    assert.equal(await agent.deliver(asked), 200);
    await agent.listener.drain();
    assert.deepEqual(agent.ran, [asked.id]);
    assert.equal((await sends(double)).length, 1);
  } finally {
    await agent.stop();
    await double.stop();
  }
});

test("nylas, look before you send: the customer's newer message found in the thread is recorded and the stale draft refused; a person's reply found there stops the agent", async () => {
  const { double, grant } = await nylasDouble();
  let arrive: () => Promise<unknown> = async () => undefined;
  const lines: string[] = [];
  const agent = await nylasAgent(double, cluster.client("agent-l", { logger: { info: (line: string) => void lines.push(line) } }), "nylas-secret", {
    // While the agent drafts, the customer writes again; its notification has not come (Nylas's delay).
    draft: async () => void (await arrive()),
  });
  try {
    const asked = await arrives(double, ASKED, "bea@example.org", "Where is my order?");
    let newer: Doc | undefined;
    arrive = async () => (newer = await dated(double, await double.call<Doc>("customer_writes_again", asked), ASKED + 30));
    assert.equal(await agent.deliver(asked), 200);
    await agent.listener.drain();
    assert.deepEqual(agent.ran, [asked.id]);
    assert.deepEqual(await sends(double), [], "the stale draft was sent");
    // Expected, not an error: the adapter leaves it at the one line claim.send logged.
    assert.equal(agent.failed.length, 0, String(agent.failed[0]));
    assert.deepEqual(
      lines.filter((line) => line.includes("the customer wrote again")),
      [`inbox-claims: not sending the reply to message ${JSON.stringify(asked.id)} of mailbox ${JSON.stringify(grant)}: the customer wrote again; draft again with the new message`],
    );
    assert.equal((await calls(double))["messages.list"], 1); // the one look
    // When the newer message's notification comes, it is answered: one reply for the burst.
    arrive = async () => undefined;
    assert.equal(await agent.deliver(newer!), 200);
    await agent.listener.drain();
    assert.deepEqual((await sends(double)).map((sent) => [sent.by, sent.in_reply_to]), [["agent", newer!.id]]);

    // A person answers from their mail client while the agent drafts the next one: the reply, in the sent folder,
    // is found before the send and recorded; the agent's claim ends and nothing goes out.
    const next = await arrives(double, ASKED + 600, "bea@example.org", "One more thing", asked.thread_id);
    arrive = async () => dated(double, await double.call<Doc>("person_replies", next), ASKED + 630);
    assert.equal(await agent.deliver(next), 200);
    await agent.listener.drain();
    assert.deepEqual((await sends(double)).map((sent) => sent.by), ["agent", "person"], "the agent sent after a person answered");
    const lost = agent.failed[0];
    assert.ok(lost instanceof ClaimLost && lost.reason === "answered_outside", String(lost));
  } finally {
    await agent.stop();
    await double.stop();
  }
});

test("a person's reply is never marked Auto-Submitted; an agent's is (the same Nylas.send, under each one's claim)", async () => {
  const { double, grant } = await nylasDouble();
  const nylas = new Nylas(KEY, { apiBase: double.url });
  try {
    const clients = { agent: cluster.client("agent-m"), person: cluster.client("ana@shop.example", { kind: "human", replica: 1 }) };
    const asked: Record<string, Doc> = {};
    for (const [who, client] of Object.entries(clients)) {
      asked[who] = await arrives(double, ASKED, "bea@example.org", `A question for the ${who}`);
      const notification = parseNotification(await double.call<Envelope>("notification", asked[who]));
      await client.replyTo(notification, { ttl: 30 }, (claim) => claim.send((key) => nylas.send(grant, nylasReply(notification, { body: "Hi" }), { idempotencyKey: key })));
    }
    assert.equal(headersOf(await double.call<Doc>("sent_copy", asked["agent"]!.id))["Auto-Submitted"], "auto-replied");
    assert.equal(headersOf(await double.call<Doc>("sent_copy", asked["person"]!.id))["Auto-Submitted"], undefined);
  } finally {
    await double.stop();
  }
});

test("the limits: a sender address over 320 bytes claims without a correspondent (not refused); an automated reason over 256 bytes is cut, still recorded", async () => {
  const agent = cluster.client("agent-limits");
  const mailbox = unique("limits");
  const long = `${"b".repeat(330)}@example.org`; // no address (RFC 5321: 254 at most), so no correspondent budget
  const asked = message(mailbox, "l-1", unique("t"), { from: { email: long } });
  assert.equal(await agent.replyTo(notificationOf(asked), { ttl: 30 }, (claim) => claim.send(() => "sent-l-1")), "sent-l-1");
  const noReply = `no-reply.${"x".repeat(300)}@example.org`;
  const automated = message(mailbox, "l-2", unique("t"), { from: { email: noReply } });
  const refused = await agent.replyTo(notificationOf(automated), { ttl: 30 }, async () => "ran").catch((error: unknown) => error);
  assert.ok(refused instanceof AutomatedMessage, String(refused));
  assert.equal(refused.why, `no-reply sender ${noReply}`);
  assert.equal(refused.result?.outcome, "RECORDED");
  assert.equal(Buffer.byteLength(refused.result?.status?.automated ?? ""), 256);
  assert.ok(refused.why.startsWith(refused.result!.status!.automated));
});
