// Microsoft 365 through the provider seam, through real coordinators on real etcd, against the repository's Graph
// double (tests/providers/fake_graph.py, run by test/doubles.py: immutable ids, createReply 201 keeping the
// internetMessageHeaders given, send 202 moving the draft to Sent Items): one notification delivered three times over
// two workers, two agents with different principals, several notifications in one POST, a new mail arriving as
// updated, a person answering from Outlook while the agent drafts, the agent's own reply coming back from Sent Items,
// a missed lifecycle event (a delta resync of the last day, by one worker), bad input refused with nothing recorded,
// a send left IN_DOUBT settled by its stamped copy (and, with no copy, left for a person), a customer's mail carrying
// that send's stamp (settling nothing, answered) and a mail forging the mailbox's From with it (settling nothing).
// Each guarded scenario sends one reply per customer message (counted at the double); the same deliveries to the
// unguarded agent send at least two.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Cluster } from "../src/testing.js";
import { idempotencyKey, messageSubject, type Coordinator } from "../src/index.js";
import { formatStamp } from "../src/providers/seam.js";
import { GraphProvider } from "../src/providers/graph.js";
import { Double, eventually, guardedAgents, LocalCursors, post, unguarded } from "./doubles.js";

const STATE = "graph-client-state"; // the double's default clientState
const TOKEN = "graph-token";
let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 2 });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
type Message = Record<string, unknown> & { id: string; changeKey: string };
interface Sent { by: "agent" | "person"; in_reply_to: string; id: string }

function graphOf(double: Double, user: string): GraphProvider {
  return new GraphProvider(STATE, user, { token: TOKEN, apiBase: `${double.url}/v1.0`, mailboxAddresses: [`${user}@shop.example`] });
}

/** Graph's change notifications of `messages`, in one POST, as its documentation shows them. */
function notifications(user: string, messages: Message[], change = "created", state = STATE): string {
  return JSON.stringify({
    value: messages.map((message) => ({
      subscriptionId: "sub-inbox",
      subscriptionExpirationDateTime: "2026-12-05T11:00:00.0000000Z",
      clientState: state,
      changeType: change,
      resource: `Users/${user}/Messages/${message.id}`,
      tenantId: "84bd8158-6d4d-4958-8b9f-9d6445542f95",
      resourceData: {
        "@odata.type": "#Microsoft.Graph.Message",
        "@odata.id": `Users/${user}/Messages/${message.id}`,
        "@odata.etag": `W/"${message.changeKey}"`,
        id: message.id,
      },
    })),
  });
}

/** A lifecycle notification (missed, reauthorizationRequired, subscriptionRemoved), as Graph's documentation shows it. */
function lifecycle(user: string, event: string): string {
  return JSON.stringify({
    value: [
      {
        lifecycleEvent: event,
        subscriptionId: "sub-inbox",
        subscriptionExpirationDateTime: "2026-12-05T11:00:00.0000000Z",
        clientState: STATE,
        tenantId: "84bd8158-6d4d-4958-8b9f-9d6445542f95",
        resource: `users/${user}/mailFolders('inbox')/messages`,
      },
    ],
  });
}

/** Guarded agents, one per client (test/doubles.ts); `drafting` holds their sends back. */
function agents(double: Double, user: string, clients: Coordinator[], drafting?: Promise<void>) {
  return guardedAgents(() => graphOf(double, user), clients, drafting);
}

async function withDouble(run: (double: Double, user: string) => Promise<void>): Promise<void> {
  const user = `u-${process.pid}-${++counter}`;
  const double = await Double.start("graph", { user, address: `${user}@shop.example`, token: TOKEN });
  try {
    await run(double, user);
  } finally {
    await double.stop();
  }
}

const status = async (url: string, body: string): Promise<number> => (await post(url, body)).status;
const repliesTo = (double: Double, id: string, by = "agent"): Promise<number> => double.call<number>("replies_to", id, by);
const receive = (double: Double, sender: string, subject: string, conversation: string): Promise<Message> => double.call<Message>("receive", sender, subject, conversation);

