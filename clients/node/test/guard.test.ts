// The guard against a real coordinator pair on a real etcd: races, fencing, takeover, renewal, send outcomes.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { Cluster } from "../src/testing.js";
import {
  AlreadyReplied,
  ClaimLost,
  Coordinator,
  DuplicateDelivery,
  NO_IDEMPOTENCY_KEY_WARNING,
  optionsFromEnv,
  ReplyHeld,
  SendOutcomeUnknown,
  SendRejected,
  messageSubject,
  parseNotification,
  summaryOf,
  type Claim,
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

/** Blocks this whole process, renewal timers included, as a GC pause or a stopped container would. */
function pauseProcess(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

test("50 concurrent replyTo calls from 5 client objects on 2 replicas: exactly one runs its work", async () => {
  const mailbox = unique("race");
  const clients = Array.from({ length: 5 }, (_, i) => cluster.client(`agent-${i}`, { replica: i % 2 }));
  let ran = 0;
  const outcomes = await Promise.allSettled(
    Array.from({ length: 50 }, (_, i) =>
      clients[i % 5]!.replyTo({ mailbox, messageId: "msg-1", notificationId: `n-${i}` }, { ttl: 30 }, async () => {
        ran += 1;
        await sleep(200);
      }),
    ),
  );
  assert.equal(ran, 1);
  assert.equal(outcomes.filter((o) => o.status === "fulfilled").length, 1);
  const refusals = outcomes.filter((o): o is PromiseRejectedResult => o.status === "rejected").map((o) => o.reason as Error);
  assert.equal(refusals.length, 49);
  for (const refusal of refusals) assert.ok(refusal instanceof ReplyHeld, String(refusal));
});

test("paused past its TTL: BeginSend is refused, the send function is never called", async () => {
  const agent = cluster.client("agent-paused");
  const other = cluster.client("agent-other", { replica: 1 });
  const mailbox = unique("fence");
  let sends = 0;
  const error = await agent
    .replyTo({ mailbox, messageId: "m" }, { ttl: 2 }, async (claim) => {
      pauseProcess(4500); // TTL 2 s + the 1 s lease bucket + etcd's expiry check, and some
      await claim.send(async () => {
        sends += 1;
        return "sent-1";
      });
    })
    .then(() => undefined, (e: unknown) => e);
  assert.ok(error instanceof ClaimLost, String(error));
  assert.equal(error.reason, "expired");
  assert.equal(sends, 0);
  const next = await other.claim(messageSubject(mailbox, "m"), { ttl: 5 });
  assert.equal(next.outcome, "GRANTED");
});

test("a human's takeover aborts the agent's signal; its send is refused", async () => {
  const agent = cluster.client("agent-t");
  const human = cluster.client("ana@example.com", { kind: "human", replica: 1 });
  const mailbox = unique("takeover");
  let sends = 0;
  let seen: Claim | undefined;
  const result = agent.replyTo({ mailbox, messageId: "m" }, { ttl: 3 }, async (claim) => {
    seen = claim;
    const taken = await human.takeover(claim.subject, { ttl: 30, note: "mine" });
    assert.equal(taken.outcome, "TAKEN_OVER");
    await new Promise((resolve) => claim.signal.addEventListener("abort", resolve, { once: true }));
    await claim.send(async () => {
      sends += 1;
      return undefined;
    });
  });
  const error = await result.then(() => undefined, (e: unknown) => e);
  assert.ok(error instanceof ClaimLost, String(error));
  assert.ok(seen!.signal.aborted);
  const reason = seen!.signal.reason as ClaimLost;
  assert.equal(reason.reason, "taken_over");
  assert.equal(reason.status?.holder, "ana@example.com");
  assert.equal(sends, 0);
  const status = await human.status(messageSubject(mailbox, "m"));
  assert.equal(status.state, "CLAIMED");
  assert.equal(status.holder, "ana@example.com");
});

test("renewal keeps a draft that takes 3x the TTL alive, and the reply is recorded once", async () => {
  const agent = cluster.client("agent-slow");
  const other = cluster.client("agent-eager", { replica: 1 });
  const mailbox = unique("renew");
  const sent = await agent.replyTo({ mailbox, messageId: "m", notificationId: "n1" }, { ttl: 2 }, async (claim) => {
    for (let i = 0; i < 3; i++) {
      await sleep(2000);
      const meanwhile = await other.claim(claim.subject, { ttl: 5 });
      assert.equal(meanwhile.outcome, "HELD");
    }
    assert.ok(!claim.signal.aborted);
    const id = await claim.send(async () => "sent-42");
    assert.ok(claim.replied);
    return id;
  });
  assert.equal(sent, "sent-42");
  const status = await other.status(messageSubject(mailbox, "m"));
  assert.equal(status.state, "REPLIED");
  assert.equal(status.sentMessageId, "sent-42");
  await assert.rejects(other.replyTo({ mailbox, messageId: "m" }, {}, async () => undefined), AlreadyReplied);
});

test("refusals are typed: DuplicateDelivery for a redelivery, ReplyHeld with the holder", async () => {
  const a = cluster.client("agent-a");
  const b = cluster.client("agent-b", { replica: 1 });
  const mailbox = unique("refuse");
  await a.replyTo({ mailbox, messageId: "m", notificationId: "n1" }, { ttl: 30 }, async () => {
    const held = await b.replyTo({ mailbox, messageId: "m", notificationId: "n2" }, {}, async () => undefined).catch((e: unknown) => e);
    assert.ok(held instanceof ReplyHeld);
    assert.equal(held.holder, "agent-a");
    assert.equal(held.holderKind, "agent");
  });
  const duplicate = await b.replyTo({ mailbox, messageId: "m", notificationId: "n1" }, {}, async () => undefined).catch((e: unknown) => e);
  assert.ok(duplicate instanceof DuplicateDelivery);
  assert.equal(duplicate.recordedBy, "agent-a");
});

test("leaving without a send releases for good; a thrown error releases as redeliverable", async () => {
  const agent = cluster.client("agent-r");
  const mailbox = unique("release");
  await agent.replyTo({ mailbox, messageId: "quiet", notificationId: "n-quiet" }, { ttl: 30 }, async () => undefined);
  assert.equal((await agent.status(messageSubject(mailbox, "quiet"))).state, "FREE");
  await assert.rejects(agent.replyTo({ mailbox, messageId: "quiet", notificationId: "n-quiet" }, {}, async () => undefined), DuplicateDelivery);

  await assert.rejects(
    agent.replyTo({ mailbox, messageId: "crash", notificationId: "n-crash" }, { ttl: 30 }, async () => {
      throw new Error("the LLM fell over");
    }),
    /the LLM fell over/,
  );
  assert.equal((await agent.status(messageSubject(mailbox, "crash"))).state, "FREE");
  let again = false;
  await agent.replyTo({ mailbox, messageId: "crash", notificationId: "n-crash" }, { ttl: 30 }, async () => {
    again = true; // the redelivery of the notification whose work failed may claim again
  });
  assert.ok(again);
});

test("send outcomes: SendRejected aborts (FREE), any other error leaves SENDING, a returned id is REPLIED", async () => {
  const agent = cluster.client("agent-s");
  const mailbox = unique("send");
  await assert.rejects(
    agent.replyTo({ mailbox, messageId: "rejected" }, { ttl: 30 }, (claim) =>
      claim.send(async () => {
        throw new SendRejected("422 unprocessable recipient");
      }),
    ),
    SendRejected,
  );
  assert.equal((await agent.status(messageSubject(mailbox, "rejected"))).state, "FREE");

  const unknown = await agent
    .replyTo({ mailbox, messageId: "unknown" }, { ttl: 30 }, (claim) =>
      claim.send(async () => {
        throw new Error("socket hang up");
      }),
    )
    .catch((e: unknown) => e);
  assert.ok(unknown instanceof SendOutcomeUnknown);
  assert.match(String((unknown.cause as Error).message), /socket hang up/);
  assert.equal((await agent.status(messageSubject(mailbox, "unknown"))).state, "SENDING");

  await agent.replyTo({ mailbox, messageId: "ok" }, { ttl: 30 }, async (claim) => {
    assert.equal(await claim.send(() => "provider-id-1"), "provider-id-1");
    await assert.rejects(claim.send(() => "twice"), /runs once/);
  });
  assert.equal((await agent.status(messageSubject(mailbox, "ok"))).state, "REPLIED");
});

test("a retried call keeps its request id: the coordinator answers the same grant and token", async () => {
  const agent = cluster.client("agent-retry");
  const op = agent.claimOp(messageSubject(unique("rid"), "m"), { ttl: 30, notificationId: "n" });
  const first = await agent.call(op);
  const again = await agent.call(op);
  assert.equal(first.outcome, "GRANTED");
  assert.equal(again.outcome, "GRANTED");
  assert.equal(again.status?.fencingToken, first.status?.fencingToken);
  assert.match((op.request as unknown as { requestId: string }).requestId, /^[0-9a-f]{32}$/);
  const ops = [agent.renewOp(op.subject, 1n), agent.releaseOp(op.subject, 1n), agent.beginSendOp(op.subject, 1n), agent.confirmSentOp(op.subject, 1n), agent.abortSendOp(op.subject, 1n)];
  const ids = ops.map((o) => (o.request as unknown as { requestId: string }).requestId);
  assert.equal(new Set(ids).size, ids.length);
  for (const id of ids) assert.match(id, /^[0-9a-f]{32}$/);
});

test("batched calls answer exactly what unary calls answer", async () => {
  async function scenario(coord: Coordinator, mailbox: string): Promise<string[]> {
    const subjects = Array.from({ length: 24 }, (_, i) => messageSubject(mailbox, `m${i}`));
    const describe = (p: Promise<{ outcome?: string; ok?: boolean }>): Promise<string> =>
      p.then((r) => String(r.outcome ?? r.ok), (e: Error) => e.name);
    const first = await Promise.all(subjects.map((s, i) => describe(coord.claim(s, { ttl: 30, notificationId: `n${i}` }))));
    const tokens = await Promise.all(subjects.map((s) => coord.status(s).then((st) => st.fencingToken)));
    const second = await Promise.all([
      ...subjects.map((s, i) => describe(coord.claim(s, { ttl: 30, notificationId: `n${i}` }))),
      ...subjects.map((s, i) => describe(i % 2 ? coord.beginSend(s, tokens[i]!) : coord.renew(s, tokens[i]!, 30))),
      ...subjects.map((s, i) => describe(coord.release(s, tokens[i]! + 1000n))),
      describe(coord.claim(messageSubject("", "empty-mailbox"))),
      describe(coord.recordDelivery(mailbox, "n0").then((d) => ({ outcome: d.isNew ? "NEW" : "DUPLICATE" }))),
    ]);
    return [...first, ...second];
  }
  const batched = cluster.client("agent-batch", { maxBatch: 64 });
  const unary = cluster.client("agent-batch", { maxBatch: 1, replica: 1 });
  const viaBatch = await scenario(batched, unique("batched"));
  const viaUnary = await scenario(unary, unique("unary"));
  assert.deepEqual(viaBatch, viaUnary);
  assert.ok(viaBatch.includes("InvalidRequest"));
  assert.ok(viaBatch.includes("DUPLICATE_DELIVERY"));
});

test("watch: a snapshot, then the transitions of a guarded reply; iterClaims pages through what is held", async () => {
  const mailbox = unique("watch");
  const watcher = cluster.client("ana@example.com", { kind: "human", replica: 1 });
  const agent = cluster.client("agent-w");
  const stop = new AbortController();
  const seen: string[] = [];
  const watching = (async () => {
    for await (const item of watcher.watch(mailbox, { signal: stop.signal })) {
      seen.push(item.kind === "snapshot" ? `snapshot:${item.subjects.length}` : `${item.type}:${item.status.subject.id}`);
      if (item.kind === "event" && item.type === "REPLIED") return;
    }
  })();
  const giveUp = setTimeout(() => stop.abort(), 30_000); // a lost event fails the assertions below, never hangs
  for (let i = 0; i < 500 && seen.length === 0; i++) await sleep(20); // the snapshot first: a claim before it would be in it, not an event
  await agent.claim(messageSubject(mailbox, "held"), { ttl: 30 });
  for (let i = 0; i < 500 && !seen.includes("CLAIMED:held"); i++) await sleep(20);
  await agent.replyTo({ mailbox, messageId: "m" }, { ttl: 30 }, (claim) => claim.send(() => "id-1"));
  await watching;
  clearTimeout(giveUp);
  stop.abort();
  assert.deepEqual(seen.slice(0, 2), ["snapshot:0", "CLAIMED:held"]);
  assert.deepEqual(seen.slice(2), ["CLAIMED:m", "SENDING:m", "REPLIED:m"]);
  for (let i = 0; i < 5; i++) await agent.claim(messageSubject(mailbox, `p${i}`), { ttl: 30 });
  const held: string[] = [];
  for await (const status of watcher.iterClaims(mailbox, { states: ["CLAIMED"], pageSize: 2 })) held.push(status.subject.id);
  assert.deepEqual(held.sort(), ["held", "p0", "p1", "p2", "p3", "p4"]);
});

test("a parsed notification: claim on its grant's message, or on a shared mailbox across grants; scope thread", async () => {
  const agent = cluster.client("agent-n");
  const shared = unique("support@example.com");
  const notification = (id: string, grant: string) =>
    parseNotification({ id, type: "message.created", data: { object: { id: "msg-9", grant_id: grant, thread_id: "thr-9" } } });
  await agent.replyTo(notification(unique("n"), "grant-a"), { ttl: 30, mailbox: shared }, async (claim) => {
    assert.deepEqual(claim.subject, { mailbox: shared, kind: "message", id: "msg-9" });
    // the same message seen through another grant, coordinated on the shared mailbox: held
    const other = cluster.client("agent-other-grant", { replica: 1 });
    await assert.rejects(other.replyTo(notification(unique("n"), "grant-b"), { mailbox: shared }, async () => undefined), ReplyHeld);
  });
  const grant = unique("grant");
  await agent.replyTo(notification(unique("n"), grant), { ttl: 30, scope: "thread" }, async (claim) => {
    assert.deepEqual(claim.subject, { mailbox: grant, kind: "thread", id: "thr-9" });
  });
  const grantEvent = parseNotification({ id: unique("n"), type: "grant.expired", data: { object: { grant_id: grant } } });
  await assert.rejects(agent.replyTo(grantEvent, {}, async () => undefined), /not about a message/);
});

test("markReplied: a reply made by hand is REPLIED, a later notification gets AlreadyReplied; a lost claim records nothing", async () => {
  const agent = cluster.client("agent-r");
  const human = cluster.client("bo@example.com", { kind: "human", replica: 1 });
  const mailbox = unique("by-hand");
  await human.replyTo({ mailbox, messageId: "m1", notificationId: unique("n") }, { ttl: 30 }, async (claim) => {
    await claim.markReplied({ sentMessageId: "sent-by-hand", note: "replied from Gmail" });
    assert.ok(claim.replied);
    assert.equal(claim.sentMessageId, "sent-by-hand");
  });
  const status = await agent.status(messageSubject(mailbox, "m1"));
  assert.equal(status.state, "REPLIED");
  assert.equal(status.repliedByHand, true);
  assert.equal(status.holder, "bo@example.com");
  await assert.rejects(
    agent.replyTo({ mailbox, messageId: "m1", notificationId: unique("message.updated") }, {}, async () => undefined),
    AlreadyReplied,
  );
  // Taken over meanwhile: the agent's markReplied is refused (ClaimLost) and the human's claim stands.
  const error = await agent
    .replyTo({ mailbox, messageId: "m2" }, { ttl: 30 }, async (claim) => {
      assert.equal((await human.takeover(claim.subject, { ttl: 30 })).outcome, "TAKEN_OVER");
      await claim.markReplied({ note: "too late" });
    })
    .then(() => undefined, (e: unknown) => e);
  assert.ok(error instanceof ClaimLost, String(error));
  const taken = await agent.status(messageSubject(mailbox, "m2"));
  assert.equal(taken.state, "CLAIMED");
  assert.equal(taken.holder, "bo@example.com");
  // The low-level call: fenced by the token.
  const granted = await agent.claim(messageSubject(mailbox, "m3"), { ttl: 30 });
  const stale = await agent.markReplied(messageSubject(mailbox, "m3"), granted.status!.fencingToken + 1000n);
  assert.equal(stale.ok, false);
  const marked = await agent.markReplied(messageSubject(mailbox, "m3"), granted.status!.fencingToken, { note: "phoned" });
  assert.equal(marked.ok, true);
  assert.equal(marked.status.state, "REPLIED");
});

test("the summary: replyTo fills it from the notification's message, an option overrides it, claim and takeover carry it", async () => {
  const agent = cluster.client("agent-s");
  const watcher = cluster.client("watcher-s", { replica: 1 });
  const grant = unique("grant");
  const received = 1764500000;
  const notification = parseNotification({
    id: unique("n"),
    type: "message.created",
    data: {
      object: {
        id: "msg-s",
        grant_id: grant,
        subject: "Refund\nfor order 1182?",
        from: [{ name: "Bea Costa", email: "bea@example.org" }],
        date: received,
      },
    },
  });
  assert.deepEqual(summaryOf(notification), {
    subjectLine: "Refund for order 1182?", // a control character becomes a space, as the coordinator requires
    sender: "Bea Costa <bea@example.org>",
    receivedAt: new Date(received * 1000),
  });
  await agent.replyTo(notification, { ttl: 30 }, async (claim) => {
    const seen = await watcher.status(claim.subject);
    assert.equal(seen.summary?.subjectLine, "Refund for order 1182?");
    assert.equal(seen.summary?.sender, "Bea Costa <bea@example.org>");
    assert.deepEqual(seen.summary?.receivedAt, new Date(received * 1000));
  });
  const bare = parseNotification({ id: unique("n"), type: "message.created", data: { object: { id: "msg-t", grant_id: grant, from: "nobody" } } });
  assert.equal(summaryOf(bare), undefined); // nothing usable: no summary rather than an empty one
  await agent.replyTo(bare, { ttl: 30, summary: { subjectLine: "Given by hand" } }, async (claim) => {
    assert.equal((await watcher.status(claim.subject)).summary?.subjectLine, "Given by hand");
  });
  const human = cluster.client("cy@example.com", { kind: "human" });
  const held = await agent.claim(messageSubject(grant, "msg-u"), { ttl: 30, summary: { sender: "dana@example.com" } });
  assert.equal(held.status?.summary?.sender, "dana@example.com");
  const taken = await human.takeover(messageSubject(grant, "msg-u"), { ttl: 30, summary: { subjectLine: "Taken", sender: "dana@example.com" } });
  assert.equal(taken.outcome, "TAKEN_OVER");
  assert.equal(taken.status.summary?.subjectLine, "Taken");
});

test("claim.send hands its function the idempotency key, and warns when a send takes it from nowhere", async () => {
  const agent = cluster.client("agent-key");
  const mailbox = unique("key");
  const warnings: string[] = [];
  const listen = (warning: Error & { code?: string }): void => {
    if (warning.code === NO_IDEMPOTENCY_KEY_WARNING) warnings.push(warning.message);
  };
  process.on("warning", listen);
  try {
    // The key as the function's argument: the claim's own, and no warning.
    await agent.replyTo({ mailbox, messageId: "taken" }, { ttl: 30 }, async (claim) => {
      assert.equal(await claim.send((key) => (key === claim.idempotencyKey ? "sent-taken" : "wrong key")), "sent-taken");
    });
    // Read from the claim inside the send, as the Nylas helper is called: no warning either.
    await agent.replyTo({ mailbox, messageId: "read" }, { ttl: 30 }, (claim) =>
      claim.send(() => `sent-${claim.idempotencyKey.slice(0, 8)}`),
    );
    await sleep(50); // process warnings are emitted on the next tick
    assert.deepEqual(warnings, []);
    // Neither: the provider got no Idempotency-Key, and the developer is told so, naming the message and the fix.
    await agent.replyTo({ mailbox, messageId: "forgotten" }, { ttl: 30 }, (claim) => claim.send(() => "sent-forgotten"));
    await sleep(50);
    assert.equal(warnings.length, 1);
    assert.match(warnings[0]!, /claim\.send\(\) for forgotten: the send function took no idempotency key/);
    assert.match(warnings[0]!, /claim\.send\(\(idempotencyKey\) => sendReply\(\.\.\., idempotencyKey\)\)/);
  } finally {
    process.off("warning", listen);
  }
});

test("Coordinator.fromEnv reads the variables the Python client and inboxctl read", async () => {
  const target = cluster.targets[0]!;
  const coord = Coordinator.fromEnv({}, { INBOX_COORDINATOR_TARGET: target, INBOX_PRINCIPAL: "support-agent-1" });
  try {
    assert.deepEqual([coord.target, coord.principal, coord.kind, coord.timeoutMs], [target, "support-agent-1", "agent", 5_000]);
    const granted = await coord.claim(messageSubject(unique("env"), "m"), { ttl: 30 });
    assert.equal(granted.outcome, "GRANTED");
    assert.equal(granted.status?.holder, "support-agent-1");
  } finally {
    coord.close();
  }
  const person = Coordinator.fromEnv({ timeoutMs: 2_000 }, { INBOX_PRINCIPAL: "ana", INBOX_PRINCIPAL_KIND: "human", INBOX_CALL_TIMEOUT: "9" });
  assert.deepEqual([person.target, person.kind, person.timeoutMs], ["127.0.0.1:50051", "human", 2_000]); // overrides win
  person.close();
  assert.equal(optionsFromEnv({ INBOX_CALL_TIMEOUT: "2.5" }).timeoutMs, 2_500);
  assert.equal(optionsFromEnv({ INBOX_TLS: "yes" }).tls, true);
  // The old names of docs/node.md are not read: nothing falls back silently to them.
  assert.throws(() => Coordinator.fromEnv({}, { INBOX_COORDINATOR: target, PRINCIPAL: "agent-1" }), /set INBOX_TOKEN .* or, in development mode, INBOX_PRINCIPAL/);
  assert.throws(() => Coordinator.fromEnv({}, { INBOX_PRINCIPAL: "a", INBOX_PRINCIPAL_KIND: "robot" }), /INBOX_PRINCIPAL_KIND must be "agent" or "human"/);
  assert.throws(() => Coordinator.fromEnv({}, { INBOX_TOKEN: "t", INBOX_CA_FILE: "/nonexistent/ca.pem" }), /cannot read INBOX_CA_FILE=\/nonexistent\/ca.pem: ENOENT/);
  assert.throws(() => optionsFromEnv({ INBOX_CALL_TIMEOUT: "soon" }), /INBOX_CALL_TIMEOUT must be a number of seconds/);
});
