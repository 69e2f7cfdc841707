import { test } from "node:test";
import assert from "node:assert/strict";
import { Cluster } from "./harness.js";

test("smoke", async () => {
  const cluster = await Cluster.start({ replicas: 1 });
  try {
    const coord = cluster.client("agent-1");
    const subject = { mailbox: "m", kind: "message" as const, id: "x" };
    const r = await coord.claim(subject, { ttl: 5 });
    assert.equal(r.outcome, "GRANTED");
    const results = await Promise.all(Array.from({ length: 10 }, (_, i) => coord.claim({ ...subject, id: `y${i}` }, { ttl: 5 })));
    assert.ok(results.every((x) => x.outcome === "GRANTED"));
  } finally {
    await cluster.stop();
  }
});
