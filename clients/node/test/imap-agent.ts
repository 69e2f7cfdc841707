// A guarded IMAP agent in a process of its own, for the test that kills a watcher mid-message
// (test/providers.imap.test.ts): watches IMAP_ADDRESS on the loopback Dovecot (IMAP_PORT, SMTP_PORT), claims with
// the coordinator at COORDINATOR_TARGET as PRINCIPAL (TTL CLAIM_TTL seconds), prints "drafting <message id>" when
// its work starts, and drafts for DRAFT_MS before it replies.
import { setTimeout as sleep } from "node:timers/promises";
import { Coordinator } from "../src/index.js";
import { ImapProvider, ImapWatcher } from "../src/providers/imap.js";

const env = process.env;
const provider = new ImapProvider(env["IMAP_ADDRESS"]!, {
  host: "127.0.0.1",
  port: Number(env["IMAP_PORT"]),
  secure: false,
  user: env["IMAP_ADDRESS"]!,
  pass: env["IMAP_PASSWORD"]!,
  smtpPort: Number(env["SMTP_PORT"]),
  smtpTls: "none",
  checkEveryMs: 0,
});
const coordinator = new Coordinator({ target: env["COORDINATOR_TARGET"]!, principal: env["PRINCIPAL"]! });
const watcher = new ImapWatcher(provider, {
  coordinator,
  ttl: Number(env["CLAIM_TTL"] ?? 30),
  work: async (message, claim) => {
    console.log(`drafting ${message.messageId}`);
    await sleep(Number(env["DRAFT_MS"] ?? 0));
    await claim.send(() => provider.reply(message, { body: "Your order ships today.", stamp: claim.stamp }));
  },
});
await watcher.start();
console.log("watching");
process.on("SIGTERM", () => void watcher.close().then(() => process.exit(0)));
