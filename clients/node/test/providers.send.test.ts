// The providers' sends without a network (the vectors pin what comes in; this, what goes out): the stamp's format,
// Graph's createReply + send and what each answer means for claim.send, Gmail's raw reply (threading headers, the
// stamp and a Message-ID from it, a subject in another script) and its answers, the settings a provider refuses, and
// what each provider asks for the look before a send.
import { test } from "node:test";
import assert from "node:assert/strict";
import { sendingAs } from "../src/current.js";
import { SendRejected } from "../src/errors.js";
import { GmailProvider, GmailSendOutcomeUnknown, GmailSendRejected } from "../src/providers/gmail.js";
import { GraphProvider, GraphSendOutcomeUnknown, GraphSendRejected } from "../src/providers/graph.js";
import { formatStamp, parseStamp, ProviderError, stampMessageId, type HttpRequest, type HttpResponse, type MessageFacts } from "../src/providers/seam.js";

const STAMP = { key: "ic1-" + "ab".repeat(32), token: 4711n };
const json = (status: number, body?: unknown): HttpResponse => ({ status, body: Buffer.from(body === undefined ? "" : JSON.stringify(body)) });

/** A transport answering from a list, keeping the requests. */
function scripted(...answers: (HttpResponse | Error)[]): { requests: HttpRequest[]; transport: (request: HttpRequest) => Promise<HttpResponse> } {
  const requests: HttpRequest[] = [];
  return {
    requests,
    transport: async (request) => {
      requests.push(request);
      const answer = answers.shift();
      if (answer === undefined) throw new Error(`no answer for ${request.method} ${request.url}`);
      if (answer instanceof Error) throw answer;
      return answer;
    },
  };
}

function facts(more: Partial<MessageFacts> = {}): MessageFacts {
  return {
    provider: "test",
    event: "message.created",
    mailbox: "support@shop.example",
    dedupKey: "m-1",
    messageId: "AAMk-1=",
    threadId: "thread-1",
    receivedAt: undefined,
    sender: "Bea Costa <bea@example.org>",
    subjectLine: "Where is my order?",
    fromAddresses: ["bea@example.org"],
    folders: ["INBOX"],
    outgoing: undefined,
    automated: undefined,
    stamp: undefined,
    reply: { to: ["bea@example.org"], subject: "Re: Where is my order?", internetMessageId: "<orig@mail.example>", references: ["<a@x.example>"] },
    source: {},
    ...more,
  };
}

test("the claim stamp: its header value and its Message-ID read back; anything else is no stamp", () => {
  assert.equal(formatStamp(STAMP), `${STAMP.key}.4711`);
  assert.deepEqual(parseStamp(` ${formatStamp(STAMP)} `), STAMP);
  assert.deepEqual(parseStamp(stampMessageId(STAMP, "shop.example")), STAMP);
  for (const other of ["", "ic1-abc.1", `${STAMP.key}.0`, `${STAMP.key}`, `<CA+123@mail.gmail.com>`, `${STAMP.key}.12345678901234567890`]) {
    assert.equal(parseStamp(other), undefined, other);
  }
});

