// examples/node: the guarded agent differs from the unguarded one by the lines docs/node.md shows, and the demo (two
// agents, two coordinator replicas, redeliveries, a created+updated pair, a human claim, the copies of the agents'
// own replies, a person answering from Gmail while an agent drafts) sends once per message, and never to a copy.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { promisify } from "node:util";
import { REPO } from "../src/testing.js";

const EXAMPLES = join(REPO, "examples", "node");

/** The code lines (the leading comment block left out) of an example file. */
function code(name: string): string[] {
  const lines = readFileSync(join(EXAMPLES, name), "utf8").split("\n");
  return lines.slice(lines.findIndex((line) => !line.startsWith("//")));
}

test("the guarded Express agent adds 4 lines to the unguarded one and changes 3, as docs/node.md says", () => {
  const unguarded = code("agent-unguarded.mjs");
  const guarded = code("agent-guarded.mjs");
  // Lines of each that the other lacks (a line-multiset difference: what a diff shows as - and +).
  const missing = (from: string[], to: string[]): string[] => {
    const pool = [...to];
    return from.filter((line) => {
      const at = pool.indexOf(line);
      if (at < 0) return true;
      pool.splice(at, 1);
      return false;
    });
  };
  const added = missing(guarded, unguarded);
  const removed = missing(unguarded, guarded);
  assert.equal(added.length, 7, `added lines:\n${added.join("\n")}`); // 4 new lines, and 3 that replace one each
  assert.equal(removed.length, 3, `removed lines:\n${removed.join("\n")}`);
  assert.ok(added.some((line) => line.includes("coord.replyTo(")));
  assert.ok(added.some((line) => line.includes("Coordinator.fromEnv()")));
  // The send takes the claim's key and puts it in the Idempotency-Key header: nothing of it left out.
  assert.ok(added.some((line) => line.includes("claim.send((idempotencyKey) => sendReply(")));
  assert.ok(added.some((line) => line.includes('"idempotency-key": idempotencyKey')));
  const docs = readFileSync(join(REPO, "docs", "node.md"), "utf8");
  assert.match(docs, /7 lines: 4\s+added and 3 changed/);
});

test("the Node demo: one send per message across two agents and two coordinator replicas", async () => {
  const { stdout } = await promisify(execFile)(process.execPath, [join(EXAMPLES, "demo.mjs")], {
    env: { ...process.env, LLM_DELAY_MS: "500" },
    timeout: 120_000,
  });
  assert.match(stdout, /OK: exactly one reply per message/);
  assert.match(stdout, /msg-redelivered-\w+: 1 send\(s\), expected 1/);
  assert.match(stdout, /msg-created-updated-\w+: 1 send\(s\), expected 1/);
  assert.match(stdout, /msg-human-\w+: 0 send\(s\), expected 0/);
  assert.match(stdout, /msg-gmail-\w+: 0 send\(s\), expected 0/);
  assert.match(stdout, /msg-gmail-\w+: REPLIED, answered from the mailbox by Ana Lima <ana@shop.example>/);
  assert.match(stdout, /replies to the mailbox's own messages \(their 4 copies delivered, answered 200\): 0, expected 0/);
});