test("graph: one notification delivered three times over two workers gets one reply; its copy from Sent Items is never answered; unguarded: two or more", async () => {
  await withDouble(async (double, user) => {
    const message = await receive(double, "bea@example.org", "Where is my order?", "conv-1");
    const agent = await agents(double, user, [cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 })]);
    const body = notifications(user, [message]);
    assert.deepEqual(await Promise.all([status(agent.urls[0]!, body), status(agent.urls[1]!, body), status(agent.urls[0]!, body)]), [202, 202, 202]);
    await agent.close();
    assert.equal(await repliesTo(double, message.id), 1);
    // The agent's reply, now in Sent Items with its stamp, notified by the Sent Items subscription: never answered.
    const copy = await double.call<Message>("sent_copy", message.id);
    const again = await agents(double, user, [cluster.client("agent-a", { replica: 1 })]);
    assert.equal(await status(again.urls[0]!, notifications(user, [copy])), 202);
    await again.close();
    assert.equal(await repliesTo(double, copy.id), 0);
    assert.equal(await repliesTo(double, message.id), 1);
    assert.equal((await cluster.client("probe").status(messageSubject(user, message.id))).state, "REPLIED");
  });
  await withDouble(async (double, user) => {
    const message = await receive(double, "bea@example.org", "Where is my order?", "conv-1");
    const body = Buffer.from(notifications(user, [message]));
    for (let i = 0; i < 3; i++) await unguarded(graphOf(double, user), { headers: { "content-type": "application/json" }, body }, new LocalCursors());
    assert.ok((await repliesTo(double, message.id)) >= 2);
  });
});

test("graph: two agents with different principals, several notifications in one POST, a new mail arriving as updated: one reply each", async () => {
  await withDouble(async (double, user) => {
    const first = await receive(double, "bea@example.org", "Where is my order?", "conv-1");
    const second = await receive(double, "carl@example.net", "Refund", "conv-2");
    const agent = await agents(double, user, [cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })]);
    const both = notifications(user, [first, second]);
    assert.deepEqual(await Promise.all([status(agent.urls[0]!, both), status(agent.urls[1]!, both)]), [202, 202]);
    const third = await receive(double, "dee@example.org", "Invoice", "conv-3");
    assert.equal(await status(agent.urls[1]!, notifications(user, [third], "updated")), 202); // a new mail as updated
    assert.equal(await status(agent.urls[0]!, notifications(user, [third])), 202); // then as created
    await agent.close();
    for (const message of [first, second, third]) assert.equal(await repliesTo(double, message.id), 1, message.id);
  });
});

test("graph: a person answering from Outlook while the agent drafts: the agent sends nothing; unguarded: both go out", async () => {
  await withDouble(async (double, user) => {
    const message = await receive(double, "bea@example.org", "Where is my order?", "conv-3");
    let draftDone!: () => void;
    const drafting = new Promise<void>((ok) => (draftDone = ok));
    const agent = await agents(double, user, [cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 })], drafting);
    assert.equal(await status(agent.urls[0]!, notifications(user, [message])), 202); // claimed: the agent drafts
    const person = await double.call<Message>("person_replies", message);
    assert.equal(await status(agent.urls[1]!, notifications(user, [person])), 202); // from Sent Items: recorded
    draftDone();
    await agent.close();
    assert.deepEqual((await double.get<Sent[]>("sends")).map((s) => s.by), ["person"]);
    const recorded = await cluster.client("probe").status(messageSubject(user, message.id));
    assert.equal(recorded.state, "REPLIED");
    assert.equal(recorded.repliedOutside, true);
  });
  await withDouble(async (double, user) => {
    const message = await receive(double, "bea@example.org", "Where is my order?", "conv-3");
    await double.call("person_replies", message);
    const body = Buffer.from(notifications(user, [message]));
    await unguarded(graphOf(double, user), { headers: { "content-type": "application/json" }, body }, new LocalCursors());
    assert.equal((await repliesTo(double, message.id)) + (await repliesTo(double, message.id, "person")), 2);
  });
});

