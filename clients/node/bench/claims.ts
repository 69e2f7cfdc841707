// The Node row of `python -m bench claims`: `clients` concurrent tasks claim fresh subjects through ONE
// Coordinator object (its concurrent calls go together in Batch RPCs), first for --warmup seconds unmeasured,
// then for --seconds; prints one JSON line: ops, seconds, every latency (ms), and this process's CPU seconds.
//
//   node dist/bench/claims.js --target 127.0.0.1:50051 --clients 64 --seconds 3 --mailbox bench-x
import { parseArgs } from "node:util";
import { Coordinator } from "../src/index.js";

const { values } = parseArgs({
  options: {
    target: { type: "string", default: "127.0.0.1:50051" },
    clients: { type: "string", default: "64" },
    seconds: { type: "string", default: "3" },
    warmup: { type: "string", default: "0.5" },
    mailbox: { type: "string", default: `bench-node-${process.pid}` },
    principal: { type: "string", default: "bench-node-agent" },
    ttl: { type: "string", default: "3600" },
  },
});
const clients = Number(values.clients);
const ttl = Number(values.ttl);
const coordinator = new Coordinator({ target: values.target, principal: values.principal, timeoutMs: 30_000 });
let sequence = 0;

async function loop(seconds: number, latencies: number[] | undefined): Promise<number> {
  const stopAt = performance.now() + seconds * 1000;
  const started = performance.now();
  await Promise.all(
    Array.from({ length: clients }, async () => {
      while (performance.now() < stopAt) {
        const begun = performance.now();
        const result = await coordinator.claim({ mailbox: values.mailbox, kind: "message", id: `n-${sequence++}` }, { ttl });
        if (result.outcome !== "GRANTED") throw new Error(`a fresh subject was not granted: ${result.outcome}`);
        latencies?.push(performance.now() - begun);
      }
    }),
  );
  return (performance.now() - started) / 1000;
}

await loop(Number(values.warmup), undefined);
const latencies: number[] = [];
const cpuBefore = process.cpuUsage();
const seconds = await loop(Number(values.seconds), latencies);
const cpu = process.cpuUsage(cpuBefore);
coordinator.close();
process.stdout.write(JSON.stringify({ ops: latencies.length, seconds, latencies_ms: latencies, cpu_seconds: (cpu.user + cpu.system) / 1e6 }) + "\n");
