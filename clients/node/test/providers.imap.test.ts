// Any mailbox over IMAP and SMTP, in Node, against a real Dovecot and a real SMTP server on loopback
// (test/mailserver.ts) and real coordinators on etcd: customers' mail arrives by SMTP, agents watch the shared
// mailbox (ImapWatcher: IDLE on the Inbox and Sent), and each customer's own mailbox is read at the end to count the
// replies it received. Three customers and three watchers of two agents; a person answering from a mail client (an
// SMTP send plus the copy in Sent) while the agent drafts; Dovecot restarted under the watchers; a watcher killed
// mid-message and another taking over; and the same mail to agents without the coordinator, which answer twice.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { join } from "node:path";
import { createInterface } from "node:readline";
import nodemailer from "nodemailer";
import { Cluster, REPO } from "../src/testing.js";
import { messageSubject, type Coordinator } from "../src/index.js";
import { Accepted } from "../src/providers/seam.js";
import { ImapProvider, ImapWatcher } from "../src/providers/imap.js";
import { eventually, LocalCursors, unclaimed } from "./doubles.js";
import { Dovecot, PASSWORD, Smtp } from "./mailserver.js";

let cluster: Cluster;
let dovecot: Dovecot;
let smtp: Smtp;
const SUPPORT = "support@example.test";
const PERSON = "carla@example.test"; // a person of the support team, with a mail client on the shared mailbox
const CUSTOMERS = ["bea@example.test", "carl@example.test", "dee@example.test", "eve@example.test", "finn@example.test", "gus@example.test", "hal@example.test", "ida@example.test", "jo@example.test"];

before(async () => {
  cluster = await Cluster.start({ replicas: 2 });
  dovecot = await Dovecot.start([SUPPORT, PERSON, ...CUSTOMERS]);
  smtp = await Smtp.start(dovecot);
});
after(async () => {
  await smtp?.stop();
  await dovecot?.remove();
  await cluster?.stop();
});

type Options = { checkEveryMs?: number; smtpTimeoutMs?: number; appendToSent?: boolean };

function provider(options: Options = {}): ImapProvider {
  return new ImapProvider(SUPPORT, { host: "127.0.0.1", port: dovecot.port, secure: false, user: SUPPORT, pass: PASSWORD, smtpPort: smtp.port, smtpTls: "none", checkEveryMs: 0, ...options });
}

/** A customer writing to the shared mailbox over SMTP; the Message-ID. */
async function write(from: string, subject: string): Promise<string> {
  const transport = nodemailer.createTransport({ host: "127.0.0.1", port: smtp.port, secure: false, ignoreTLS: true });
  const sent = await transport.sendMail({ from, to: SUPPORT, subject, text: "Where is my order?" });
  transport.close();
  return sent.messageId;
}

/** The replies `customer` received from the shared mailbox, read in their own mailbox. */
async function repliesIn(customer: string): Promise<number> {
  return (await dovecot.messages(customer)).filter((m) => /^From:.*support@example\.test/im.test(m.headers)).length;
}

/** Guarded watchers, one per client, each with its own provider; `drafting` holds their sends back. */
async function watchers(clients: Coordinator[], drafting?: Promise<void>, options: Options & { ttl?: number } = {}): Promise<ImapWatcher[]> {
  return Promise.all(
    clients.map(async (coordinator) => {
      const { ttl: _ttl, ...settings } = options;
      const mail = provider(settings);
      const watcher = new ImapWatcher(mail, {
        coordinator,
        ttl: options.ttl ?? 30,
        work: async (message, claim) => {
          await drafting;
          await claim.send(() => mail.reply(message, { body: "Your order ships today.", stamp: claim.stamp }));
        },
      });
      await watcher.start();
      return watcher;
    }),
  );
}

const closeAll = (running: ImapWatcher[]): Promise<unknown> => Promise.all(running.map((w) => w.close()));