test("graph: the handshake is echoed; a wrong clientState, a body that is not notifications, a mailbox not granted are refused; nothing recorded", async () => {
  await withDouble(async (double, user) => {
    const message = await receive(double, "eve@example.org", "Hello", "conv-4");
    const coordinator = cluster.client("agent-a");
    const agent = await agents(double, user, [coordinator]);
    const handshake = await fetch(`${agent.urls[0]}?validationToken=${encodeURIComponent("Validation: token <1>")}`, { method: "POST" });
    assert.equal(handshake.status, 200);
    assert.equal(handshake.headers.get("content-type"), "text/plain; charset=utf-8");
    assert.equal(await handshake.text(), "Validation: token <1>");
    assert.equal(await status(agent.urls[0]!, notifications(user, [message], "created", "guessed")), 401);
    assert.equal(await status(agent.urls[0]!, "{not json"), 400);
    assert.equal(await status(agent.urls[0]!, JSON.stringify({ value: "nope" })), 400);
    await agent.close();
    // An agent whose token grants other mailboxes: the coordinator refuses it, the POST is answered 403.
    const made = execFileSync(cluster.coordinatorBin, ["token", "new", "--id", "agent-elsewhere", "--mailbox", "elsewhere-*"], { encoding: "utf8" });
    const dir = mkdtempSync(join(tmpdir(), "inbox-claims-graph-"));
    writeFileSync(join(dir, "tokens.toml"), made.replace(/^#.*$/gm, ""));
    const listen = await cluster.addReplica(undefined, ["--token-file", join(dir, "tokens.toml")]);
    const stranger = cluster.client(undefined, { target: listen, token: /^# (ict_\S+)$/m.exec(made)![1]!, retry: { attempts: 30, maxBackoffMs: 300 } });
    await stranger.caller(); // the replica answers
    const refused = await agents(double, user, [stranger]);
    assert.equal(await status(refused.urls[0]!, notifications(user, [message])), 403);
    await refused.close();
    assert.deepEqual(await double.get<Sent[]>("sends"), []);
    assert.equal((await coordinator.status(messageSubject(user, message.id))).state, "FREE");
  });
});

test("graph: a missed lifecycle event heard by two workers: one resyncs the last day by delta query, the dropped message is answered once; a second missed reads only what changed", async () => {
  await withDouble(async (double, user) => {
    const clients = [cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 })];
    const agent = await agents(double, user, clients);
    const threeDaysAgo = new Date(Date.now() - 3 * 86400_000).toISOString().replace(/\.\d{3}Z$/, "Z");
    const ancient = await double.call<Message>("receive", "old@example.org", "An old question", "conv-5a", threeDaysAgo);
    const answered = await receive(double, "bea@example.org", "Where is my order?", "conv-5b");
    assert.equal(await status(agent.urls[0]!, notifications(user, [answered])), 202);
    await eventually(async () => (await repliesTo(double, answered.id)) === 1);
    const dropped = await receive(double, "dan@example.com", "Invoice please", "conv-5c"); // its notification never comes
    // Graph says it dropped notifications, to both workers at once: one reads the folders, the other leaves it.
    const missed = lifecycle(user, "missed");
    assert.deepEqual(await Promise.all([status(agent.urls[0]!, missed), status(agent.urls[1]!, missed)]), [202, 202]);
    await eventually(async () => (await repliesTo(double, dropped.id)) === 1);
    assert.equal((await double.get<Record<string, number>>("calls"))["delta"], 2); // one first round per folder, by one worker
    const inbox = await clients[0]!.getCursor(user, "graph-delta:inbox");
    assert.match(inbox.value, /deltatoken/);
    assert.equal(inbox.position, 1n);
    // Missed again later: the delta links read what changed since (the reply's copy: own), nothing twice.
    assert.equal(await status(agent.urls[1]!, missed), 202);
    await agent.close();
    assert.equal((await double.get<Record<string, number>>("calls"))["delta"], 4);
    assert.equal((await clients[0]!.getCursor(user, "graph-delta:inbox")).position, 2n);
    const replies = [await repliesTo(double, answered.id), await repliesTo(double, dropped.id), await repliesTo(double, ancient.id)];
    assert.deepEqual(replies, [1, 1, 0]); // the three-day-old message is outside the resync's day
  });
});

test("graph: a send left IN_DOUBT is settled by its stamped copy in Sent Items with no person; with no copy it stays for a person; a stamp outside the sent mail settles nothing", async () => {
  const quick = await cluster.addReplica(undefined, ["--send-timeout", "1s"]); // SENDING turns IN_DOUBT within a second (the least)
  /** A send of the agent (on the quick replica) to a new message of `conversation`, left IN_DOUBT by `failure`; its subject's status. */
  async function inDoubt(double: Double, user: string, failure: "lost_answer" | "unavailable", conversation: string) {
    const drafter = cluster.client("agent-a", { target: quick });
    const message = await receive(double, "bea@example.org", "Where is my order?", conversation);
    const agent = await agents(double, user, [drafter]);
    // lost_answer: Graph sends it and its answer is lost; unavailable: 503, nothing went out. The agent cannot tell.
    await double.set("send_failure", failure);
    assert.equal(await status(agent.urls[0]!, notifications(user, [message])), 202);
    const subject = messageSubject(user, message.id);
    await eventually(async () => (await drafter.status(subject)).state === "IN_DOUBT");
    await agent.close();
    return { message, subject, status: await drafter.status(subject) };
  }
  const reader = cluster.client("agent-b", { replica: 1 });
  // Each waits for the coordinator to find its send IN_DOUBT: the three run at once.
  await Promise.all([
    withDouble(async (double, user) => {
      const { message, subject } = await inDoubt(double, user, "lost_answer", "conv-7");
      const copy = await double.call<Message>("sent_copy", message.id);
      const other = await agents(double, user, [reader]); // another agent hears of the copy in Sent Items: it carries the stamp
      assert.equal(await status(other.urls[0]!, notifications(user, [copy])), 202);
      await other.close();
      const settled = await reader.status(subject);
      assert.deepEqual([settled.state, settled.sentMessageId, settled.settledBy], ["REPLIED", copy.id, "agent-b"]);
      assert.match(settled.note, /stamp/);
      assert.equal(await repliesTo(double, message.id), 1);
    }),
    withDouble(async (double, user) => {
      const { message, subject } = await inDoubt(double, user, "unavailable", "conv-8");
      const other = await agents(double, user, [reader]);
      assert.equal(await status(other.urls[0]!, lifecycle(user, "missed")), 202); // Sent Items read: no copy there
      await other.close();
      const left = await reader.status(subject);
      assert.deepEqual([left.state, left.settledBy], ["IN_DOUBT", ""]);
      assert.equal(await repliesTo(double, message.id), 0);
    }),
    withDouble(async (double, user) => {
      const { subject, status: doubted } = await inDoubt(double, user, "unavailable", "conv-10");
      const stamp = { name: "X-Inbox-Claim", value: formatStamp({ key: idempotencyKey(subject), token: doubted.fencingToken }) };
      // The customer writes again in the thread, with the in-doubt send's stamp in a header of their own making: an
      // incoming message like any other, answered; the send is still for a person to check.
      const forged = await receive(double, "bea@example.org", "RE: Where is my order?", "conv-10");
      await double.callAt(["messages", forged.id, "internetMessageHeaders"], "append", stamp);
      const other = await agents(double, user, [reader]);
      assert.equal(await status(other.urls[0]!, notifications(user, [forged])), 202);
      await eventually(async () => (await repliesTo(double, forged.id)) === 1);
      // Then a mail in the Inbox with the mailbox's own address as From (anyone can write it) and the stamp: outgoing
      // by its From, never answered, and reported without the stamp's token: it settles nothing either.
      const spoofed = await receive(double, `${user}@shop.example`, "RE: Where is my order?", "conv-10");
      await double.callAt(["messages", spoofed.id, "internetMessageHeaders"], "append", stamp);
      assert.equal(await status(other.urls[0]!, notifications(user, [spoofed])), 202);
      await other.close();
      const still = await reader.status(subject);
      assert.deepEqual([still.state, still.settledBy, still.sentMessageId], ["IN_DOUBT", "", ""]);
      assert.deepEqual([await repliesTo(double, forged.id), await repliesTo(double, spoofed.id)], [1, 0]);
    }),
  ]);
});
