// Traces (docs/node.md#traces): with OpenTelemetry set up in the agent, every call is a CLIENT span under the
// agent's active span, and carries its trace context to a real coordinator (exporting its own spans over OTLP),
// whose spans and the store's beneath them join the same trace. Every span is received by a real OTLP receiver
// (coordinator/testing/otlp.py, run as `python -m coordinator.testing.otlp`), the agent's over OTLP/HTTP.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn, type ChildProcessWithoutNullStreams } from "node:child_process";
import { createInterface } from "node:readline";
import { createServer, type Server } from "node:http";
import { context, SpanKind, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { resourceFromAttributes } from "@opentelemetry/resources";
import { BasicTracerProvider, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";
import { Cluster, freePort, PYTHON, REPO } from "../src/testing.js";
import { messageSubject, nylasWebhookListener, signNylas, type Coordinator } from "../src/index.js";
import { Nylas, replyTo } from "../src/nylas.js";

interface Span {
  service: string;
  events: [string, Record<string, unknown>][];
  start_ns: number;
  end_ns: number;
  trace_id: string;
  span_id: string;
  parent_span_id: string;
  name: string;
  kind: string;
  attributes: Record<string, unknown>;
  links: [string, string][];
}

let receiver: ChildProcessWithoutNullStreams;
const spans: Span[] = [];
let arrived: () => void = () => {};
let cluster: Cluster;
let provider: BasicTracerProvider;
let coord: Coordinator;

before(async () => {
  receiver = spawn(PYTHON, ["-m", "coordinator.testing.otlp"], { cwd: REPO });
  const lines = createInterface({ input: receiver.stdout });
  const endpoints = await new Promise<[string, string]>((resolve, reject) => {
    receiver.once("exit", (code) => reject(new Error(`the OTLP receiver exited (${code})`)));
    lines.on("line", (line) => {
      if (line.startsWith("otlp ")) {
        const [, http, grpc] = line.split(" ");
        resolve([http!, grpc!]);
        return;
      }
      spans.push(JSON.parse(line) as Span);
      arrived();
    });
  });
  const [http, grpc] = endpoints;
  cluster = await Cluster.start({
    replicas: 1,
    env: { OTEL_EXPORTER_OTLP_ENDPOINT: grpc, OTEL_EXPORTER_OTLP_PROTOCOL: "grpc", OTEL_BSP_SCHEDULE_DELAY: "50", OTEL_SERVICE_NAME: "coordinator-under-test" },
  });
  context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  provider = new BasicTracerProvider({
    resource: resourceFromAttributes({ "service.name": "node-agent" }),
    spanProcessors: [new SimpleSpanProcessor(new OTLPTraceExporter({ url: `${http}/v1/traces` }))],
  });
  trace.setGlobalTracerProvider(provider);
  coord = cluster.client("agent-1");
});

after(async () => {
  await provider?.shutdown();
  trace.disable();
  context.disable();
  await cluster?.stop();
  receiver?.stdin.end();
  receiver?.kill();
});

/** Every span received, once `enough` says they are. */
async function waitFor(enough: (received: Span[]) => boolean, withinMs = 30_000): Promise<Span[]> {
  const deadline = Date.now() + withinMs;
  while (!enough(spans)) {
    if (Date.now() > deadline) throw new Error(`the spans awaited never came: ${[...new Set(spans.map((s) => `${s.service}: ${s.name}`))].join(", ")}`);
    await new Promise<void>((resolve) => {
      arrived = resolve;
      setTimeout(resolve, 200);
    });
  }
  return [...spans];
}

function under(all: Span[], parent: Span): Span[] {
  const found: Span[] = [];
  let frontier = [parent.span_id];
  while (frontier.length > 0) {
    const children = all.filter((span) => frontier.includes(span.parent_span_id));
    found.push(...children);
    frontier = children.map((span) => span.span_id);
  }
  return found;
}

/** Each call: the agent's CLIENT span under its root, the coordinator's SERVER span beneath, the store's beneath that. */
function assertCallTrace(all: Span[], traceId: string, methods: string[]): void {
  const mine = all.filter((span) => span.trace_id === traceId);
  const roots = mine.filter((span) => !span.parent_span_id);
  assert.equal(roots.length, 1);
  assert.equal(roots[0]!.service, "node-agent");
  const clients = mine.filter((span) => span.kind === "CLIENT" && span.service === "node-agent");
  assert.deepEqual(clients.map((span) => span.name.split("/")[1]).sort(), [...methods].sort());
  for (const client of clients) {
    assert.equal(client.parent_span_id, roots[0]!.span_id);
    assert.equal(client.attributes["inbox.mailbox"], "traces@shop.example");
    const servers = mine.filter((span) => span.kind === "SERVER" && span.parent_span_id === client.span_id);
    assert.equal(servers.length, 1, `${client.name} has no coordinator span beneath it`);
    const server = servers[0]!;
    assert.equal(server.service, "coordinator-under-test");
    assert.equal(server.name, client.name);
    assert.equal(server.attributes["inbox.request_id"], client.attributes["inbox.request_id"]);
    assert.equal(server.attributes["inbox.result"], client.attributes["inbox.result"]);
    const transactions = under(all, server).filter((span) => span.name === "etcd transaction");
    assert.ok(transactions.length > 0, `${server.name} has no etcd transaction beneath it`);
    for (const transaction of transactions) {
      const carriers = [transaction, ...all.filter((span) => transaction.links.some(([, id]) => id === span.span_id))];
      assert.ok(carriers.some((carrier) => under(all, carrier).some((span) => span.name === "etcd Txn")), "no etcd Txn carried the transaction");
    }
  }
}

const tracer = () => trace.getTracer("node-agent");
const traceIdOf = (): string => trace.getActiveSpan()!.spanContext().traceId;
const callsArrived = (traceId: string, calls: number) => (received: Span[]) => {
  const mine = received.filter((span) => span.trace_id === traceId);
  const ids = new Set(received.map((span) => span.span_id));
  const linked = mine.flatMap((span) => span.links.map(([, id]) => id));
  return (
    mine.some((span) => !span.parent_span_id) &&
    mine.filter((span) => span.kind === "CLIENT" && span.service === "node-agent").length >= calls &&
    mine.filter((span) => span.kind === "SERVER").length >= calls &&
    mine.filter((span) => span.name === "etcd transaction").length >= calls &&
    linked.every((id) => ids.has(id))
  );
};

test("a claim, BeginSend and ConfirmSent from the Node client join the agent's trace down to etcd", async () => {
  const traceId = await tracer().startActiveSpan("answer notification", async (root) => {
    const subject = messageSubject("traces@shop.example", `node-${Date.now()}`);
    const claimed = await coord.claim(subject, { ttl: 30 });
    assert.equal(claimed.outcome, "GRANTED");
    assert.ok((await coord.beginSend(subject, claimed.status!.fencingToken)).ok);
    assert.ok((await coord.confirmSent(subject, claimed.status!.fencingToken, "sent-1")).ok);
    const id = traceIdOf();
    root.end();
    return id;
  });
  assertCallTrace(await waitFor(callsArrived(traceId, 3)), traceId, ["ClaimReply", "BeginSend", "ConfirmSent"]);
});

test("concurrent claims share Batch RPCs and each keeps its own trace", async () => {
  const ids = await Promise.all(
    Array.from({ length: 8 }, (_, index) =>
      tracer().startActiveSpan(`answer notification ${index}`, async (root) => {
        const claimed = await coord.claim(messageSubject("traces@shop.example", `node-batched-${index}-${Date.now()}`), { ttl: 30 });
        assert.equal(claimed.outcome, "GRANTED");
        const id = traceIdOf();
        root.end();
        return id;
      }),
    ),
  );
  let received: Span[] = [];
  for (const traceId of ids) received = await waitFor(callsArrived(traceId, 1));
  for (const traceId of ids) assertCallTrace(received, traceId, ["ClaimReply"]);
  assert.ok(received.some((span) => ids.includes(span.trace_id) && span.attributes["inbox.batched"] === true), "the concurrent claims were never batched");
});

// -- the guard's spans ---------------------------------------------------------------------------------------------

const SECRET = "webhook-secret-node-5e1f";
const API_KEY = "nyk_v0_node-api-key-77ab";
const SUBJECT_LINE = "Where is my parcel 9902?";
const SENDER = "erin.customer@example.org";

async function listen(server: Server): Promise<string> {
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("no port");
  return `http://127.0.0.1:${address.port}`;
}

/** Nylas's send endpoint as Nylas documents it (POST /v3/grants/{grant_id}/messages/send: 200, data.id), keeping each send's traceparent. */
function nylasSendApi(sends: { path: string; traceparent: string }[]): Server {
  return createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      sends.push({ path: req.url ?? "", traceparent: String(req.headers["traceparent"] ?? "") });
      res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ request_id: "req-1", data: { id: `sent-${sends.length}`, object: "message" } }));
    });
  });
}

