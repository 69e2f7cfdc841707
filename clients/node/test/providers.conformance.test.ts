// The provider seam's vectors (conformance/providers/<name>/cases.json, docs/conformance.md): every case of every
// provider, run against this client's provider with the case's API answers and cursor answers, no network and no
// coordinator. The Python client's tests run the same files (tests/client/test_provider_conformance.py); neither
// asks the other for an expected value. Beside them, the cursors a delivery took (RangesTaken), as the Python file tests them.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { REPO } from "../src/testing.js";
import { OutgoingRules } from "../src/outgoing.js";
import { PROVIDERS } from "../src/providers/index.js";
import { Accepted, ProviderError, RangesTaken, type CursorRange, type Cursors, type HttpRequest, type HttpResponse, type MessageFacts, type Provider } from "../src/providers/seam.js";

const ROOT = join(REPO, "conformance", "providers");
const NAMES = readdirSync(ROOT, { withFileTypes: true }).filter((entry) => entry.isDirectory()).map((entry) => entry.name).sort();
type Json = Record<string, unknown>;
interface ApiCall { method: string; url: string; query?: Record<string, string | string[]>; json?: Json; status: number; body: unknown }

/** Answers the provider's requests from the case's `api` list, in order; anything else fails the case. */
function fakeApi(calls: ApiCall[]): { transport: (request: HttpRequest) => Promise<HttpResponse>; left: ApiCall[] } {
  const left = [...calls];
  const transport = async (request: HttpRequest): Promise<HttpResponse> => {
    const expected = left.shift();
    assert.ok(expected, `the provider asked for ${request.method} ${request.url}, which the case does not list`);
    assert.deepEqual([request.method, request.url], [expected.method, expected.url]);
    for (const [name, value] of Object.entries(expected.query ?? {})) {
      const given = request.params.filter(([key]) => key === name).map(([, v]) => v);
      assert.deepEqual(given, Array.isArray(value) ? value : [value], name);
    }
    for (const [name, value] of Object.entries(expected.json ?? {})) {
      assert.ok(typeof request.json === "object" && request.json !== null, name);
      assert.deepEqual((request.json as Json)[name], value, name);
    }
    return { status: expected.status, body: Buffer.from(JSON.stringify(expected.body)) };
  };
  return { transport, left };
}

/** Answers TakeCursorRange from the case's `cursors` and records the advances. */
class FakeCursors implements Cursors {
  readonly advanced: Record<string, { value: string; position: number }> = {};
  constructor(private readonly answers: Record<string, { outcome: CursorRange["outcome"]; value?: string; position?: number }>) {}

  async take(_mailbox: string, name: string): Promise<CursorRange> {
    const answer = this.answers[name];
    assert.ok(answer, `the provider took the cursor ${name}, which the case does not answer`);
    return { outcome: answer.outcome, value: answer.value ?? "", position: BigInt(answer.position ?? 0), token: 7n, holder: "", expiresInMs: 0 };
  }

  async advance(_mailbox: string, name: string, _taken: CursorRange, value: string, position: bigint): Promise<boolean> {
    this.advanced[name] = { value, position: Number(position) };
    return true;
  }
}

function factsJson(facts: MessageFacts): Json {
  return {
    event: facts.event,
    mailbox: facts.mailbox,
    dedup_key: facts.dedupKey,
    message_id: facts.messageId,
    thread_id: facts.threadId ?? null,
    received_at: facts.receivedAt === undefined ? null : Math.floor(facts.receivedAt.getTime() / 1000),
    sender: facts.sender,
    subject_line: facts.subjectLine,
    from_addresses: [...facts.fromAddresses],
    folders: [...facts.folders],
    outgoing: facts.outgoing === undefined ? null : { rule: facts.outgoing.rule, value: facts.outgoing.value },
    // The rule and value that make it automated mail (src/automated.ts), or null: an agent may answer it.
    automated: facts.automated?.automated ? facts.automated.why : null,
    stamp: facts.stamp === undefined ? null : { key: facts.stamp.key, token: Number(facts.stamp.token) },
    reply: {
      to: [...facts.reply.to],
      subject: facts.reply.subject,
      internet_message_id: facts.reply.internetMessageId ?? null,
      references: [...facts.reply.references],
    },
  };
}

function requestOf(spec: { method: string; query: string; headers: Record<string, string>; body?: unknown; body_text?: string }): { method: string; query: string; headers: Record<string, string>; body: Buffer } {
  // The body's bytes: its JSON text with no spaces after separators (JSON.stringify's), or body_text exactly.
  const body = spec.body_text !== undefined ? Buffer.from(spec.body_text) : Buffer.from(JSON.stringify(spec.body));
  return { method: spec.method, query: spec.query, headers: spec.headers, body };
}