test("graph: the reply is createReply with the stamp, then send: 202 gives the draft's id; a 4xx is rejected, a 5xx or no answer unknown", async () => {
  const ok = scripted(json(201, { id: "AAMk-draft=" }), json(202));
  const graph = new GraphProvider("state", "u-1", { token: () => "tok", apiBase: "https://graph.test/v1.0", transport: ok.transport });
  assert.equal(await graph.reply(facts(), { body: "Ships today.", stamp: STAMP }), "AAMk-draft=");
  const [draft, send] = ok.requests;
  assert.equal(draft!.url, "https://graph.test/v1.0/users/u-1/messages/AAMk-1=/createReply");
  // In MIME (JSON internetMessageHeaders take only X- headers): threaded, stamped, and marked as an agent's reply.
  assert.equal(draft!.json, undefined);
  assert.deepEqual(draft!.headers, [["Authorization", "Bearer tok"], ["Prefer", 'IdType="ImmutableId"'], ["Content-Type", "text/plain"]]);
  const mime = Buffer.from(draft!.content!.toString("ascii"), "base64").toString("utf8");
  const [head, body] = mime.split("\r\n\r\n");
  const headers = Object.fromEntries(head!.split("\r\n").map((line) => [line.slice(0, line.indexOf(":")), line.slice(line.indexOf(":") + 2)]));
  assert.equal(headers["X-Inbox-Claim"], formatStamp(STAMP));
  assert.equal(headers["Auto-Submitted"], "auto-replied");
  assert.equal(headers["In-Reply-To"], "<orig@mail.example>");
  assert.equal(headers["References"], "<a@x.example> <orig@mail.example>");
  assert.equal(headers["To"], facts().reply.to.join(", "));
  assert.equal(headers["Subject"], facts().reply.subject);
  assert.equal(Buffer.from(body!, "base64").toString("utf8"), "Ships today.");
  assert.equal(send!.url, "https://graph.test/v1.0/users/u-1/messages/AAMk-draft=/send");
  const cases: [(HttpResponse | Error)[], new (...args: never[]) => Error][] = [
    [[json(404, { error: {} })], GraphSendRejected], // the message is gone: no draft, nothing sent
    [[new ProviderError("connection refused")], GraphSendRejected], // no draft was made
    [[json(201, { id: "d=" }), json(400, { error: {} })], GraphSendRejected],
    [[json(201, { id: "d=" }), json(503, { error: {} })], GraphSendOutcomeUnknown],
    [[json(201, { id: "d=" }), new ProviderError("timed out")], GraphSendOutcomeUnknown],
  ];
  for (const [answers, error] of cases) {
    const failing = new GraphProvider("state", "u-1", { token: "tok", apiBase: "https://graph.test/v1.0", transport: scripted(...answers).transport });
    await assert.rejects(failing.reply(facts(), { body: "x", stamp: STAMP }), error);
  }
  assert.ok(new GraphSendRejected("x") instanceof SendRejected); // claim.send aborts on it: FREE again
});

test("gmail: the raw reply answers the sender in the thread (In-Reply-To, References), stamped, with a Message-ID from the stamp; its answers", async () => {
  const ok = scripted(json(200, { id: "18c-sent", threadId: "thread-1", labelIds: ["SENT"] }));
  const gmail = new GmailProvider("https://agent.example/webhook", "support@shop.example", { token: "tok", apiBase: "https://gmail.test", transport: ok.transport });
  const message = facts({ reply: { to: ["bea@example.org"], subject: "Re: Où est ma commande ?", internetMessageId: "<orig@mail.example>", references: ["<a@x.example>"] } });
  assert.equal(await gmail.reply(message, { body: "Elle part aujourd'hui.", stamp: STAMP }), "18c-sent");
  const request = ok.requests[0]!;
  assert.equal(request.url, "https://gmail.test/gmail/v1/users/me/messages/send");
  const sent = request.json as { raw: string; threadId: string };
  assert.equal(sent.threadId, "thread-1");
  const raw = Buffer.from(sent.raw, "base64url").toString("utf8");
  const [head, body] = raw.split("\r\n\r\n");
  const headers = Object.fromEntries(head!.split("\r\n").map((line) => [line.slice(0, line.indexOf(":")), line.slice(line.indexOf(":") + 2)]));
  assert.equal(headers["To"], "bea@example.org");
  assert.equal(headers["From"], "support@shop.example");
  assert.equal(headers["In-Reply-To"], "<orig@mail.example>");
  assert.equal(headers["References"], "<a@x.example> <orig@mail.example>");
  assert.equal(headers["X-Inbox-Claim"], formatStamp(STAMP));
  assert.equal(headers["Auto-Submitted"], "auto-replied"); // an agent's reply (RFC 3834), threaded as above
  assert.deepEqual(parseStamp(headers["Message-ID"]), STAMP);
  assert.equal(headers["Subject"], `=?UTF-8?B?${Buffer.from("Re: Où est ma commande ?").toString("base64")}?=`);
  assert.equal(Buffer.from(body!.replaceAll("\r\n", ""), "base64").toString("utf8"), "Elle part aujourd'hui.");
  const cases: [HttpResponse | Error, new (...args: never[]) => Error][] = [
    [json(400, { error: { message: "Invalid To header" } }), GmailSendRejected],
    [json(503, { error: {} }), GmailSendOutcomeUnknown],
    [new ProviderError("timed out"), GmailSendOutcomeUnknown],
  ];
  for (const [answer, error] of cases) {
    const failing = new GmailProvider("aud", "support@shop.example", { token: "tok", transport: scripted(answer).transport });
    await assert.rejects(failing.reply(message, { body: "x", stamp: STAMP }), error);
  }
});