test("imap: three customers write by SMTP, three watchers of two agents watch the mailbox: one reply each in the customers' mailboxes, one copy each in Sent, the originals flagged \\Answered; unguarded agents answer twice", async () => {
  const running = await watchers([cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 }), cluster.client("agent-b", { replica: 1 })]);
  const customers = CUSTOMERS.slice(0, 3);
  const ids = await Promise.all(customers.map((customer, i) => write(customer, `Order ${i}`)));
  await eventually(async () => (await Promise.all(customers.map(repliesIn))).every((n) => n >= 1), 30_000);
  await closeAll(running);
  assert.deepEqual(await Promise.all(customers.map(repliesIn)), [1, 1, 1]);
  const sent = await dovecot.messages(SUPPORT, "Sent");
  assert.equal(sent.length, 3); // the replies' one copy each, never answered in turn
  const inbox = await dovecot.messages(SUPPORT);
  assert.ok(inbox.every((m) => m.flags.includes("\\Answered")));
  for (const id of ids) assert.equal((await cluster.client("probe").status(messageSubject(SUPPORT, id))).state, "REPLIED");
  // The same mailbox read by two agents without the coordinator (each keeps its own position): each answers each.
  const fresh = CUSTOMERS.slice(3, 5);
  for (const [i, customer] of fresh.entries()) await write(customer, `Unguarded ${i}`);
  await eventually(async () => (await dovecot.messages(SUPPORT)).length === 5);
  for (let worker = 0; worker < 2; worker++) {
    const mail = provider();
    const batch = await mail.open(new Accepted({ recover: false }), new LocalCursors());
    for (const facts of batch.facts) if (fresh.includes(facts.fromAddresses[0]!)) await mail.reply(facts, { body: "Your order ships today.", stamp: unclaimed() });
    await mail.close();
  }
  assert.deepEqual(await Promise.all(fresh.map(repliesIn)), [2, 2]);
});

test("imap: a person answering from a mail client (SMTP, then the copy in Sent) while the agent drafts: the agent sends nothing", async () => {
  const customer = CUSTOMERS[5]!;
  let draftDone!: () => void;
  const drafting = new Promise<void>((ok) => (draftDone = ok));
  const running = await watchers([cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })], drafting);
  const id = await write(customer, "Broken zipper");
  const subject = messageSubject(SUPPORT, id);
  await eventually(async () => (await cluster.client("probe").status(subject)).state === "CLAIMED");
  // Carla answers from her mail client: sent by SMTP, and her client files the copy in the shared Sent folder.
  const transport = nodemailer.createTransport({ host: "127.0.0.1", port: smtp.port, secure: false, ignoreTLS: true });
  const answer = await transport.sendMail({ from: SUPPORT, to: customer, subject: "Re: Broken zipper", text: "We send a new one. Carla", inReplyTo: id, references: [id] });
  transport.close();
  const client = await dovecot.imap(SUPPORT); // Carla's mail client, logged in to the shared mailbox
  const copy = `From: ${SUPPORT}\r\nTo: ${customer}\r\nSubject: Re: Broken zipper\r\nMessage-ID: ${answer.messageId}\r\nIn-Reply-To: ${id}\r\nReferences: ${id}\r\nDate: ${new Date().toUTCString()}\r\n\r\nWe send a new one. Carla\r\n`;
  await client.append("Sent", Buffer.from(copy), ["\\Seen"]);
  await client.logout();
  await eventually(async () => (await cluster.client("probe").status(subject)).state === "REPLIED", 30_000);
  draftDone();
  await closeAll(running);
  assert.equal(await repliesIn(customer), 1); // Carla's, and no agent's
  assert.equal((await cluster.client("probe").status(subject)).repliedOutside, true);
});

