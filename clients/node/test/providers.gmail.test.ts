// Gmail through the provider seam, through real coordinators on real etcd, against the repository's Gmail API and
// Pub/Sub push double (tests/providers/fake_gmail.py, run by test/doubles.py): one push delivered three times over
// two workers, two agents with different principals, a person answering from the Gmail UI while the agent drafts,
// the agent's own reply coming back, a dropped push found by the periodic check, a mailbox's first push and a history
// id too old (404: bounded resyncs), the Gmail API failing mid-range (503, the range given back at once), a send
// left IN_DOUBT settled by its stamped copy (and, with no copy, left for a person), bad input refused with nothing
// recorded. Each guarded scenario sends one reply per customer message (counted at the double); the same deliveries
// to the unguarded agent send at least two.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Cluster } from "../src/testing.js";
import { messageSubject, type Coordinator } from "../src/index.js";
import { GmailProvider } from "../src/providers/gmail.js";
import { Double, eventually, guardedAgents, LocalCursors, post, unguarded } from "./doubles.js";

const AUDIENCE = "https://agent.example/webhook"; // the double's default
let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 2 });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
const uniqueAddress = (): string => `shop-${process.pid}-${++counter}@shop.example`;
type Push = [Record<string, string>, string];
interface Sent { by: "agent" | "person"; id: string; in_reply_to: string; stamp: string }

function gmailOf(double: Double, address: string, historyCheckIntervalMs = 0): GmailProvider {
  return new GmailProvider(AUDIENCE, address, { token: "gmail-token", apiBase: double.url, jwksUrl: `${double.url}/oauth2/v3/certs`, historyCheckIntervalMs });
}

/** Guarded agents, one per client (test/doubles.ts); `drafting` holds their sends back. */
function agents(double: Double, address: string, clients: Coordinator[], options: { drafting?: Promise<void>; historyCheckIntervalMs?: number } = {}) {
  return guardedAgents(() => gmailOf(double, address, options.historyCheckIntervalMs), clients, options.drafting);
}

async function withDouble(run: (double: Double, address: string) => Promise<void>): Promise<void> {
  const address = uniqueAddress();
  const double = await Double.start("gmail", { address });
  try {
    await run(double, address);
  } finally {
    await double.stop();
  }
}

async function pushTo(url: string, push: Push): Promise<number> {
  return (await post(url, push[1], push[0])).status;
}

const repliesTo = (double: Double, id: string, by = "agent"): Promise<number> => double.call<number>("replies_to", id, by);

test("gmail: one push delivered three times over two workers gets one reply; the copy of that reply is never answered; unguarded: two or more", async () => {
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "bea@example.org", "Where is my order?");
    const agent = await agents(double, address, [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-a", { replica: 1, mailboxAddresses: [address] })]);
    const push = await double.call<Push>("push");
    assert.deepEqual(await Promise.all([pushTo(agent.urls[0]!, push), pushTo(agent.urls[1]!, push), pushTo(agent.urls[0]!, push)]), [200, 200, 200]);
    await eventually(async () => (await repliesTo(double, String(message.id))) === 1);
    // The reply's SENT copy (a new history record, stamped) comes with the next push: reported, never answered.
    const copy = await double.call("sent_copy", message.id);
    assert.equal(await pushTo(agent.urls[1]!, await double.call<Push>("push")), 200);
    await agent.close();
    assert.equal(await repliesTo(double, String(message.id)), 1);
    assert.equal(await repliesTo(double, String(copy.id)), 0);
    const status = await cluster.client("probe").status(messageSubject(address, String(message.id)));
    assert.equal(status.state, "REPLIED");
  });
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "bea@example.org", "Where is my order?");
    const [headers, body] = await double.call<Push>("push");
    const workers = [new LocalCursors(), new LocalCursors()];
    for (const worker of [0, 1, 0]) await unguarded(gmailOf(double, address), { headers, body: Buffer.from(body) }, workers[worker]!);
    assert.ok((await repliesTo(double, String(message.id))) >= 2);
  });
});

test("gmail: two agents with different principals get one push each: one reply", async () => {
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "carl@example.net", "Refund");
    const agent = await agents(double, address, [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-b", { replica: 1, mailboxAddresses: [address] })]);
    const push = await double.call<Push>("push");
    assert.deepEqual(await Promise.all(agent.urls.map((url) => pushTo(url, push))), [200, 200]);
    await agent.close();
    assert.equal(await repliesTo(double, String(message.id)), 1);
  });
});

