// The demo: two replicas of the guarded Express agent (agent-guarded.mjs), each talking to its own coordinator
// replica on one etcd, a fake Nylas, and the deliveries that make agents reply twice. Exactly one reply per
// message comes out, none for the message a human claimed. Exits 0 when every check holds.
//
//   cd examples/node && npm ci && node demo.mjs          (needs the repository's .venv: ./dev check makes it)
//
// Fired at both replicas at once, signed with the webhook secret:
//   1. one message.created notification three times (a redelivery, and the same delivery at two replicas);
//   2. a message.created and a message.updated notification of one message (two notification ids);
//   3. a notification of a message a human (ana@example.com) claimed first;
//   4. a forged notification (bad signature), which must be refused with 401;
//   5. for every reply the agents send, its copy in the Sent folder (message.created, as Nylas sends it for every
//      message the mailbox sends, here before the send's answer, and again later as message.updated): never answered;
//   6. while an agent drafts its answer to a message, a person answers it from Gmail: the agent sends nothing.
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { signNylas } from "inbox-claims";
import { Cluster, freePort } from "inbox-claims/testing";
import { startFakeNylas } from "./fake-nylas.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const SECRET = "demo-webhook-secret";
const API_KEY = "demo-api-key";
const GRANT = "grant-demo";
const HUMAN = "ana@example.com";
const SHOP = "support@shop.example";
const run = randomUUID().slice(0, 6);
const now = () => Math.floor(Date.now() / 1000);

// A message notification; `sent` makes it one the mailbox sent (Google's SENT label), from `sender`.
function notification(id, messageId, type = "message.created", { thread = `thread-${messageId}`, sent = false, sender = "customer@example.com", name = "Customer", date = now() } = {}) {
  return Buffer.from(JSON.stringify({
    specversion: "1.0", type, source: "/google/emails/realtime", id, time: now(), webhook_delivery_attempt: 1,
    data: { application_id: "demo-app", object: { id: messageId, grant_id: GRANT, thread_id: thread, object: "message", date,
      folders: sent ? ["SENT"] : ["INBOX", "UNREAD"], subject: `Question ${messageId}`, from: [{ name, email: sender }] } },
  }));
}

async function startAgent(principal, coordinator, nylas) {
  const port = await freePort();
  const env = { ...process.env, PORT: String(port), INBOX_PRINCIPAL: principal, INBOX_COORDINATOR_TARGET: coordinator, NYLAS_WEBHOOK_SECRET: SECRET,
    NYLAS_API_KEY: API_KEY, NYLAS_API_BASE: nylas.apiBase, LLM_DELAY_MS: process.env.LLM_DELAY_MS ?? "1000", INBOX_MAILBOX_ADDRESSES: SHOP };
  const child = spawn(process.execPath, [join(here, "agent-guarded.mjs")], { env, stdio: ["ignore", "inherit", "inherit"] });
  const url = `http://127.0.0.1:${port}/webhooks/nylas`;
  for (let i = 0; i < 200; i++) {
    const answer = await fetch(`${url}?challenge=hello`).catch(() => undefined);
    if (answer?.status === 200 && (await answer.text()) === "hello") return { principal, url, child };
    await sleep(50);
  }
  child.kill();
  throw new Error(`${principal} did not answer the challenge`);
}

const deliver = (agent, body, signature = signNylas(body, SECRET)) =>
  fetch(agent.url, { method: "POST", body, headers: { "content-type": "application/json", "x-nylas-signature": signature } }).then((r) => r.status);