test("a guarded reply through the Nylas webhook listener is one trace: notification, reply, the user's span, the calls, the send, the coordinator, etcd (gRPC)", async () => {
  await assertGuardedReplyTrace(coord, "grpc");
});

test("the same over the coordinator's HTTP/JSON face (protocol: http-json)", async () => {
  const httpPort = await freePort();
  await cluster.addReplica(undefined, [`--http-listen=127.0.0.1:${httpPort}`]);
  const overHttp = cluster.client("agent-1", { target: `127.0.0.1:${httpPort}`, protocol: "http-json" });
  await assertGuardedReplyTrace(overHttp, "connect_rpc");
});

async function assertGuardedReplyTrace(coord: Coordinator, rpcSystem: string): Promise<void> {
  const mailbox = "node-guard-traces@shop.example";
  const messageId = `node-guard-${rpcSystem}-${Date.now()}`;
  const sends: { path: string; traceparent: string }[] = [];
  const api = nylasSendApi(sends);
  const nylas = new Nylas(API_KEY, { apiBase: await listen(api) });
  const listener = nylasWebhookListener({
    secret: SECRET,
    coordinator: coord,
    ttl: 5,
    work: async (notification, claim) => {
      await tracer().startActiveSpan("draft reply", async (span) => {
        await new Promise((resolve) => setTimeout(resolve, 2_200)); // past a third of the 5 s TTL: one renewal
        span.end();
      });
      await claim.send((key) => nylas.send(mailbox, replyTo(notification, { body: "It ships today." }), { idempotencyKey: key }));
    },
  });
  let traceId = "";
  // A web framework's span around each request, as an HTTP instrumentation makes it.
  const server = createServer((req, res) =>
    tracer().startActiveSpan("POST /webhooks/nylas", { kind: SpanKind.SERVER }, (span) => {
      traceId = span.spanContext().traceId;
      res.on("finish", () => span.end());
      listener(req, res);
    }),
  );
  const url = await listen(server);
  try {
    const body = Buffer.from(
      JSON.stringify({
        specversion: "1.0",
        type: "message.created",
        source: "/google/emails/realtime",
        id: `notif-${messageId}`,
        time: 1723821985,
        data: {
          application_id: "app-1",
          object: { id: messageId, grant_id: mailbox, thread_id: `thread-${messageId}`, object: "message", subject: SUBJECT_LINE, from: [{ name: "Erin", email: SENDER }], date: 1723821980 },
        },
      }),
    );
    const answer = await fetch(`${url}/webhooks/nylas`, { method: "POST", body, headers: { "content-type": "application/json", "x-nylas-signature": signNylas(body, SECRET) } });
    assert.equal(answer.status, 200);
    await listener.drain();
  } finally {
    server.close();
    api.close();
  }
  const calls = ["ClaimReply", "RenewClaim", "BeginSend", "ConfirmSent"];
  const all = await waitFor((received) => {
    const mine = received.filter((span) => span.trace_id === traceId);
    return mine.filter((span) => span.kind === "SERVER" && span.service === "coordinator-under-test").length >= calls.length && mine.some((span) => span.name === "POST /webhooks/nylas");
  });
  const mine = all.filter((span) => span.trace_id === traceId);
  const one = (name: string, parent: Span): Span => {
    const found = mine.filter((span) => span.name === name && span.parent_span_id === parent.span_id);
    assert.equal(found.length, 1, `${found.length} spans ${name} beneath ${parent.name}: ${mine.map((span) => span.name).join(", ")}`);
    return found[0]!;
  };
  const roots = mine.filter((span) => !span.parent_span_id);
  assert.deepEqual(roots.map((span) => span.name), ["POST /webhooks/nylas"]);
  const notification = one("inbox notification", roots[0]!);
  assert.equal(notification.attributes["inbox.provider"], "nylas");
  assert.equal(notification.attributes["inbox.outcome"], "acknowledged");
  assert.equal(notification.attributes["http.response.status_code"], 200);
  assert.deepEqual(notification.events.map(([name]) => name), ["verified", "recorded"]);
  const reply = one("inbox reply", notification);
  assert.equal(reply.attributes["inbox.mailbox"], mailbox);
  assert.equal(reply.attributes["inbox.subject.kind"], "message");
  assert.equal(reply.attributes["inbox.subject.id"], messageId);
  assert.equal(reply.attributes["inbox.notification_id"], `notif-${messageId}`);
  assert.equal(reply.attributes["inbox.outcome"], "replied");
  assert.ok(Number(reply.attributes["inbox.fencing_token"]) > 0);
  assert.deepEqual(reply.events.map(([name]) => name), ["renewed"]);
  one("draft reply", reply);
  const send = one("inbox send", reply);
  assert.equal(sends.length, 1);
  assert.deepEqual(sends[0]!.traceparent.split("-").slice(1, 3), [traceId, send.span_id]);
  const clients = mine.filter((span) => span.kind === "CLIENT" && span.service === "node-agent");
  assert.deepEqual(clients.map((span) => span.name.split("/")[1]).sort(), [...calls].sort());
  for (const client of clients) {
    assert.equal(client.parent_span_id, reply.span_id);
    const server = one(client.name, client);
    assert.equal(server.service, "coordinator-under-test");
    assert.equal(server.attributes["rpc.system"], rpcSystem);
    assert.ok(under(all, server).some((span) => span.name === "etcd transaction"), `${server.name} has no etcd transaction beneath it`);
  }
  // No summary, webhook secret or API key in any attribute or event of the trace; the fencing token only as itself.
  const texts = (values: Record<string, unknown>) => Object.values(values).flatMap((value) => (Array.isArray(value) ? value : [value])).filter((value) => typeof value === "string");
  for (const span of mine) {
    for (const text of [...texts(span.attributes), ...span.events.flatMap(([, attributes]) => texts(attributes))]) {
      for (const secret of [SECRET, API_KEY, SUBJECT_LINE, SENDER]) assert.ok(!text.includes(secret), `${span.name} carries ${text}`);
    }
  }
}

test("a receiver stopped mid-run fails no reply: the guarded reply is sent and recorded", async () => {
  const subject = messageSubject("node-guard-traces@shop.example", `node-stopped-${Date.now()}`);
  await coord.replyTo({ mailbox: subject.mailbox, messageId: subject.id }, { ttl: 30 }, async (claim) => claim.send(() => "sent-before"));
  receiver.kill(); // the agent's exporter and the coordinator's now send to a port nothing listens on
  await new Promise((resolve) => (receiver.exitCode !== null ? resolve(undefined) : receiver.once("exit", resolve)));
  for (const id of ["a", "b", "c"]) {
    const after = messageSubject(subject.mailbox, `${subject.id}-${id}`);
    const sent = await tracer().startActiveSpan(`answer ${id}`, async (span) => {
      try {
        return await coord.replyTo({ mailbox: after.mailbox, messageId: after.id }, { ttl: 30 }, async (claim) => {
          const id = await claim.send(() => `sent-${after.id}`);
          assert.ok(claim.replied);
          return id;
        });
      } finally {
        span.end();
      }
    });
    assert.equal(sent, `sent-${after.id}`);
    const status = await coord.status(after);
    assert.equal(status.state, "REPLIED");
  }
});
