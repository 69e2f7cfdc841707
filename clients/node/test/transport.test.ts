// Retries (UNAVAILABLE, the retry-after-ms hint), bearer tokens, and TLS / mutual TLS against real coordinators.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { Cluster, PICK_FLOOR, freePort } from "../src/testing.js";
import { Coordinator, CoordinatorError, CoordinatorUnavailable, QuotaExceeded, Unauthenticated, PermissionDenied, messageSubject, type WatchItem } from "../src/index.js";

let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ replicas: 0 });
});
after(async () => {
  await cluster?.stop();
});

test("freePort: distinct ports outside the kernel's ephemeral range, so nothing takes one while its server restarts", async () => {
  const [low, high] = readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/).map(Number) as [number, number];
  const ports: number[] = [];
  for (let i = 0; i < 300; i++) ports.push(await freePort());
  assert.equal(new Set(ports).size, ports.length);
  const inside = ports.filter((port) => port < PICK_FLOOR || (port >= low && port <= high));
  assert.deepEqual(inside, []);
});

test("UNAVAILABLE is retried with backoff until the coordinator is up; with no retries it is CoordinatorUnavailable", async () => {
  const listen = `127.0.0.1:${await freePort()}`;
  const impatient = new Coordinator({ target: listen, principal: "a", retry: { attempts: 1 } });
  await assert.rejects(impatient.status(messageSubject("m", "x")), (e: unknown) => e instanceof CoordinatorUnavailable && e.code === "UNAVAILABLE");
  impatient.close();
  const patient = cluster.client("agent-late", { target: listen, retry: { attempts: 40, initialBackoffMs: 100, maxBackoffMs: 500 } });
  const claimed = patient.claim(messageSubject("late", "m"), { ttl: 30 });
  await sleep(300);
  await cluster.addReplica(listen);
  assert.equal((await claimed).outcome, "GRANTED");
});

test("RESOURCE_EXHAUSTED with a retry-after-ms hint is retried after the hint; without retries it is QuotaExceeded", async () => {
  const listen = await cluster.addReplica(undefined, ["--rate-limit", "5", "--rate-burst", "5"]);
  const strict = cluster.client("agent-rate", { target: listen, maxBatch: 1, retry: { attempts: 1 } });
  const results = await Promise.allSettled(Array.from({ length: 12 }, (_, i) => strict.status(messageSubject("rate", `m${i}`))));
  const refused = results.filter((r): r is PromiseRejectedResult => r.status === "rejected").map((r) => r.reason as QuotaExceeded);
  assert.ok(refused.length > 0);
  for (const error of refused) {
    assert.ok(error instanceof QuotaExceeded);
    assert.ok(error.retryAfterMs !== undefined && error.retryAfterMs > 0, `hint ${error.retryAfterMs}`);
  }
  const patient = cluster.client("agent-rate-2", { target: listen, maxBatch: 1, retry: { attempts: 30 } });
  const all = await Promise.all(Array.from({ length: 12 }, (_, i) => patient.status(messageSubject("rate", `m${i}`))));
  assert.equal(all.length, 12);
});