async function main() {
  const failures = [];
  const cluster = await Cluster.start({ replicas: 2 });
  const agents = [];
  const echoes = [];
  // 5. Each send's copy comes back at once (before the send is answered) to the other agent, and again later.
  const nylas = await startFakeNylas(API_KEY, {
    onSend: async (sent) => {
      const thread = `thread-${sent.payload.reply_to_message_id}`;
      const copy = (id, type) => notification(id, sent.id, type, { thread, sent: true, sender: SHOP, name: "Shop Support" });
      const other = agents.find((agent) => !sent.payload.body.endsWith(agent.principal)) ?? agents[0];
      echoes.push(await deliver(other, copy(`notif-copy-${sent.id}-${run}`, "message.created")));
      setTimeout(() => void deliver(agents[0], copy(`notif-copy-upd-${sent.id}-${run}`, "message.updated")).then((s) => echoes.push(s)), 200);
    },
  });
  try {
    agents.push(await startAgent("agent-1", cluster.targets[0], nylas), await startAgent("agent-2", cluster.targets[1], nylas));
    console.log(`coordinators ${cluster.targets.join(", ")}; agents ${agents.map((a) => a.url).join(", ")}`);
    const [a, b] = agents;
    const human = cluster.client(HUMAN, { kind: "human" });
    const [redelivered, pair, forHuman, forged] = ["redelivered", "created-updated", "human", "forged"].map((name) => `msg-${name}-${run}`);
    const claimed = await human.claim({ mailbox: GRANT, kind: "message", id: forHuman }, { ttl: 300, note: "Ana is answering by phone" });
    console.log(`${HUMAN} claims ${forHuman}: ${claimed.outcome}`);

    const same = notification(`notif-1-${run}`, redelivered);
    const deliveries = [[a, same], [b, same], [a, same], [a, notification(`notif-2-${run}`, pair)], [b, notification(`notif-3-${run}`, pair, "message.updated")],
      [a, notification(`notif-4-${run}`, forHuman)], [b, notification(`notif-4-${run}`, forHuman)]];
    const statuses = await Promise.all(deliveries.map(([agent, body]) => deliver(agent, body)));
    const forgedBody = notification(`notif-5-${run}`, forged);
    const forgedStatus = await deliver(b, forgedBody, signNylas(forgedBody, "not-the-secret"));
    console.log(`deliveries answered ${statuses.join(", ")}; the forged one ${forgedStatus}`);
    if (statuses.some((s) => s !== 200)) failures.push(`a signed delivery was not answered 200: ${statuses}`);
    if (forgedStatus !== 401) failures.push(`the forged delivery was answered ${forgedStatus}, not 401`);

    // 6. Ana answers from Gmail while agent-1 drafts its answer (its LLM takes LLM_DELAY_MS).
    const drafting = `msg-gmail-${run}`;
    const asked = now();
    await deliver(a, notification(`notif-6-${run}`, drafting, "message.created", { date: asked }));
    for (let i = 0; i < 100 && (await human.status({ mailbox: GRANT, kind: "message", id: drafting })).state !== "CLAIMED"; i++) await sleep(20);
    const fromGmail = notification(`notif-7-${run}`, `gmail-${run}`, "message.created", { thread: `thread-${drafting}`, sent: true, sender: "ana@shop.example", name: "Ana Lima", date: asked + 1 });
    console.log(`ana@shop.example answers ${drafting} from Gmail while agent-1 drafts: delivered, answered ${await deliver(b, fromGmail)}`);

    const expected = { [redelivered]: "REPLIED", [pair]: "REPLIED", [forHuman]: "CLAIMED", [drafting]: "REPLIED" };
    let states = {};
    for (let i = 0; i < 300; i++) {
      states = Object.fromEntries(await Promise.all(Object.keys(expected).map(async (id) => [id, (await human.status({ mailbox: GRANT, kind: "message", id })).state])));
      if (JSON.stringify(states) === JSON.stringify(expected)) break;
      await sleep(100);
    }
    if (JSON.stringify(states) !== JSON.stringify(expected)) failures.push(`subject states ${JSON.stringify(states)}, expected ${JSON.stringify(expected)}`);
    await sleep(500); // a second send, if there were one, would have landed by now

    console.log("\nsends recorded by the fake Nylas:");
    for (const sent of nylas.sends) console.log(`  ${sent.id}: reply to ${sent.payload.reply_to_message_id} (${sent.payload.body.split("-- ")[1]})  Idempotency-Key ${sent.idempotencyKey}`);
    for (const [id, want] of [[redelivered, 1], [pair, 1], [forHuman, 0], [forged, 0], [drafting, 0]]) {
      const got = nylas.sendsFor(id).length;
      console.log(`  ${id}: ${got} send(s), expected ${want}`);
      if (got !== want) failures.push(`${id}: ${got} sends, expected ${want}`);
    }
    const answered = await human.status({ mailbox: GRANT, kind: "message", id: drafting });
    console.log(`  ${drafting}: ${answered.state}, answered from the mailbox by ${answered.outsideReply?.sender ?? "nobody"}`);
    if (!answered.repliedOutside) failures.push(`${drafting} is not recorded as answered from the mailbox`);
    const toCopies = nylas.sends.filter((sent) => nylas.sends.some((other) => other.id === sent.payload.reply_to_message_id) || sent.payload.reply_to_message_id.startsWith("gmail-"));
    console.log(`  replies to the mailbox's own messages (their ${echoes.length} copies delivered, answered ${[...new Set(echoes)].join(", ")}): ${toCopies.length}, expected 0`);
    if (toCopies.length !== 0 || echoes.length < 4 || echoes.some((s) => s !== 200)) failures.push(`copies of sent messages: ${toCopies.length} replied to, answered ${echoes}`);
    if (nylas.problems.length) failures.push(`the fake Nylas refused requests: ${nylas.problems}`);
    // Every reply went out with the claim's idempotency key (the same for every agent and both languages).
    const keyless = nylas.sends.filter((sent) => !/^ic1-[0-9a-f]{64}$/.test(sent.idempotencyKey));
    if (keyless.length) failures.push(`sends without the claim's Idempotency-Key: ${keyless.map((sent) => sent.id)}`);
  } finally {
    for (const agent of agents) agent.child.kill("SIGTERM");
    await nylas.close();
    await cluster.stop();
  }
  if (failures.length) {
    console.log(`\nFAILED:\n  ${failures.join("\n  ")}`);
    process.exitCode = 1;
  } else {
    console.log("\nOK: exactly one reply per message, none for the message the human claimed, none to the mailbox's own messages, none after a person answered from Gmail.");
  }
}

await main();
