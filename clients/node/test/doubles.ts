// The provider doubles of the repository (tests/providers/fake_graph.py, fake_gmail.py: they follow the providers'
// documented behaviour, never our code), each run as a process by test/doubles.py and driven over HTTP, and what the
// provider scenario tests share: the webhook endpoint on node:http, waiting for background work, the unguarded agent.
import { spawn, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { setTimeout as sleep } from "node:timers/promises";
import { PYTHON, REPO } from "../src/testing.js";
import { Accepted, type ClaimStamp, type CursorRange, type Cursors, type MessageFacts, type Provider } from "../src/providers/seam.js";
import { providerWebhookListener, type WebhookHandler } from "../src/middleware.js";
import type { Coordinator } from "../src/client.js";

/** A provider that sends a reply stamped from the claim (Graph, Gmail). */
export interface Replier extends Provider {
  reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp }): Promise<string | undefined>;
}

export class Double {
  private constructor(
    private readonly child: ChildProcess,
    /** The double's base URL: what the provider's apiBase (and Gmail's JWKS URL) point at. */
    readonly url: string,
  ) {}

  /** Starts `graph`, `gmail` or `nylas` with its settings (the double's keyword arguments); resolves once it listens. */
  static async start(name: "graph" | "gmail" | "nylas", settings: Record<string, unknown> = {}): Promise<Double> {
    const child = spawn(PYTHON, [join(REPO, "clients", "node", "test", "doubles.py"), name, JSON.stringify(settings)], { stdio: ["pipe", "pipe", "inherit"] });
    const lines = createInterface({ input: child.stdout! });
    const url = await new Promise<string>((ok, fail) => {
      child.once("exit", (code) => fail(new Error(`the ${name} double exited with ${code}`)));
      lines.once("line", (line) => ok(line.replace("listening on ", "")));
    });
    return new Double(child, url);
  }

  private async order(order: Record<string, unknown>): Promise<unknown> {
    const response = await fetch(`${this.url}/_double`, { method: "POST", body: JSON.stringify(order), headers: { "content-type": "application/json" } });
    if (!response.ok) throw new Error(`the double answered ${response.status} to ${JSON.stringify(order)}`);
    return response.json();
  }

  /** Calls one of the double's methods, as a Python test does. */
  call<T = Record<string, unknown>>(method: string, ...args: unknown[]): Promise<T> {
    return this.order({ call: method, args }) as Promise<T>;
  }

  callWith<T = Record<string, unknown>>(method: string, args: unknown[], kwargs: Record<string, unknown>): Promise<T> {
    return this.order({ call: method, args, kwargs }) as Promise<T>;
  }

  /** Calls a method of what `path` reaches in the double (attribute and item names), e.g. a list to append to. */
  callAt<T = unknown>(path: string[], method: string, ...args: unknown[]): Promise<T> {
    return this.order({ at: path, call: method, args }) as Promise<T>;
  }

  get<T>(attribute: string): Promise<T> {
    return this.order({ get: attribute }) as Promise<T>;
  }

  async set(attribute: string, value: unknown): Promise<void> {
    await this.order({ set: attribute, value });
  }

  async stop(): Promise<void> {
    if (this.child.exitCode !== null) return;
    const exited = new Promise((ok) => this.child.once("exit", ok));
    this.child.stdin!.end(); // the runner stops when its stdin closes
    await Promise.race([exited, sleep(5_000).then(() => this.child.kill("SIGKILL"))]);
  }
}

/** A webhook endpoint on node:http; its URL. */
export async function serve(listener: (req: import("node:http").IncomingMessage, res: import("node:http").ServerResponse) => void): Promise<{ url: string; server: Server }> {
  const server = createServer(listener);
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  server.unref(); // a test that fails before closing it must not keep the run from ending
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/webhook`, server };
}

export function post(url: string, body: string | Buffer, headers: Record<string, string> = { "content-type": "application/json" }): Promise<Response> {
  return fetch(url, { method: "POST", body, headers });
}

/** Waits until `check()` holds (what background work does has no event to await from here). */
export async function eventually(check: () => Promise<boolean> | boolean, withinMs = 15_000): Promise<void> {
  const deadline = performance.now() + withinMs;
  while (!(await check())) {
    if (performance.now() > deadline) throw new Error(`not within ${withinMs} ms`);
    await sleep(50);
  }
}

/**
 * Guarded agents, one per client, each with its own provider (`make()`) and endpoint on node:http: every incoming
 * message is claimed before the provider's answer and replied to in the claim; `drafting` holds the sends back.
 */
export async function guardedAgents(make: () => Replier, clients: Coordinator[], drafting?: Promise<void>): Promise<{ urls: string[]; close(): Promise<void> }> {
  const handlers: WebhookHandler[] = [];
  const servers: Server[] = [];
  const urls: string[] = [];
  for (const coordinator of clients) {
    const provider = make();
    const handler = providerWebhookListener(provider, {
      coordinator,
      ttl: 30,
      work: async (message, claim) => {
        await drafting;
        await claim.send(() => provider.reply(message, { body: "Your order ships today.", stamp: claim.stamp }));
      },
    });
    const { url, server } = await serve(handler);
    handlers.push(handler);
    servers.push(server);
    urls.push(url);
  }
  return {
    urls,
    async close(): Promise<void> {
      await settle(handlers);
      for (const server of servers) {
        server.closeAllConnections();
        server.close();
      }
    },
  };
}

/** Lets every handler's background work finish (and stops its periodic check). */
export async function settle(handlers: WebhookHandler[]): Promise<void> {
  for (const handler of handlers) await handler.close();
}

/**
 * What an agent without the coordinator does with a change log: keeps its position in its own memory (each worker
 * its own), so that two workers each read, and answer, the same range.
 */
export class LocalCursors implements Cursors {
  private readonly positions = new Map<string, { value: string; position: bigint }>();

  async take(_mailbox: string, name: string, throughPosition: bigint): Promise<CursorRange> {
    const { value, position } = this.positions.get(name) ?? { value: "", position: 0n };
    if (throughPosition > 0n && position >= throughPosition) return { outcome: "COVERED", value: "", position: 0n, token: 0n, holder: "", expiresInMs: 0 };
    return { outcome: "TAKEN", value, position, token: 1n, holder: "", expiresInMs: 0 };
  }

  async advance(_mailbox: string, name: string, _taken: CursorRange, value: string, position: bigint): Promise<boolean> {
    this.positions.set(name, { value, position });
    return true;
  }
}

/**
 * The stamp an unguarded agent's reply carries: it has no claim (the providers' reply needs a stamp), and a key of
 * its own for each send, as an agent without the coordinator makes one per attempt (a provider that takes an
 * Idempotency-Key would otherwise refuse its second reply itself).
 */
export const unclaimed = (): ClaimStamp => ({ key: "ic1-" + randomBytes(32).toString("hex"), token: 1n });

/**
 * The same agent without the coordinator: the provider checks and opens each delivery, and every message it reads
 * that is not in the sent mail is answered.
 */
export async function unguarded(
  provider: Replier,
  request: { body: Buffer; headers: Record<string, string> },
  cursors: Cursors,
): Promise<void> {
  const accepted = await provider.check({ method: "POST", query: "", headers: request.headers, body: request.body });
  if (!(accepted instanceof Accepted)) throw new Error(`refused: ${accepted.status}`);
  const batch = await provider.open(accepted, cursors);
  for (const facts of batch.facts) if (!facts.folders.includes("SENT")) await provider.reply(facts, { body: "Your order ships today.", stamp: unclaimed() });
  await batch.commit();
}
