// The Gmail provider's key cache (no coordinator: the push's check alone), as the Python client's
// tests/providers/test_gmail_keys.py: Google's keys are fetched once and kept; a push signed by a key the cache does
// not hold fetches them again, at most once a minute, so that a rotation is followed and a stream of pushes with
// unknown key ids does not become a stream of fetches. Against the repository's Gmail double (test/doubles.py).
import { test } from "node:test";
import assert from "node:assert/strict";
import { GmailProvider } from "../src/providers/gmail.js";
import { Accepted, type Answer } from "../src/providers/seam.js";
import { Double } from "./doubles.js";

type Push = [Record<string, string>, string];

test("gmail: Google's keys are fetched once and kept, and again for a new key at most once a minute", async () => {
  const address = `keys-${process.pid}@shop.example`;
  const double = await Double.start("gmail", { address });
  try {
    let ahead = 0; // seconds the provider's clock is past the double's (which signs the pushes now, valid an hour)
    const gmail = new GmailProvider("https://agent.example/webhook", address, {
      token: "gmail-token",
      apiBase: double.url,
      jwksUrl: `${double.url}/oauth2/v3/certs`,
      historyCheckIntervalMs: 0,
      clock: () => Date.now() / 1000 + ahead,
    });
    const check = async (): Promise<Answer | Accepted> => {
      const [headers, body] = await double.call<Push>("push");
      return gmail.check({ method: "POST", query: "", headers, body: Buffer.from(body) });
    };
    const jwksFetches = async (): Promise<number> => (await double.get<Record<string, number>>("calls"))["jwks"] ?? 0;
    assert.ok((await check()) instanceof Accepted);
    assert.ok((await check()) instanceof Accepted);
    assert.equal(await jwksFetches(), 1); // kept
    await double.call("rotate_key"); // Google publishes a new key beside the old and signs with it from now on
    ahead = 30;
    const refused = await check(); // fetched 30 s ago: not again yet; Pub/Sub delivers it again later
    assert.ok(!(refused instanceof Accepted));
    assert.deepEqual([refused.status, await jwksFetches()], [401, 1]);
    assert.match(refused.body, /unknown key/);
    ahead = 61;
    assert.ok((await check()) instanceof Accepted); // a minute on: fetched again, the new key found
    assert.equal(await jwksFetches(), 2);
  } finally {
    await double.stop();
  }
});
