// Look before you send (docs/design.md#reply-storms, docs/node.md "Reply storms") through the Gmail and Graph
// providers and the repository's doubles (tests/providers/fake_gmail.py threads.get, fake_graph.py the conversation
// filter; run by test/doubles.py), against a real coordinator on a real etcd, as tests/providers/test_look.py does for
// the Python client: right before the commit point, claim.send asks the provider for the thread's messages received
// since the claimed one and records what it finds. A person's reply from the mail client that no notification has
// brought yet stops the agent (answered outside); a customer's newer message refuses the send (moved on); with
// nothing new the reply goes out, marked Auto-Submitted, at the cost of one API call.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Cluster } from "../src/testing.js";
import { ClaimLost, ConversationMovedOn, messageSubject, type Coordinator } from "../src/index.js";
import { GmailProvider, METADATA_HEADERS } from "../src/providers/gmail.js";
import { GraphProvider, SELECT } from "../src/providers/graph.js";
import type { MessageFacts } from "../src/providers/seam.js";
import { Double } from "./doubles.js";

const SHOP = "support@shop.example";
const BODY = "Your order ships today.";
let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 1 });
});
after(async () => {
  await cluster?.stop();
});

let counter = 0;
type Document = Record<string, unknown> & { id: string };

/** One provider on its double: the mailbox's name in the coordinator, the message's facts, the double's moves. */
interface Mail {
  readonly double: Double;
  readonly provider: GmailProvider | GraphProvider;
  readonly mailbox: string;
  customer(): Promise<Document>;
  facts(document: Document): Promise<MessageFacts>;
  customerWritesAgain(to: Document): Promise<Document>;
  looks(): Promise<number>;
}

async function read(url: string, headers: Record<string, string>): Promise<Document> {
  const response = await fetch(url, { headers });
  assert.equal(response.status, 200, url);
  return (await response.json()) as Document;
}

const MAILS: Record<string, () => Promise<Mail>> = {
  async gmail() {
    const address = `shop-look-${process.pid}-${++counter}@shop.example`; // a mailbox of its own: the double's ids repeat
    const double = await Double.start("gmail", { address });
    const provider = new GmailProvider("https://agent.example/webhook", address, { token: "gmail-token", apiBase: double.url, jwksUrl: `${double.url}/oauth2/v3/certs`, historyCheckIntervalMs: 0 });
    return {
      double,
      provider,
      mailbox: address,
      customer: () => double.call<Document>("receive", "Bea Costa <bea@example.org>", "Where is my order?"),
      async facts(document) {
        const query = new URLSearchParams([["format", "metadata"], ...METADATA_HEADERS.map((name): [string, string] => ["metadataHeaders", name])]);
        return provider.facts(await read(`${double.url}/gmail/v1/users/me/messages/${document.id}?${query}`, { authorization: "Bearer gmail-token" }));
      },
      customerWritesAgain: (to) => double.call<Document>("customer_writes_again", to),
      looks: async () => (await double.get<Record<string, number>>("calls"))["threads.get"] ?? 0,
    };
  },
  async graph() {
    const user = `u-look-${process.pid}-${++counter}`;
    const double = await Double.start("graph", { user, address: SHOP, token: "graph-token" });
    const provider = new GraphProvider("graph-client-state", user, { token: "graph-token", apiBase: `${double.url}/v1.0`, mailboxAddresses: [SHOP] });
    return {
      double,
      provider,
      mailbox: user,
      // Received in the past: what arrives during the test is newer, to the second Graph gives.
      customer: () => double.callWith<Document>("receive", ["bea@example.org", "Where is my order?", "conv-look"], { at: "2020-01-01T00:00:00Z" }),
      async facts(document) {
        const url = `${double.url}/v1.0/users/${user}/messages/${encodeURIComponent(document.id)}?${new URLSearchParams({ $select: SELECT })}`;
        return provider.facts(await read(url, { authorization: "Bearer graph-token", prefer: 'IdType="ImmutableId"' }), "message.created");
      },
      customerWritesAgain: (to) => double.call<Document>("receive", "bea@example.org", "RE: Where is my order?", to["conversationId"]),
      looks: async () => (await double.get<Record<string, number>>("calls"))["messages.list"] ?? 0,
    };
  },
};

/** The agent's guarded reply to `message` through the provider, `meanwhile` running while it drafts. */
function reply(agent: Coordinator, mail: Mail, message: MessageFacts, meanwhile: () => Promise<unknown> = async () => undefined): Promise<string | undefined> {
  return agent.replyTo(message, { ttl: 30, provider: mail.provider }, async (claim) => {
    await meanwhile();
    return claim.send(() => mail.provider.reply(message, { body: BODY, stamp: claim.stamp }));
  });
}

for (const name of Object.keys(MAILS).sort()) {
  test(`${name}: a person's reply from the mail client, found by the look, stops the agent: nothing sent, REPLIED outside`, async () => {
    const mail = await MAILS[name]!();
    try {
      const agent = cluster.client(`agent-${name}`, { mailboxAddresses: [SHOP] });
      const document = await mail.customer();
      const message = await mail.facts(document);
      const lost = await reply(agent, mail, message, () => mail.double.call("person_replies", document)).catch((error: unknown) => error);
      assert.ok(lost instanceof ClaimLost && lost.reason === "answered_outside", String(lost));
      assert.equal(await mail.double.call<number>("replies_to", document.id), 0);
      assert.equal(await mail.double.call<number>("replies_to", document.id, "person"), 1);
      const status = await agent.status(messageSubject(mail.mailbox, message.messageId));
      assert.equal(status.state, "REPLIED");
      assert.ok(status.repliedOutside);
      assert.equal(await mail.looks(), 1);
    } finally {
      await mail.double.stop();
    }
  });

  test(`${name}: a customer's newer message, found by the look, refuses the send (ConversationMovedOn); nothing sent`, async () => {
    const mail = await MAILS[name]!();
    try {
      const agent = cluster.client(`agent-${name}`, { mailboxAddresses: [SHOP] });
      const document = await mail.customer();
      const message = await mail.facts(document);
      let newer: Document | undefined;
      const refused = await reply(agent, mail, message, async () => (newer = await mail.customerWritesAgain(document))).catch((error: unknown) => error);
      assert.ok(refused instanceof ConversationMovedOn, String(refused));
      assert.equal(refused.newerMessageId, newer?.id);
      assert.equal(await mail.double.call<number>("replies_to", document.id), 0);
      assert.equal((await agent.status(messageSubject(mail.mailbox, message.messageId))).state, "FREE");
    } finally {
      await mail.double.stop();
    }
  });

  test(`${name}: with nothing new in the thread the reply goes out, marked Auto-Submitted, after one look`, async () => {
    const mail = await MAILS[name]!();
    try {
      const agent = cluster.client(`agent-${name}`, { mailboxAddresses: [SHOP] });
      const document = await mail.customer();
      const message = await mail.facts(document);
      assert.ok(await reply(agent, mail, message));
      assert.equal(await mail.double.call<number>("replies_to", document.id), 1);
      assert.equal(await mail.looks(), 1);
      const copy = await mail.double.call<Record<string, unknown>>("sent_copy", document.id);
      assert.match(JSON.stringify(copy), /Auto-Submitted/);
    } finally {
      await mail.double.stop();
    }
  });
}