test("gmail: a person answering from the Gmail UI while the agent drafts: the agent sends nothing; unguarded: both go out", async () => {
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "bea@example.org", "Where is my order?");
    let draftDone!: () => void;
    const drafting = new Promise<void>((ok) => (draftDone = ok));
    const agent = await agents(double, address, [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-a", { replica: 1, mailboxAddresses: [address] })], { drafting });
    assert.equal(await pushTo(agent.urls[0]!, await double.call<Push>("push")), 200); // claimed: the agent drafts
    await double.call("person_replies", message);
    assert.equal(await pushTo(agent.urls[1]!, await double.call<Push>("push")), 200); // the person's reply, recorded
    draftDone();
    await agent.close();
    assert.deepEqual((await double.get<Sent[]>("sends")).map((sent) => sent.by), ["person"]);
    const status = await cluster.client("probe").status(messageSubject(address, String(message.id)));
    assert.equal(status.state, "REPLIED");
    assert.equal(status.repliedOutside, true);
  });
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "bea@example.org", "Where is my order?");
    const [headers, body] = await double.call<Push>("push"); // the unguarded agent drafts from this push ...
    await double.call("person_replies", message); // ... while the person answers
    await unguarded(gmailOf(double, address), { headers, body: Buffer.from(body) }, new LocalCursors());
    assert.equal((await repliesTo(double, String(message.id))) + (await repliesTo(double, String(message.id), "person")), 2);
  });
});

test("gmail: a dropped push is found by the periodic history check: one reply, and the late push adds none", async () => {
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "dee@example.org", "Invoice");
    const clients = [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-a", { replica: 1, mailboxAddresses: [address] })];
    const agent = await agents(double, address, clients, { historyCheckIntervalMs: 300 });
    // No push came (Pub/Sub dropped it): the history check, on its own schedule, finds the message.
    await eventually(async () => (await repliesTo(double, String(message.id))) === 1);
    assert.equal(await pushTo(agent.urls[1]!, await double.call<Push>("push")), 200); // the push, late
    await agent.close();
    assert.equal(await repliesTo(double, String(message.id)), 1);
  });
});

