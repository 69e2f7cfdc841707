// AgentMail and Resend (both deliver through Svix, both take an Idempotency-Key on sends) through the provider seam,
// through real coordinators on real etcd, against doubles of their APIs (test/mailapis.ts, following their docs):
// one message delivered three times over two workers (AgentMail: the same event through a second webhook, another
// svix-id and the same event_id), two agents with different principals, a person answering while the agent drafts,
// the agent's own reply coming back as a sent event, a lost acknowledgement, a forged signature, and a send whose
// answer was lost (IN_DOUBT) settled by its sent event carrying the claim's stamp. Each guarded scenario sends one
// reply per customer message (counted at the double); the same deliveries to the unguarded agent send two or more.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Cluster } from "../src/testing.js";
import { idempotencyKey, messageSubject, type Coordinator } from "../src/index.js";
import { AgentMailProvider } from "../src/providers/agentmail.js";
import { ResendProvider } from "../src/providers/resend.js";
import { eventually, guardedAgents, LocalCursors, post, unguarded, type Replier } from "./doubles.js";
import { AgentMailDouble, ResendDouble, secretOf, svixDelivery } from "./mailapis.js";

let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 2 });
});
after(async () => {
  await cluster?.stop();
});

type Json = Record<string, unknown>;
/** What a scenario needs of a provider and its double. */
interface Kit {
  double: AgentMailDouble | ResendDouble;
  mailbox: string;
  make(): Replier;
  /** A customer's mail: its event and the message id the agents claim. */
  receive(from: string, subject: string): { event: Json; id: string };
  close(): Promise<void>;
}

let counter = 0;

async function agentmail(): Promise<Kit> {
  const inbox = `support-${process.pid}-${++counter}@agentmail.to`;
  const double = await new AgentMailDouble(inbox, secretOf(`agentmail-secret-${counter}`)).start();
  return {
    double,
    mailbox: inbox,
    make: () => new AgentMailProvider(double.secret, { apiKey: double.apiKey, apiBase: double.url }),
    receive(from, subject) {
      const event = double.receive(from, subject);
      return { event, id: String((event.message as Json).message_id) };
    },
    close: () => double.stop(),
  };
}

async function resend(): Promise<Kit> {
  const mailbox = `support-${process.pid}-${++counter}@shop.example`;
  const double = await new ResendDouble(mailbox, secretOf(`resend-secret-${counter}`)).start();
  return {
    double,
    mailbox,
    make: () => new ResendProvider(double.secret, mailbox, { apiKey: double.apiKey, apiBase: double.url }),
    receive(from, subject) {
      const event = double.receive(from, subject);
      return { event, id: String((event.data as Json).email_id) };
    },
    close: () => double.stop(),
  };
}

const KITS = { agentmail, resend };

async function withKit(name: keyof typeof KITS, run: (kit: Kit) => Promise<void>): Promise<void> {
  const kit = await KITS[name]();
  try {
    await run(kit);
  } finally {
    await kit.close();
  }
}

/** Posts a Svix delivery to an agent's endpoint; its status. */
async function deliver(url: string, delivery: { body: Buffer; headers: Record<string, string> }): Promise<number> {
  return (await post(url, delivery.body, delivery.headers)).status;
}

const agentsOf = (kit: Kit, clients: Coordinator[], drafting?: Promise<void>) => guardedAgents(() => kit.make(), clients, drafting);
const status = (mailbox: string, id: string) => cluster.client("probe").status(messageSubject(mailbox, id));