async function runCase(name: string, vector: Json, defaults: Json): Promise<void> {
  const settings = { ...defaults, ...((vector.settings as Json | undefined) ?? {}) };
  const api = fakeApi(vector.api as ApiCall[]);
  const now = (vector.now as number | undefined) ?? 1796220300;
  const provider: Provider = PROVIDERS[name]!.fromSettings(settings, { transport: api.transport, clock: () => now });
  let verdict = await provider.check(requestOf(vector.request as never));
  const facts: Json[] = [];
  const cursors = new FakeCursors((vector.cursors as never) ?? {});
  if (verdict instanceof Accepted) {
    const batch = await provider.open(verdict, cursors);
    const rules = new OutgoingRules(settings.sent_folders as string[], settings.mailbox_addresses as string[]);
    for (const found of batch.facts) {
      const outgoing = rules.judge(found.folders, found.fromAddresses, provider.mailboxAddresses);
      facts.push(factsJson({ ...found, outgoing }));
    }
    await batch.commit();
    assert.deepEqual([...batch.actions], vector.actions);
    verdict = provider.acknowledge();
  } else {
    assert.deepEqual(vector.actions, []);
  }
  const expected = vector.answer as { status: number; body: string | null };
  assert.equal(verdict.status, expected.status, verdict.body);
  if (expected.body !== null) assert.equal(verdict.body, expected.body);
  assert.deepEqual(facts, vector.facts);
  assert.deepEqual(cursors.advanced, vector.advance);
  assert.deepEqual(api.left, [], "calls the case lists that the provider never made");
}

test("every provider folder of conformance/providers has a provider here, and every provider a folder", () => {
  assert.deepEqual(Object.keys(PROVIDERS).sort(), NAMES);
});

for (const name of NAMES) {
  const { about, settings, cases } = JSON.parse(readFileSync(join(ROOT, name, "cases.json"), "utf8")) as { about: string; settings: Json; cases: (Json & { name: string })[] };
  test(`conformance/providers/${name} says what its vectors mean, and names each case once`, () => {
    assert.ok(about.length > 200);
    assert.equal(new Set(cases.map((c) => c.name)).size, cases.length);
  });
  for (const vector of cases) {
    test(`conformance/providers/${name}: ${vector.name}`, async () => {
      // Every field must be read by the check: a field nothing reads would be a claim nothing tests.
      const read = new Set(["name"]);
      const seen = new Proxy(vector, {
        get(target, key, receiver) {
          if (typeof key === "string") read.add(key);
          return Reflect.get(target, key, receiver);
        },
      });
      await runCase(name, seen, settings);
      assert.deepEqual(Object.keys(vector).filter((key) => !read.has(key)), [], "fields no check read");
    });
  }
}

test("a failed delivery gives back only the ranges it took and did not advance, once; a range taken after that is given back at once", async () => {
  const inner = new FakeCursors({
    "graph-delta:inbox": { outcome: "TAKEN", value: "link-1", position: 3 },
    "graph-delta:sentitems": { outcome: "TAKEN", value: "link-2", position: 2 },
    "gmail-history": { outcome: "COVERED" },
  });
  let advances = 0;
  const ranges = new RangesTaken({
    take: (mailbox, name) => inner.take(mailbox, name),
    advance: (...args) => (advances++, inner.advance(...args)),
  });
  const inbox = await ranges.take("box", "graph-delta:inbox", 0n, 60);
  await ranges.take("box", "graph-delta:sentitems", 0n, 60);
  await ranges.take("box", "gmail-history", 9n, 60); // covered: nothing taken, nothing to give back
  await ranges.advance("box", "graph-delta:inbox", inbox, "link-3", 4n); // this one was committed
  await ranges.giveBack();
  assert.deepEqual(inner.advanced, {
    "graph-delta:inbox": { value: "link-3", position: 4 },
    "graph-delta:sentitems": { value: "link-2", position: 2 }, // given back at its start
  });
  assert.equal(advances, 2);
  await ranges.giveBack(); // nothing is given back twice
  // The provider's open() runs on past the delivery's time bound (a promise is not cancelled): it takes nothing more.
  await assert.rejects(ranges.take("box", "graph-delta:inbox", 0n, 60), ProviderError);
  assert.equal(advances, 2);
  // A range whose take was in flight when the delivery failed is given back as it is taken, and open() goes no further.
  const other = new FakeCursors({ "gmail-history": { outcome: "TAKEN", value: "41", position: 41 } });
  const late = new RangesTaken(other);
  const pending = late.take("box", "gmail-history", 42n, 60);
  await late.giveBack();
  await assert.rejects(pending, ProviderError);
  assert.deepEqual(other.advanced, { "gmail-history": { value: "41", position: 41 } });
});