test("imap: Dovecot restarted under the watchers, mail arriving while it is down (the SMTP server queues it): they reconnect and answer it once", async () => {
  const running = await watchers([cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })]);
  const customer = "hal@example.test";
  let id = "";
  try {
    await dovecot.stop();
    id = await write(customer, "Still there?");
    assert.equal(smtp.pending, 1); // accepted, queued: the mail store cannot be written while Dovecot is down
  } finally {
    await dovecot.start();
  }
  await eventually(async () => (await cluster.client("probe").status(messageSubject(SUPPORT, id))).state === "REPLIED", 30_000);
  await closeAll(running);
  assert.equal(await repliesIn(customer), 1);
});

test("imap: a watcher killed mid-message (its claim left to lapse) and another watching: the message is answered once, none lost", async () => {
  const customer = "ida@example.test";
  const agent = spawn(process.execPath, [join(REPO, "clients", "node", "dist", "test", "imap-agent.js")], {
    env: { ...process.env, IMAP_ADDRESS: SUPPORT, IMAP_PASSWORD: PASSWORD, IMAP_PORT: String(dovecot.port), SMTP_PORT: String(smtp.port), COORDINATOR_TARGET: cluster.targets[0]!, PRINCIPAL: "agent-a", CLAIM_TTL: "2", DRAFT_MS: "600000" },
    stdio: ["ignore", "pipe", "inherit"],
  });
  const lines = createInterface({ input: agent.stdout! });
  const said: string[] = [];
  lines.on("line", (line) => said.push(line));
  await eventually(() => said.includes("watching"), 30_000);
  const id = await write(customer, "Lost parcel");
  await eventually(() => said.includes(`drafting ${id}`), 30_000);
  agent.kill("SIGKILL"); // mid-message: claimed, drafting, nothing sent
  await new Promise((ok) => agent.once("exit", ok));
  // Another agent's watcher: its start and its periodic checks read the Inbox's unanswered messages; once the
  // killed one's claim lapsed (2 s), the message is claimed again and answered.
  const running = await watchers([cluster.client("agent-b", { replica: 1 })], undefined, { checkEveryMs: 1_000 });
  await eventually(async () => (await repliesIn(customer)) >= 1, 30_000);
  await closeAll(running);
  assert.equal(await repliesIn(customer), 1);
  assert.equal((await cluster.client("probe").status(messageSubject(SUPPORT, id))).state, "REPLIED");
});

test("imap: an SMTP answer lost (the server filed the copy in Sent, as Gmail's and Microsoft 365's do): the send's outcome is unknown to the agent, and its stamped copy in Sent settles it (REPLIED with the copy's id); no second reply, no person asked", async () => {
  const customer = "jo@example.test";
  smtp.filesSent = true;
  smtp.loseAnswersMs = 3_000; // the message is delivered and filed; its answer comes after the agent stopped waiting
  const failures: unknown[] = [];
  try {
    const mail = provider({ smtpTimeoutMs: 1_000, appendToSent: false });
    const agent = new ImapWatcher(mail, {
      coordinator: cluster.client("agent-a"),
      ttl: 30,
      work: async (message, claim) => {
        await claim.send(() => mail.reply(message, { body: "Your order ships today.", stamp: claim.stamp })).catch((error: unknown) => failures.push(error));
      },
    });
    await agent.start();
    const other = await watchers([cluster.client("agent-b", { replica: 1 })]);
    const id = await write(customer, "Wrong size");
    const subject = messageSubject(SUPPORT, id);
    await eventually(async () => (await cluster.client("probe").status(subject)).state === "REPLIED", 30_000);
    await eventually(() => failures.length === 1, 30_000);
    await closeAll([agent, ...other]);
    assert.equal((failures[0] as Error).name, "SendOutcomeUnknown"); // not a refusal: the message was not freed
    const settled = await cluster.client("probe").status(subject);
    assert.match(settled.sentMessageId, /^<ic1-[0-9a-f]{64}\.\d+@example\.test>$/);
    assert.equal(await repliesIn(customer), 1);
  } finally {
    smtp.filesSent = false;
    smtp.loseAnswersMs = 0;
  }
});