for (const name of Object.keys(KITS) as (keyof typeof KITS)[]) {
  test(`${name}: one message delivered three times over two workers gets one reply, sent with the claim's key as Idempotency-Key and Auto-Submitted; its sent event is never answered; unguarded: two or more`, async () => {
    await withKit(name, async (kit) => {
      const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
      const first = svixDelivery(kit.double.secret, event);
      // A Svix retry (the same svix-id), and the same event through a second webhook (another svix-id): for
      // AgentMail the same event_id, for Resend another delivery of the same message.
      const second = svixDelivery(kit.double.secret, event);
      const agent = await agentsOf(kit, [cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 })]);
      assert.deepEqual(await Promise.all([deliver(agent.urls[0]!, first), deliver(agent.urls[1]!, first), deliver(agent.urls[1]!, second)]), [200, 200, 200]);
      await eventually(() => kit.double.repliesTo(id) === 1);
      const reply = kit.double.sends[0]!;
      assert.equal(reply.key, idempotencyKey(messageSubject(kit.mailbox, id)));
      const headers = Object.fromEntries(Object.entries(reply.headers).map(([k, v]) => [k.toLowerCase(), v]));
      assert.equal(headers["auto-submitted"], "auto-replied");
      // The agent's reply comes back as a sent event: outgoing, recorded as its own, never answered.
      assert.equal(await deliver(agent.urls[0]!, svixDelivery(kit.double.secret, kit.double.sentEvent(reply.id))), 200);
      await agent.close();
      assert.equal(kit.double.sends.length, 1);
      const recorded = await status(kit.mailbox, id);
      assert.deepEqual([recorded.state, recorded.sentMessageId], ["REPLIED", reply.id]);
    });
    await withKit(name, async (kit) => {
      const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
      for (let i = 0; i < 3; i++) await unguarded(kit.make(), svixDelivery(kit.double.secret, event), new LocalCursors());
      assert.ok(kit.double.repliesTo(id) >= 2, `unguarded sent ${kit.double.repliesTo(id)}`);
    });
  });

  test(`${name}: two agents with different principals, two messages each delivered to both: one reply each`, async () => {
    await withKit(name, async (kit) => {
      const messages = [kit.receive("Bea Costa <bea@example.org>", "Where is my order?"), kit.receive("carl@example.net", "Refund")];
      const agent = await agentsOf(kit, [cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })]);
      const answers = await Promise.all(messages.flatMap(({ event }) => agent.urls.map((url) => deliver(url, svixDelivery(kit.double.secret, event)))));
      assert.deepEqual(answers, [200, 200, 200, 200]);
      await agent.close();
      assert.deepEqual(messages.map(({ id }) => kit.double.repliesTo(id)), [1, 1]);
    });
  });

  test(`${name}: a person answering while the agent drafts: the agent sends nothing; unguarded: both go out`, async () => {
    await withKit(name, async (kit) => {
      const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
      let draftDone!: () => void;
      const drafting = new Promise<void>((ok) => (draftDone = ok));
      const agent = await agentsOf(kit, [cluster.client("agent-a"), cluster.client("agent-a", { replica: 1 })], drafting);
      assert.equal(await deliver(agent.urls[0]!, svixDelivery(kit.double.secret, event)), 200); // claimed: the agent drafts
      const person = kit.double.personReplies(id); // Carla answers from the provider's console
      assert.equal(await deliver(agent.urls[1]!, svixDelivery(kit.double.secret, person)), 200); // its sent event: recorded
      draftDone();
      await agent.close();
      assert.deepEqual(kit.double.sends.map((s) => s.by), ["person"]);
      const recorded = await status(kit.mailbox, id);
      assert.deepEqual([recorded.state, recorded.repliedOutside], ["REPLIED", true]);
    });
    await withKit(name, async (kit) => {
      const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
      kit.double.personReplies(id);
      await unguarded(kit.make(), svixDelivery(kit.double.secret, event), new LocalCursors());
      assert.equal(kit.double.repliesTo(id) + kit.double.repliesTo(id, "person"), 2);
    });
  });

  test(`${name}: a lost acknowledgement (answered, the 200 lost, delivered again to the other worker): no second reply; a forged signature is refused, nothing recorded`, async () => {
    await withKit(name, async (kit) => {
      const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
      const delivery = svixDelivery(kit.double.secret, event);
      const agent = await agentsOf(kit, [cluster.client("agent-a"), cluster.client("agent-b", { replica: 1 })]);
      assert.equal(await deliver(agent.urls[0]!, delivery), 200);
      await eventually(() => kit.double.repliesTo(id) === 1);
      assert.equal(await deliver(agent.urls[1]!, delivery), 200); // Svix never saw the 200: the same message again
      // Someone without the endpoint's secret posts a mail of their own making.
      const forged = kit.receive("mallory@example.com", "Refund me");
      assert.equal(await deliver(agent.urls[0]!, svixDelivery(secretOf("not the endpoint's secret"), forged.event)), 401);
      await agent.close();
      assert.deepEqual([kit.double.repliesTo(id), kit.double.repliesTo(forged.id)], [1, 0]);
      assert.equal((await status(kit.mailbox, forged.id)).state, "FREE");
    });
  });

  test(`${name}: a send whose answer was lost is IN_DOUBT, settled by its sent event carrying the claim's stamp (REPLIED, the sent id, by the agent reading it); a 503 that sent nothing stays for a person`, async () => {
    const quick = await cluster.addReplica(undefined, ["--send-timeout", "1s"]); // SENDING turns IN_DOUBT within a second
    const reader = cluster.client("agent-b", { replica: 1 });
    await Promise.all(
      (["lost_answer", "unavailable"] as const).map((failure) =>
        withKit(name, async (kit) => {
          const drafter = cluster.client("agent-a", { target: quick });
          const { event, id } = kit.receive("Bea Costa <bea@example.org>", "Where is my order?");
          kit.double.sendFailure = failure;
          const agent = await agentsOf(kit, [drafter]);
          assert.equal(await deliver(agent.urls[0]!, svixDelivery(kit.double.secret, event)), 200);
          const subject = messageSubject(kit.mailbox, id);
          await eventually(async () => (await drafter.status(subject)).state === "IN_DOUBT");
          await agent.close();
          if (failure === "unavailable") {
            assert.equal(kit.double.sends.length, 0);
            assert.deepEqual([(await reader.status(subject)).state, (await reader.status(subject)).settledBy], ["IN_DOUBT", ""]);
            return;
          }
          const sent = kit.double.replyOf(id);
          const other = await agentsOf(kit, [reader]);
          assert.equal(await deliver(other.urls[0]!, svixDelivery(kit.double.secret, kit.double.sentEvent(sent))), 200);
          await other.close();
          const settled = await reader.status(subject);
          assert.deepEqual([settled.state, settled.sentMessageId, settled.settledBy], ["REPLIED", sent, "agent-b"]);
          assert.equal(kit.double.repliesTo(id), 1);
        }),
      ),
    );
  });
}