test("settings a provider refuses at start, naming what to set", () => {
  assert.throws(() => GraphProvider.fromEnv({ GRAPH_USER: "u", GRAPH_TOKEN: "t" }), /set GRAPH_CLIENT_STATE/);
  assert.throws(() => new GraphProvider("x".repeat(256), "u", { token: "t" }), /clientState must be 1 to 255/);
  assert.throws(() => GmailProvider.fromEnv({ GMAIL_USER: "a@b.example", GMAIL_TOKEN: "t" }), /set GMAIL_PUSH_AUDIENCE/);
  assert.throws(() => new GmailProvider("aud", "not-an-address", { token: "t" }), /the mailbox's address/);
  const env = { GMAIL_PUSH_AUDIENCE: "aud", GMAIL_USER: "a@b.example", GMAIL_TOKEN: "t" };
  assert.throws(() => GmailProvider.fromEnv({ ...env, GMAIL_HISTORY_CHECK_SECONDS: "soon" }), /GMAIL_HISTORY_CHECK_SECONDS/);
  assert.equal(GmailProvider.fromEnv({ ...env, GMAIL_HISTORY_CHECK_SECONDS: "0" }).periodicIntervalMs, 0);
  assert.equal(GmailProvider.fromEnv(env).periodicIntervalMs, 60_000);
});

// -- the look before a send (Provider.since): what each provider asks, and what it makes of the answer ----------

const CLAIMED = new Date("2026-12-02T14:03:00Z");

test("graph: since() lists the conversation's messages received after the claim's, with the facts' fields; a failure is a ProviderError", async () => {
  const newer = {
    id: "AAMk-2=",
    changeKey: "ck2",
    conversationId: "thread-1",
    receivedDateTime: "2026-12-02T14:05:00Z",
    subject: "Re: Where is my order?",
    from: { emailAddress: { name: "Bea Costa", address: "bea@example.org" } },
    replyTo: [],
    parentFolderId: "AAMk-inbox=",
    internetMessageId: "<m2@mail.example>",
    internetMessageHeaders: [{ name: "Message-ID", value: "<m2@mail.example>" }],
  };
  const ok = scripted(json(200, { value: [newer] }));
  const graph = new GraphProvider("state", "u-1", { token: "tok", apiBase: "https://graph.test/v1.0", sentItemsFolderId: "AAMk-sent=", transport: ok.transport });
  const found = await graph.since(facts({ receivedAt: CLAIMED }));
  const asked = ok.requests[0]!;
  assert.equal(asked.url, "https://graph.test/v1.0/users/u-1/messages");
  const params = Object.fromEntries(asked.params);
  assert.equal(params["$filter"], "conversationId eq 'thread-1' and receivedDateTime gt 2026-12-02T14:03:00.000Z");
  assert.equal(params["$select"], "id,changeKey,conversationId,receivedDateTime,subject,from,replyTo,parentFolderId,internetMessageId,internetMessageHeaders");
  assert.deepEqual(
    found.map((f) => [f.messageId, f.threadId, f.receivedAt?.toISOString(), f.fromAddresses, f.automated?.automated]),
    [["AAMk-2=", "thread-1", "2026-12-02T14:05:00.000Z", ["bea@example.org"], false]],
  );
  // A quote in the conversation id is doubled (OData), no thread or date asks nothing, an error is the provider's.
  const quoted = scripted(json(200, { value: [] }));
  await new GraphProvider("state", "u-1", { token: "tok", apiBase: "https://graph.test/v1.0", transport: quoted.transport }).since(facts({ threadId: "a'b", receivedAt: CLAIMED }));
  assert.match(Object.fromEntries(quoted.requests[0]!.params)["$filter"]!, /^conversationId eq 'a''b' and/);
  assert.deepEqual(await graph.since(facts()), []);
  const failing = new GraphProvider("state", "u-1", { token: "tok", apiBase: "https://graph.test/v1.0", transport: scripted(json(503, { error: {} })).transport });
  await assert.rejects(failing.since(facts({ receivedAt: CLAIMED })), ProviderError);
});

test("gmail: since() reads the thread (threads.get, metadata) and keeps its messages after the claim's, a person's reply from Gmail with its SENT label", async () => {
  const at = (iso: string): string => String(Date.parse(iso));
  const gmailMessage = (id: string, when: string, from: string, labels: string[]) => ({
    id,
    threadId: "thread-1",
    labelIds: labels,
    internalDate: at(when),
    payload: { mimeType: "text/plain", headers: [{ name: "From", value: from }, { name: "Subject", value: "Re: Where is my order?" }] },
  });
  const thread = {
    id: "thread-1",
    messages: [
      gmailMessage("AAMk-1=", "2026-12-02T14:03:00Z", "Bea Costa <bea@example.org>", ["INBOX"]),
      gmailMessage("older", "2026-12-02T14:01:00Z", "Bea Costa <bea@example.org>", ["INBOX"]),
      gmailMessage("by-ana", "2026-12-02T14:04:00Z", "Ana <support@shop.example>", ["SENT"]),
      gmailMessage("again", "2026-12-02T14:06:00Z", "Bea Costa <bea@example.org>", ["INBOX", "UNREAD"]),
    ],
  };
  const ok = scripted(json(200, thread));
  const gmail = new GmailProvider("https://agent.example/webhook", "support@shop.example", { token: "tok", apiBase: "https://gmail.test", transport: ok.transport });
  const found = await gmail.since(facts({ receivedAt: CLAIMED }));
  assert.equal(ok.requests[0]!.url, "https://gmail.test/gmail/v1/users/me/threads/thread-1");
  assert.equal(Object.fromEntries(ok.requests[0]!.params)["format"], "metadata");
  assert.ok(ok.requests[0]!.params.some(([name, value]) => name === "metadataHeaders" && value === "Auto-Submitted"));
  assert.deepEqual(
    found.map((f) => [f.messageId, f.folders]),
    [
      ["by-ana", ["SENT"]],
      ["again", ["INBOX", "UNREAD"]],
    ],
  );
  assert.deepEqual(await new GmailProvider("a", "support@shop.example", { token: "t", apiBase: "https://gmail.test", transport: scripted(json(404, {})).transport }).since(facts({ receivedAt: CLAIMED })), []);
  const failing = new GmailProvider("a", "support@shop.example", { token: "t", apiBase: "https://gmail.test", transport: scripted(json(500, {})).transport });
  await assert.rejects(failing.since(facts({ receivedAt: CLAIMED })), ProviderError);
});

test("a person's reply is never marked: the same MIME under a person's claim has no Auto-Submitted; outside any claim, an agent's", () => {
  const gmail = new GmailProvider("https://agent.example/webhook", "support@shop.example", { token: "tok", apiBase: "https://gmail.test" });
  const headerNames = (raw: Buffer): string[] => raw.toString("utf8").split("\r\n\r\n")[0]!.split("\r\n").map((line) => line.slice(0, line.indexOf(":")));
  assert.ok(headerNames(gmail.rawReply(facts(), "Hi", STAMP)).includes("Auto-Submitted"));
  assert.ok(headerNames(sendingAs(false, () => gmail.rawReply(facts(), "Hi", STAMP))).includes("Auto-Submitted"));
  const byPerson = sendingAs(true, () => gmail.rawReply(facts(), "Hi", STAMP));
  assert.ok(!headerNames(byPerson).includes("Auto-Submitted"));
  assert.ok(headerNames(byPerson).includes("In-Reply-To"));
});

test("agentmail and resend: the reply carries the claim's key as Idempotency-Key, the stamp and Auto-Submitted; a 4xx is rejected (FREE), a 409, a 5xx or no answer unknown", async () => {
  const { AgentMailProvider, AgentMailSendOutcomeUnknown, AgentMailSendRejected } = await import("../src/providers/agentmail.js");
  const { ResendProvider, ResendSendOutcomeUnknown, ResendSendRejected, threadOf } = await import("../src/providers/resend.js");
  const secret = "whsec_" + Buffer.from("a secret of 24 bytes....").toString("base64");
  const message = facts({ mailbox: "support@shop.agentmail.to", messageId: "<orig@mail.example>", threadId: threadOf("<orig@mail.example>", undefined, ["<a@x.example>"]) });
  const am = scripted(json(200, { message_id: "<sent@agentmail.to>", thread_id: "thd_1" }));
  const agentmail = new AgentMailProvider(secret, { apiKey: "am_key", apiBase: "https://agentmail.test", transport: am.transport });
  assert.equal(await agentmail.reply(message, { body: "Ships today.", stamp: STAMP }), "<sent@agentmail.to>");
  const sent = am.requests[0]!;
  assert.equal(sent.url, "https://agentmail.test/v0/inboxes/support@shop.agentmail.to/messages/%3Corig%40mail.example%3E/reply");
  assert.deepEqual(sent.headers, [["Authorization", "Bearer am_key"], ["Idempotency-Key", STAMP.key]]);
  assert.deepEqual(sent.json, { text: "Ships today.", headers: { "X-Inbox-Claim": formatStamp(STAMP), "Auto-Submitted": "auto-replied" } });
  const rs = scripted(json(200, { id: "4ef9a417" }));
  const resend = new ResendProvider(secret, "support@shop.example", { apiKey: "re_key", apiBase: "https://resend.test", transport: rs.transport });
  assert.equal(await resend.reply(message, { body: "Ships today.", stamp: STAMP }), "4ef9a417");
  const mail = rs.requests[0]!;
  assert.equal(mail.url, "https://resend.test/emails");
  assert.deepEqual(mail.headers, [["Authorization", "Bearer re_key"], ["Idempotency-Key", STAMP.key]]);
  assert.deepEqual(mail.json, {
    from: "support@shop.example",
    to: ["bea@example.org"],
    subject: "Re: Where is my order?",
    text: "Ships today.",
    headers: { "X-Inbox-Claim": formatStamp(STAMP), "Auto-Submitted": "auto-replied", "In-Reply-To": "<orig@mail.example>", References: "<a@x.example> <orig@mail.example>" },
    tags: [
      { name: "inbox_claim", value: `${STAMP.key}_4711` },
      { name: "inbox_thread", value: message.threadId },
    ],
  });
  const cases: [HttpResponse | Error, new (...args: never[]) => Error, new (...args: never[]) => Error][] = [
    [json(422, { name: "validation_error", message: "Invalid `to` field" }), AgentMailSendRejected, ResendSendRejected],
    [json(409, { name: "invalid_idempotent_request", message: "Same idempotency key used with a different request payload" }), AgentMailSendOutcomeUnknown, ResendSendOutcomeUnknown],
    [json(500, { message: "internal" }), AgentMailSendOutcomeUnknown, ResendSendOutcomeUnknown],
    [new ProviderError("timed out"), AgentMailSendOutcomeUnknown, ResendSendOutcomeUnknown],
  ];
  for (const [answer, agentmailError, resendError] of cases) {
    const a = new AgentMailProvider(secret, { apiKey: "k", transport: scripted(answer).transport });
    await assert.rejects(a.reply(message, { body: "x", stamp: STAMP }), agentmailError);
    const r = new ResendProvider(secret, "support@shop.example", { apiKey: "k", transport: scripted(answer).transport });
    await assert.rejects(r.reply(message, { body: "x", stamp: STAMP }), resendError);
  }
  assert.ok(new ResendSendRejected("x") instanceof SendRejected && new AgentMailSendRejected("x") instanceof SendRejected);
  assert.throws(() => new AgentMailProvider("not base64 !", { apiKey: "k" }), /AGENTMAIL_WEBHOOK_SECRET/);
  assert.throws(() => AgentMailProvider.fromEnv({ AGENTMAIL_API_KEY: "k" }), /set AGENTMAIL_WEBHOOK_SECRET/);
  assert.throws(() => ResendProvider.fromEnv({ RESEND_WEBHOOK_SECRET: secret, RESEND_API_KEY: "k" }), /set RESEND_MAILBOX/);
  assert.throws(() => new ResendProvider(secret, "support", { apiKey: "k" }), /RESEND_FROM/);
});

test("nylas: inside claim.send the adapter's send carries the claim's stamp and Auto-Submitted as custom_headers (a header the reply sets is kept); outside, only an agent's Auto-Submitted", async () => {
  const { buildSendRequest } = await import("../src/providers/nylas.js");
  const { inScope } = await import("../src/sdks.js");
  const reply = { replyToMessageId: "m-1", to: ["bea@example.org"], subject: "Re: x", body: "Ships today." };
  const body = (fields?: Record<string, unknown>) => JSON.parse(buildSendRequest("https://nylas.test", "k", "grant-1", { ...reply, fields }, STAMP.key).body) as Record<string, unknown>;
  const agentsMark = [{ name: "Auto-Submitted", value: "auto-replied" }];
  assert.deepEqual(body()["custom_headers"], agentsMark); // outside any claim the sender is an agent: no stamp
  const inside = inScope("m-1", true, formatStamp(STAMP), () => body());
  assert.deepEqual(inside["custom_headers"], [
    { name: "X-Inbox-Claim", value: formatStamp(STAMP) },
    { name: "Auto-Submitted", value: "auto-replied" },
  ]);
  const kept = inScope("m-1", true, formatStamp(STAMP), () => body({ custom_headers: [{ name: "auto-submitted", value: "auto-generated" }] }));
  assert.deepEqual(kept["custom_headers"], [
    { name: "auto-submitted", value: "auto-generated" },
    { name: "X-Inbox-Claim", value: formatStamp(STAMP) },
  ]);
  assert.deepEqual(inScope("m-1", false, "", () => body())["custom_headers"], agentsMark); // in the work, outside claim.send: no stamp
});