/** A replica that authenticates by bearer token only (a token file with `tokens`), and the tokens' secrets by id. */
async function tokenReplica(...tokens: string[][]): Promise<{ listen: string; secrets: Record<string, string> }> {
  const secrets: Record<string, string> = {};
  let file = "";
  for (const flags of tokens) {
    const made = execFileSync(join(cluster.coordinatorBin), ["token", "new", ...flags], { encoding: "utf8" });
    secrets[flags[flags.indexOf("--id") + 1]!] = /^# (ict_\S+)$/m.exec(made)![1]!;
    file += made.replace(/^#.*$/gm, "");
  }
  const dir = mkdtempSync(join(tmpdir(), "inbox-claims-token-"));
  writeFileSync(join(dir, "tokens.toml"), file);
  return { listen: await cluster.addReplica(undefined, ["--token-file", join(dir, "tokens.toml")]), secrets };
}

const PATIENT = { attempts: 30, maxBackoffMs: 300 };

test("a bearer token authenticates; a wrong one is Unauthenticated; a mailbox not granted is PermissionDenied", async () => {
  const { listen, secrets } = await tokenReplica(["--id", "token-agent", "--mailbox", "tok-*"]);
  const good = cluster.client(undefined, { target: listen, token: secrets["token-agent"]!, retry: PATIENT });
  const granted = await good.claim(messageSubject("tok-1", "m"), { ttl: 30 });
  assert.equal(granted.outcome, "GRANTED");
  assert.equal(granted.status?.holder, "token-agent");
  await assert.rejects(good.claim(messageSubject("other", "m")), PermissionDenied);
  const bad = cluster.client(undefined, { target: listen, token: "ict_not-a-real-token" });
  await assert.rejects(bad.claim(messageSubject("tok-1", "m2")), Unauthenticated);
});

test("caller(): a token's principal, kind, roles and mailboxes; in development mode the name given, with every right", async () => {
  const { listen, secrets } = await tokenReplica(
    ["--id", "ana@example.com", "--kind", "human", "--mailbox", "support-*", "--mailbox", "billing", "--role", "takeover", "--role", "resolve"],
    ["--id", "ops", "--role", "admin"],
  );
  const ana = cluster.client(undefined, { target: listen, token: secrets["ana@example.com"]!, retry: PATIENT });
  assert.deepEqual(await ana.caller(), {
    principal: "ana@example.com",
    kind: "human",
    roles: ["resolve", "takeover"],
    mailboxes: ["support-*", "billing"],
    developmentMode: false,
  });
  const ops = cluster.client(undefined, { target: listen, token: secrets["ops"]!, retry: PATIENT });
  assert.deepEqual(await ops.caller(), { principal: "ops", kind: "agent", roles: ["admin", "report", "resolve", "takeover"], mailboxes: ["*"], developmentMode: false });
  const stranger = cluster.client(undefined, { target: listen, token: "ict_not-a-real-token" });
  await assert.rejects(stranger.caller(), Unauthenticated);
  const dev = cluster.client("bo", { kind: "human", target: await cluster.addReplica() });
  assert.deepEqual(await dev.caller(), { principal: "bo", kind: "human", roles: ["admin", "report", "resolve", "takeover"], mailboxes: ["*"], developmentMode: true });
});

test("watch resumes after a coordinator restart with the events it missed, and no new snapshot", async () => {
  const mailbox = `resume-${process.pid}`;
  const restarted = await cluster.addReplica();
  const index = cluster.targets.indexOf(restarted);
  const watcher = cluster.client("ana", { kind: "human", target: restarted, retry: { attempts: 60, initialBackoffMs: 100, maxBackoffMs: 300 } });
  const other = cluster.client("agent-b", { target: await cluster.addReplica() });
  const stream = watcher.watch(mailbox);
  try {
    const snapshot = (await stream.next()).value as WatchItem;
    assert.equal(snapshot.kind, "snapshot");
    await watcher.claim(messageSubject(mailbox, "msg-1"), { ttl: 30 });
    const event = (await stream.next()).value as WatchItem;
    assert.ok(event.kind === "event" && event.status.subject.id === "msg-1", JSON.stringify(event, (_, v: unknown) => (typeof v === "bigint" ? String(v) : v)));

    await cluster.stopReplica(index); // the stream ends with UNAVAILABLE; the client keeps trying
    let settled = false;
    const pending = stream.next().finally(() => (settled = true));
    // What happens while it is away, through another replica: it must not be missed.
    await other.claim(messageSubject(mailbox, "msg-2"), { ttl: 30 });
    await sleep(500);
    assert.equal(settled, false);
    await cluster.startReplica(index);
    const resumed = (await pending).value as WatchItem;
    assert.equal(resumed.kind, "event", "resumed after the last event: no snapshot"); // a snapshot would list msg-1 and msg-2
    assert.equal(resumed.status.subject.id, "msg-2");
    assert.equal(resumed.status.holder, "agent-b");
    assert.ok(resumed.revision > event.revision);
  } finally {
    await stream.return(undefined);
  }
});

function openssl(dir: string, ...args: string[]): void {
  execFileSync("openssl", args, { cwd: dir, stdio: "ignore" });
}

test("TLS with a private CA, and mutual TLS: a client without its certificate is refused", async () => {
  const dir = mkdtempSync(join(tmpdir(), "inbox-claims-tls-"));
  openssl(dir, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem");
  for (const [name, san] of [["server", "subjectAltName=IP:127.0.0.1"], ["client", "subjectAltName=DNS:agent-tls"]] as const) {
    openssl(dir, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", `/CN=${name === "server" ? "127.0.0.1" : "agent-tls"}`, "-keyout", `${name}.key`, "-out", `${name}.csr`);
    writeFileSync(join(dir, `${name}.ext`), `${san}\n`);
    openssl(dir, "x509", "-req", "-in", `${name}.csr`, "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile", `${name}.ext`, "-out", `${name}.pem`);
  }
  const read = (name: string): Buffer => readFileSync(join(dir, name));
  const listen = await cluster.addReplica(undefined, [
    "--tls-cert", join(dir, "server.pem"), "--tls-key", join(dir, "server.key"),
    "--tls-client-ca", join(dir, "ca.pem"), "--require-client-cert",
  ]);
  const retry = { attempts: 40, initialBackoffMs: 100, maxBackoffMs: 300 };
  const mutual = cluster.client("agent-tls", { target: listen, rootCertificates: read("ca.pem"), clientCertificate: read("client.pem"), clientKey: read("client.key"), retry });
  assert.equal((await mutual.claim(messageSubject("tls", "m"), { ttl: 30 })).outcome, "GRANTED");
  const anonymous = cluster.client("agent-tls", { target: listen, rootCertificates: read("ca.pem"), retry: { attempts: 1 } });
  await assert.rejects(anonymous.claim(messageSubject("tls", "m2")), CoordinatorError); // the handshake is refused
  const plaintext = cluster.client("agent-tls", { target: listen, retry: { attempts: 1 } });
  await assert.rejects(plaintext.claim(messageSubject("tls", "m3")));
});

test("protocol is grpc or http-json; anything else is refused, naming both", () => {
  assert.throws(() => new Coordinator({ principal: "agent-1", protocol: "h3" as never }), /protocol must be "grpc" or "http-json", not "h3"/);
  for (const protocol of ["grpc", "http-json"] as const) new Coordinator({ principal: "agent-1", protocol }).close();
});