test("gmail: a history id too old (404) is answered by a bounded resync: each message answered once, the cursor at the profile's history id", async () => {
  await withDouble(async (double, address) => {
    const first = await double.call("receive", "bea@example.org", "Where is my order?");
    const clients = [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-a", { replica: 1, mailboxAddresses: [address] })];
    const agent = await agents(double, address, clients);
    assert.equal(await pushTo(agent.urls[0]!, await double.call<Push>("push")), 200);
    await eventually(async () => (await repliesTo(double, String(first.id))) === 1);
    await double.call("expire_history"); // Gmail no longer has the history since the cursor
    const second = await double.call("receive", "carl@example.net", "Refund");
    assert.equal(await pushTo(agent.urls[1]!, await double.call<Push>("push")), 200);
    await eventually(async () => (await repliesTo(double, String(second.id))) === 1);
    await agent.close();
    assert.equal(await repliesTo(double, String(first.id)), 1);
    const calls = await double.get<Record<string, number>>("calls");
    assert.ok((calls["messages.list"] ?? 0) >= 1, "the resync listed the last day's messages");
    const cursor = await clients[0]!.getCursor(address, "gmail-history");
    assert.ok(cursor.position >= BigInt(String(second.historyId)), `the cursor is at ${cursor.position}`);
  });
});

test("gmail: the Gmail API failing mid-range (503 from messages.get) is answered 503 and the range given back: the redelivery is answered at once by the other worker", async () => {
  await withDouble(async (double, address) => {
    const clients = [cluster.client("agent-a", { mailboxAddresses: [address] }), cluster.client("agent-a", { replica: 1, mailboxAddresses: [address] })];
    const agent = await agents(double, address, clients);
    assert.equal(await pushTo(agent.urls[0]!, await double.call<Push>("push")), 200); // the first push: the cursor starts
    const before = await clients[0]!.getCursor(address, "gmail-history");
    const asked = [await double.call("receive", "bea@example.org", "Where is my order?"), await double.call("receive", "carl@example.net", "Refund")];
    await double.callAt(["failing"], "__setitem__", "messages.get", 1); // Gmail answers 503 to one read of the range
    const push = await double.call<Push>("push");
    const pushed = await double.get<number>("history_id");
    assert.equal(await pushTo(agent.urls[0]!, push), 503); // Pub/Sub delivers it again
    assert.deepEqual(await clients[0]!.getCursor(address, "gmail-history"), before); // nothing recorded, the cursor unmoved
    // The redelivery reaches the other worker: the range was given back (not left to its 60 s lease, which would
    // have kept this worker waiting and answered 503).
    assert.equal(await pushTo(agent.urls[1]!, push), 200);
    await agent.close();
    assert.deepEqual(await Promise.all(asked.map((message) => repliesTo(double, String(message.id)))), [1, 1]);
    assert.ok((await clients[0]!.getCursor(address, "gmail-history")).position >= BigInt(pushed));
  });
});

test("gmail: a mailbox's first push (no cursor yet) answers the last day's unanswered messages only: one a person answered from the Gmail UI is left", async () => {
  await withDouble(async (double, address) => {
    const answeredByAna = await double.call("receive", "bea@example.org", "Where is my order?");
    await double.call("person_replies", answeredByAna); // answered from the Gmail UI before the agent was there
    const waiting = await double.call("receive", "carl@example.net", "Refund for order 1042");
    const coordinator = cluster.client("agent-a", { mailboxAddresses: [address] });
    const agent = await agents(double, address, [coordinator]);
    assert.equal(await pushTo(agent.urls[0]!, await double.call<Push>("push")), 200); // no cursor yet: a resync of the last day
    await agent.close();
    assert.equal((await double.get<Record<string, number>>("calls"))["messages.list"], 1);
    assert.deepEqual([await repliesTo(double, String(answeredByAna.id)), await repliesTo(double, String(waiting.id))], [0, 1]);
    const status = await coordinator.status(messageSubject(address, String(answeredByAna.id)));
    assert.deepEqual([status.state, status.repliedOutside], ["REPLIED", true]);
  });
});

test("gmail: a forged, expired or foreign-audience token is refused 401, a push for another mailbox 403: nothing read, nothing recorded", async () => {
  await withDouble(async (double, address) => {
    const message = await double.call("receive", "eve@example.org", "Hello");
    const coordinator = cluster.client("agent-a", { mailboxAddresses: [address] });
    const agent = await agents(double, address, [coordinator]);
    const pushes: [Record<string, unknown>, number][] = [
      [{ signer: "forger" }, 401],
      [{ expires_in: -1 }, 401],
      [{ audience: "https://someone-else.example/push" }, 401],
      [{ issuer: "https://evil.example" }, 401],
      [{ email_address: "other@shop.example" }, 403],
    ];
    for (const [kwargs, status] of pushes) {
      const push = await double.callWith<Push>("push", [], kwargs);
      assert.equal(await pushTo(agent.urls[0]!, push), status, JSON.stringify(kwargs));
    }
    const [headers, body] = await double.call<Push>("push");
    assert.equal((await post(agent.urls[0]!, body, { ...headers, authorization: "" })).status, 401);
    assert.equal((await post(agent.urls[0]!, "{not json", headers)).status, 400);
    await agent.close();
    const calls = await double.get<Record<string, number>>("calls");
    assert.equal(calls["history.list"] ?? 0, 0);
    assert.equal((await coordinator.status(messageSubject(address, String(message.id)))).state, "FREE");
    assert.equal((await coordinator.getCursor(address, "gmail-history")).position, 0n);
  });
});

test("gmail: a send whose answer was lost stays IN_DOUBT until its stamped SENT copy is seen, which settles it with no person; with no copy it stays for a person", async () => {
  const quick = await cluster.addReplica(undefined, ["--send-timeout", "1s"]); // SENDING turns IN_DOUBT within a second (the least)
  // Both at once: each waits for the coordinator to find its send IN_DOUBT.
  const both = (["lost_answer", "unavailable"] as const).map((failure) =>
    withDouble(async (double, address) => {
      const drafter = cluster.client("agent-a", { target: quick, mailboxAddresses: [address] });
      const reader = cluster.client("agent-b", { replica: 1, mailboxAddresses: [address] });
      const agent = await agents(double, address, [drafter]);
      const message = await double.call("receive", "bea@example.org", "Where is my order?");
      // lost_answer: Gmail sends it and its answer is lost; unavailable: 503, nothing went out. The agent cannot tell.
      await double.set("send_failure", failure);
      assert.equal(await pushTo(agent.urls[0]!, await double.call<Push>("push")), 200);
      const subject = messageSubject(address, String(message.id));
      await eventually(async () => (await drafter.status(subject)).state === "IN_DOUBT");
      if (failure === "unavailable") await double.call("receive", "carl@example.net", "Another question"); // the history moves on, no copy
      const other = await agents(double, address, [reader]);
      assert.equal(await pushTo(other.urls[0]!, await double.call<Push>("push")), 200); // another agent reads the history
      await agent.close();
      await other.close();
      const status = await reader.status(subject);
      if (failure === "lost_answer") {
        const copy = await double.call("sent_copy", message.id);
        assert.deepEqual([status.state, status.sentMessageId, status.settledBy], ["REPLIED", copy.id, "agent-b"]);
        assert.equal(await repliesTo(double, String(message.id)), 1);
      } else {
        assert.deepEqual([status.state, status.settledBy], ["IN_DOUBT", ""]);
        assert.equal(await repliesTo(double, String(message.id)), 0);
      }
    }),
  );
  await Promise.all(both);
});
