// Any mailbox over IMAP and SMTP behind the provider seam (docs/providers.md, "IMAP and SMTP"), the Node twin of
// the Python client's inbox_claims.providers.imap. IMAP with `imapflow`, SMTP with `nodemailer` (both maintained by
// Postal Systems, releases every few weeks; imapflow speaks IDLE, special-use LIST, UIDPLUS; optional peer
// dependencies, loaded when a provider connects).
//
// * No webhook: ImapWatcher watches the mailbox itself: one IDLE connection per folder (the Inbox and the \Sent
//   special-use folder, RFC 6154), IDLE re-issued before the server's timeout (RFC 2177: 29 minutes; imapflow's
//   maxIdleTime), reconnecting after any drop with a wake on each connection; and a periodic check as the fallback.
//   Each wake is a delivery admitted by the webhook adapters' own code (WebhookHandler.deliver).
// * Each folder's position is a coordinator cursor, `imap:<folder>:<UIDVALIDITY>` (docs/design.md#cursors): the last
//   UID read, shared by every watcher of the mailbox, so that several watchers read each new message once and a
//   restarted one starts where the mailbox was. A new UIDVALIDITY is a new cursor whose first round reads the last day.
// * The dedup key is `imap:<folder>:<UIDVALIDITY>:<UID>`; the message id (the claim's subject) is the Message-ID.
// * A watcher that died mid-message left its claim to lapse: each periodic check (and a watcher's start) also reads
//   the Inbox's unanswered messages of the last day behind the cursor; an answered message is flagged \Answered.
// * Outgoing: in the \Sent folder, or from the mailbox's addresses. The thread is the root of References (else
//   In-Reply-To, else the message's own Message-ID).
// * Send: SMTP with a Message-ID derived from the claim (stampMessageId) and X-Inbox-Claim, then one APPEND of that
//   same message to Sent (appendToSent; off for a server that files submitted mail itself): the copy whose stamp
//   settles a send left IN_DOUBT.
import { agentHeaders } from "../current.js";
import type { ImapFlow } from "imapflow";
import type { Transporter } from "nodemailer";
import { InboxClaimsError, SendRejected } from "../errors.js";
import { providerWebhookListener, type ProviderWebhookOptions, type WebhookHandler } from "../middleware.js";
import { Accepted, batchOf, display, messageIds, parseStamp, ProviderError, replySubject, requireEnv, splitAddress, STAMP_HEADER, stampMessageId, type Answer, type Batch, type ClaimStamp, type CursorRange, type Cursors, type MessageFacts, type Provider } from "./seam.js";

/** RFC 2177: a client re-issues IDLE at least every 29 minutes, as servers may log it off after 30. */
export const IDLE_MS = 29 * 60_000;
export const CHECK_EVERY_MS = 300_000;
const RANGE_TTL = 60;
const RESYNC_MS = 24 * 3600_000;
const BUSY_WAIT_MS = 250;
const BUSY_LOOKS = 16;
const RECONNECT_MAX_MS = 10_000;

/** The SMTP server refused the reply (its sender, its recipients, its DATA), or could not be reached: nothing went out. */
export class ImapSendRejected extends SendRejected {
  override name = "ImapSendRejected";
}

/** The SMTP connection failed while the message was handed over: it may have gone out (IN_DOUBT until its copy in Sent settles it). */
export class ImapSendOutcomeUnknown extends InboxClaimsError {
  override name = "ImapSendOutcomeUnknown";
}

/** A delivery the watcher opens itself: a folder changed, or the periodic check (`recover`: the Inbox's unanswered messages behind the cursor too). */
export interface Wake {
  readonly recover: boolean;
}

export interface ImapProviderOptions {
  host: string;
  user: string;
  pass: string;
  port?: number;
  /** IMAP over TLS (993, default) or plain (a loopback test server). */
  secure?: boolean;
  smtpHost?: string;
  smtpPort?: number;
  /** "starttls" (default), "tls" or "none". */
  smtpTls?: "starttls" | "tls" | "none";
  smtpUser?: string;
  smtpPass?: string;
  inbox?: string;
  /** The Sent folder; default: the one the server marks \Sent, else "Sent". */
  sentFolder?: string;
  /** File the reply's copy in Sent (default true; false for a server that files submitted mail itself). */
  appendToSent?: boolean;
  mailboxAddresses?: readonly string[];
  /** IDLE is re-issued after this long (at most RFC 2177's 29 minutes). */
  idleMs?: number;
  /** The periodic check, in milliseconds (default 5 minutes; 0: none). */
  checkEveryMs?: number;
  smtpTimeoutMs?: number;
  clock?: () => number;
}

interface Fetched {
  uid: number;
  headers: Buffer;
  flags: readonly string[];
}

/** The headers of a message's header block (unfolded; the first of each name). */
function parseHeaders(block: Buffer): Map<string, string> {
  const headers = new Map<string, string>();
  const text = block.toString("utf8").replace(/\r?\n[ \t]+/g, " ");
  for (const line of text.split(/\r?\n/)) {
    const colon = line.indexOf(":");
    if (colon <= 0) continue;
    const name = line.slice(0, colon).trim().toLowerCase();
    if (!headers.has(name)) headers.set(name, decodeWords(line.slice(colon + 1).trim()));
  }
  return headers;
}

/** RFC 2047 encoded words (=?charset?B|Q?...?=) decoded, as a subject or a name may be. */
function decodeWords(value: string): string {
  return value.replace(/=\?([^?]+)\?([BbQq])\?([^?]*)\?=\s*(?==\?)?/g, (_, _charset: string, kind: string, data: string) =>
    kind.toUpperCase() === "B" ? Buffer.from(data, "base64").toString("utf8") : Buffer.from(data.replace(/_/g, " ").replace(/=([0-9A-Fa-f]{2})/g, (__, hex: string) => String.fromCharCode(parseInt(hex, 16))), "latin1").toString("utf8"),
  );
}

function dateOf(text: string | undefined): Date | undefined {
  if (!text) return undefined;
  const date = new Date(text);
  return Number.isNaN(date.getTime()) ? undefined : date;
}

/** One mailbox over IMAP (reads) and SMTP (replies); `address` is the mailbox's address, the mailbox the claims are in. */
export class ImapProvider implements Provider {
  readonly name = "imap";
  /** No one waits for an answer: the watcher admits its own wakes (30 s bound, as Python's). */
  readonly answerWithinMs = 60_000;
  readonly address: string;
  readonly domain: string;
  readonly mailboxAddresses: readonly string[];
  readonly periodicIntervalMs: number;
  readonly idleMs: number;
  readonly inbox: string;
  sentFolder: string | undefined;
  private session: Promise<ImapFlow> | undefined;
  private queue: Promise<unknown> = Promise.resolve();
  private smtp: Transporter | undefined;
  private readonly clock: () => number;

  constructor(
    address: string,
    readonly options: ImapProviderOptions,
  ) {
    if (!address.includes("@")) throw new RangeError(`address must be the mailbox's email address, not ${JSON.stringify(address)}`);
    const idleMs = options.idleMs ?? IDLE_MS;
    if (!(idleMs > 0 && idleMs <= IDLE_MS)) throw new RangeError(`idleMs must be above 0 and at most ${IDLE_MS} (RFC 2177), not ${idleMs}`);
    const tls = options.smtpTls ?? "starttls";
    if (!["starttls", "tls", "none"].includes(tls)) throw new RangeError(`smtpTls must be "starttls", "tls" or "none", not ${JSON.stringify(tls)}`);
    this.address = address.toLowerCase();
    this.domain = this.address.split("@")[1]!;
    this.mailboxAddresses = [this.address, ...(options.mailboxAddresses ?? []).map((a) => a.toLowerCase())];
    this.periodicIntervalMs = options.checkEveryMs ?? CHECK_EVERY_MS;
    this.idleMs = idleMs;
    this.inbox = options.inbox ?? "INBOX";
    this.sentFolder = options.sentFolder;
    this.clock = options.clock ?? Date.now;
  }

  /**
   * From IMAP_ADDRESS, IMAP_HOST, IMAP_USERNAME, IMAP_PASSWORD, IMAP_PORT (993), IMAP_TLS (yes), SMTP_HOST (the IMAP
   * host), SMTP_PORT (587), SMTP_TLS (starttls, tls or none), IMAP_CHECK_EVERY (seconds, 300), IMAP_IDLE_SECONDS
   * (1740) and INBOX_MAILBOX_ADDRESSES, as the Python client reads them.
   */
  static fromEnv(env: Record<string, string | undefined> = process.env, overrides: Partial<ImapProviderOptions> = {}): ImapProvider {
    requireEnv(env, ["IMAP_ADDRESS", "IMAP_HOST", "IMAP_USERNAME", "IMAP_PASSWORD"], "IMAP and SMTP");
    const seconds = (name: string, fallback: number): number => {
      const value = Number(env[name] || fallback);
      if (!Number.isFinite(value) || value < 0) throw new RangeError(`${name} must be a number of seconds, not ${JSON.stringify(env[name])}`);
      return value * 1000;
    };
    return new ImapProvider(env["IMAP_ADDRESS"]!, {
      host: env["IMAP_HOST"]!,
      user: env["IMAP_USERNAME"]!,
      pass: env["IMAP_PASSWORD"]!,
      port: Number(env["IMAP_PORT"] || 993),
      secure: !["no", "false", "0"].includes((env["IMAP_TLS"] || "yes").toLowerCase()),
      ...(env["SMTP_HOST"] ? { smtpHost: env["SMTP_HOST"] } : {}),
      smtpPort: Number(env["SMTP_PORT"] || 587),
      smtpTls: (env["SMTP_TLS"] || "starttls") as "starttls",
      checkEveryMs: seconds("IMAP_CHECK_EVERY", CHECK_EVERY_MS / 1000),
      idleMs: seconds("IMAP_IDLE_SECONDS", IDLE_MS / 1000),
      mailboxAddresses: (env["INBOX_MAILBOX_ADDRESSES"] ?? "").split(",").map((a) => a.trim()).filter((a) => a),
      ...overrides,
    });
  }

  // -- IMAP connections ---------------------------------------------------------------------------------------

  /** A new logged-in connection (the watcher's IDLE connections, one per folder). */
  async connect(): Promise<ImapFlow> {
    const { ImapFlow } = await import("imapflow");
    const client = new ImapFlow({
      host: this.options.host,
      port: this.options.port ?? 993,
      secure: this.options.secure ?? true,
      auth: { user: this.options.user, pass: this.options.pass },
      logger: false,
      maxIdleTime: this.idleMs,
      connectionTimeout: 30_000,
    });
    client.on("error", () => undefined); // a dropped connection is seen as its 'close'
    await client.connect();
    return client;
  }

  /** Runs `use` on the one command connection (reads, APPEND, flags), one at a time; made again after a failure. */
  private async withSession<T>(use: (client: ImapFlow) => Promise<T>): Promise<T> {
    const run = this.queue.then(async () => {
      let client: ImapFlow;
      try {
        if (this.session !== undefined && !(await this.session.catch(() => undefined))?.usable) this.session = undefined;
        this.session ??= this.connect();
        client = await this.session;
      } catch (error) {
        this.session = undefined;
        throw new ProviderError(`cannot reach the IMAP server: ${(error as Error).message}`, { cause: error });
      }
      try {
        return await use(client);
      } catch (error) {
        if (!client.usable) this.session = undefined;
        throw error instanceof ProviderError ? error : new ProviderError(`IMAP: ${(error as Error).message}`, { cause: error });
      }
    });
    this.queue = run.catch(() => undefined);
    return run;
  }

  async close(): Promise<void> {
    const session = this.session;
    this.session = undefined;
    this.smtp?.close();
    if (session !== undefined) await session.then((client) => client.logout()).catch(() => undefined);
  }

  /** The Sent folder: as given, else the one the server marks \Sent (RFC 6154), else "Sent". */
  async sent(): Promise<string> {
    if (this.sentFolder === undefined) {
      const folders = await this.withSession((client) => client.list());
      this.sentFolder = folders.find((folder) => folder.specialUse === "\\Sent")?.path ?? "Sent";
    }
    return this.sentFolder;
  }

  async folders(): Promise<[string, string]> {
    return [this.inbox, await this.sent()];
  }

  private async read(folder: string, validity: bigint, after: number, first: boolean, recover: boolean): Promise<Fetched[]> {
    const since = new Date(this.clock() - RESYNC_MS);
    return this.withSession(async (client) => {
      const opened = await client.mailboxOpen(folder, { readOnly: true });
      if (opened.uidValidity !== validity) throw new ProviderError(`${folder}'s UIDVALIDITY changed while it was read; read again`);
      let uids = first ? ((await client.search({ since }, { uid: true })) || []).filter((u) => u > after) : [];
      // "N:*" answers the last message even when its UID is below N (RFC 3501 6.4.8).
      if (!first) uids = ((await client.search({ uid: `${after + 1}:*` }, { uid: true })) || []).filter((u) => u > after);
      if (recover && after > 0) uids.push(...((await client.search({ answered: false, since }, { uid: true })) || []).filter((u) => u <= after));
      const wanted = [...new Set(uids)].sort((a, b) => a - b);
      if (wanted.length === 0) return [];
      const found = await client.fetchAll(wanted.join(","), { uid: true, headers: true, flags: true }, { uid: true });
      return found.map((item) => ({ uid: item.uid, headers: item.headers ?? Buffer.alloc(0), flags: [...(item.flags ?? [])] }));
    });
  }

  // -- the seam -------------------------------------------------------------------------------------------------

  async check(): Promise<Answer> {
    return { status: 404, body: "an IMAP mailbox has no webhook: run ImapWatcher" };
  }

  acknowledge(): Answer {
    return { status: 200, body: "read" };
  }

  /** The periodic check: every folder past its cursor, and the Inbox's unanswered messages behind it. */
  periodic(): Accepted {
    return new Accepted({ recover: true } satisfies Wake);
  }

  async open(accepted: Accepted, cursors: Cursors): Promise<Batch> {
    const wake = (accepted.delivery as Wake | undefined) ?? { recover: false };
    const facts: MessageFacts[] = [];
    const moves: { name: string; range: CursorRange; end: number }[] = [];
    for (const folder of await this.folders()) {
      const status = await this.withSession((client) => client.status(folder, { uidValidity: true, uidNext: true }));
      if (status === false || status.uidValidity === undefined || status.uidNext === undefined) throw new ProviderError(`the IMAP server gave no UIDVALIDITY for ${folder}`);
      const name = `imap:${folder}:${status.uidValidity}`;
      const recover = wake.recover && folder === this.inbox;
      const range = await this.take(cursors, name, recover ? 0n : BigInt(status.uidNext - 1), wake.recover);
      if (range === undefined) continue;
      const found = await this.read(folder, status.uidValidity, Number(range.position), !range.value, recover);
      for (const item of found) facts.push(this.facts(folder, status.uidValidity, item));
      moves.push({ name, range, end: Math.max(Number(range.position), ...found.map((item) => item.uid)) });
    }
    return batchOf(facts, {
      commit: async () => {
        for (const { name, range, end } of moves) await cursors.advance(this.address, name, range, String(end), BigInt(end));
      },
      abandon: async () => {
        for (const { name, range } of moves) await cursors.advance(this.address, name, range, range.value, range.position);
      },
    });
  }

  private async take(cursors: Cursors, name: string, through: bigint, periodic: boolean): Promise<CursorRange | undefined> {
    for (let look = 0; look < BUSY_LOOKS; look++) {
      const range = await cursors.take(this.address, name, through, RANGE_TTL);
      if (range.outcome === "TAKEN") return range;
      if (range.outcome === "COVERED" || periodic) return undefined; // nothing new; or another watcher reads it now
      await new Promise((ok) => setTimeout(ok, BUSY_WAIT_MS)); // what the other watcher records may cover ours
    }
    throw new ProviderError(`another watcher held the cursor ${name} too long`);
  }

  /** The facts of one message (its headers and flags). */
  facts(folder: string, validity: bigint, item: Fetched): MessageFacts {
    const headers = parseHeaders(item.headers);
    const text = (name: string): string => headers.get(name.toLowerCase()) ?? "";
    const [name, address] = splitAddress(text("From"));
    const replyTo = text("Reply-To")
      .split(",")
      .map((entry) => splitAddress(entry)[1])
      .filter((entry) => entry.includes("@"));
    const ownId = messageIds(text("Message-ID"))[0] ?? "";
    const references = messageIds(text("References"));
    const inReplyTo = messageIds(text("In-Reply-To"));
    const root = (references[0] ?? inReplyTo[0] ?? ownId) || undefined;
    const key = `imap:${folder}:${validity}:${item.uid}`;
    const subject = text("Subject");
    return {
      provider: this.name,
      event: "message.created",
      mailbox: this.address,
      dedupKey: key,
      messageId: ownId || key,
      threadId: root,
      receivedAt: dateOf(text("Date")),
      sender: display(name, address),
      subjectLine: subject,
      fromAddresses: address ? [address.toLowerCase()] : [],
      folders: folder === this.sentFolder ? [folder, "SENT"] : [folder],
      outgoing: undefined,
      automated: undefined,
      stamp: parseStamp(text(STAMP_HEADER)) ?? parseStamp(ownId),
      reply: { to: replyTo.length > 0 ? replyTo : address ? [address] : [], subject: replySubject(subject), internetMessageId: ownId || undefined, references: references.length > 0 ? references : inReplyTo },
      source: { folder, uidValidity: validity, uid: item.uid, flags: item.flags },
    };
  }

  // -- send -------------------------------------------------------------------------------------------------

  /** The reply as it is sent and filed: threaded, stamped, marked as an automatic answer (RFC 3834); its raw bytes. */
  async compose(message: MessageFacts, body: string, stamp: ClaimStamp): Promise<{ raw: Buffer; messageId: string }> {
    const { default: MailComposer } = await import("nodemailer/lib/mail-composer/index.js");
    const messageId = stampMessageId(stamp, this.domain);
    const { internetMessageId, references } = message.reply;
    const mail = new MailComposer({
      from: this.address,
      to: [...message.reply.to],
      subject: message.reply.subject,
      date: new Date(this.clock()),
      messageId,
      ...(internetMessageId ? { inReplyTo: internetMessageId, references: [...references, internetMessageId].join(" ") } : {}),
      headers: { ...Object.fromEntries(agentHeaders()), [STAMP_HEADER]: `${stamp.key}.${stamp.token}` }, // a person's reply unmarked
      text: body,
    });
    return { raw: await mail.compile().build(), messageId };
  }

  /**
   * The reply, for claim.send: `claim.send(() => imap.reply(message, { body, stamp: claim.stamp }))`: over SMTP, its
   * Message-ID derived from the claim; then its one copy in Sent and the original flagged \Answered. Its Message-ID.
   */
  async reply(message: MessageFacts, options: { body: string; stamp: ClaimStamp }): Promise<string> {
    if (options.stamp === undefined) throw new TypeError("reply needs the claim's stamp: imap.reply(message, { body, stamp: claim.stamp })");
    if (message.reply.to.length === 0) throw new ImapSendRejected("the message names no one to answer (no From or Reply-To): nothing was sent");
    const { raw, messageId } = await this.compose(message, options.body, options.stamp);
    await this.submit(raw, [...message.reply.to]);
    try {
      // The send is done: a failed copy or flag changes nothing of it.
      if (this.options.appendToSent ?? true) await this.withSession(async (client) => client.append(await this.sentInside(client), raw, ["\\Seen"]));
      await this.flagAnswered(message);
    } catch {
      // the next periodic check reads the Inbox's unanswered messages; the claim answers them ALREADY_REPLIED
    }
    return messageId;
  }

  private async sentInside(client: ImapFlow): Promise<string> {
    if (this.sentFolder === undefined) this.sentFolder = (await client.list()).find((folder) => folder.specialUse === "\\Sent")?.path ?? "Sent";
    return this.sentFolder;
  }

  /** Hands the message to the SMTP server: refused, or not reached, nothing went out (ImapSendRejected); cut mid-send, it may have (ImapSendOutcomeUnknown). */
  async submit(raw: Buffer, to: string[]): Promise<void> {
    const nodemailer = await import("nodemailer");
    const tls = this.options.smtpTls ?? "starttls";
    this.smtp ??= nodemailer.createTransport({
      host: this.options.smtpHost ?? this.options.host,
      port: this.options.smtpPort ?? 587,
      secure: tls === "tls",
      requireTLS: tls === "starttls",
      ignoreTLS: tls === "none",
      ...(this.options.smtpUser ?? this.options.user ? { auth: { user: this.options.smtpUser ?? this.options.user, pass: this.options.smtpPass ?? this.options.pass } } : {}),
      connectionTimeout: this.options.smtpTimeoutMs ?? 30_000,
      greetingTimeout: this.options.smtpTimeoutMs ?? 30_000,
      socketTimeout: this.options.smtpTimeoutMs ?? 30_000,
    });
    try {
      await this.smtp.sendMail({ envelope: { from: this.address, to }, raw });
    } catch (error) {
      const { code, responseCode, message } = error as { code?: string; responseCode?: number; message: string };
      // A server's answer refusing it, or no connection made: nothing was accepted. A timeout or a connection cut
      // (nodemailer says CONN for those too, whatever the stage) may have come after the message was handed over: unknown.
      const neverConnected = code === "ESOCKET" && /ECONNREFUSED|ENOTFOUND|EHOSTUNREACH|ENETUNREACH/.test(message);
      if (typeof responseCode === "number" || code === "EAUTH" || code === "EENVELOPE" || neverConnected) {
        throw new ImapSendRejected(`the SMTP server refused the reply or could not be reached, nothing was sent: ${(error as Error).message}`);
      }
      throw new ImapSendOutcomeUnknown(`the SMTP connection failed mid-send, it may have gone out: ${(error as Error).message}`, { cause: error });
    }
  }

  async flagAnswered(message: MessageFacts): Promise<void> {
    const source = message.source as { folder?: string; uidValidity?: bigint; uid?: number } | undefined;
    if (!source?.uid || !source.folder) return;
    await this.withSession(async (client) => {
      const opened = await client.mailboxOpen(source.folder!);
      if (opened.uidValidity === source.uidValidity) await client.messageFlagsAdd(String(source.uid), ["\\Answered"], { uid: true });
    });
  }
}

/**
 * Watches one IMAP mailbox and answers it through the coordinator: `await watcher.start()` ... `await
 * watcher.close()`. Options as providerWebhookListener's (`coordinator`, `work`, `ttl`...); admission is bounded by
 * 30 s (a mailbox read is slower than a webhook's body).
 */
export class ImapWatcher {
  readonly handler: WebhookHandler;
  /** Deliveries opened so far (each wake, each periodic check). */
  checks = 0;
  private stopping = false;
  private wanted = false;
  private draining: Promise<void> | undefined;
  private readonly idles: Promise<void>[] = [];
  private readonly clients = new Set<ImapFlow>();
  private readonly stopped: AbortController = new AbortController();

  constructor(
    readonly provider: ImapProvider,
    options: ProviderWebhookOptions,
  ) {
    this.handler = providerWebhookListener(provider, { admissionTimeoutMs: 30_000, ...options });
  }

  /** The first check (with the recovery of lapsed claims), then one IDLE connection per folder. */
  async start(): Promise<void> {
    await this.deliver({ recover: true });
    let backoff = 500;
    for (;;) {
      try {
        for (const folder of await this.provider.folders()) this.idles.push(this.idle(folder));
        return;
      } catch (error) {
        // The server is down at start: the folders are asked again, as an IDLE connection reconnects.
        process.emitWarning(`imap: cannot list the mailbox's folders (${(error as Error).message}); again in ${backoff} ms`);
        await sleep(backoff, this.stopped.signal);
        backoff = Math.min(backoff * 2, RECONNECT_MAX_MS);
        if (this.stopping) return;
      }
    }
  }

  private async deliver(wake: Wake): Promise<Answer> {
    this.checks++;
    const answer = await this.handler.deliver(new Accepted(wake));
    if (answer.status >= 300) process.emitWarning(`imap: the mailbox could not be read now (${answer.body}); the next wake or check reads it`);
    return answer;
  }

  /** Asks for a read; wakes that come while one runs make one more read after it. */
  wake(): void {
    if (this.stopping) return;
    this.wanted = true;
    this.draining ??= (async () => {
      while (this.wanted && !this.stopping) {
        this.wanted = false;
        await this.deliver({ recover: false }).catch(() => undefined);
      }
      this.draining = undefined;
    })();
  }

  /** One folder's IDLE: wakes the watcher on new mail and after every (re)connection; reconnects with backoff. */
  private async idle(folder: string): Promise<void> {
    let backoff = 500;
    while (!this.stopping) {
      let client: ImapFlow;
      try {
        client = await this.provider.connect();
      } catch (error) {
        process.emitWarning(`imap: cannot connect for IDLE on ${folder} (${(error as Error).message}); again in ${backoff} ms`);
        await sleep(backoff, this.stopped.signal);
        backoff = Math.min(backoff * 2, RECONNECT_MAX_MS);
        continue;
      }
      backoff = 500;
      this.clients.add(client);
      const closed = new Promise<void>((ok) => client.once("close", () => ok()));
      try {
        client.on("exists", () => this.wake());
        await client.mailboxOpen(folder, { readOnly: true }); // imapflow IDLEs on it, re-issued every maxIdleTime
        this.wake(); // what arrived while this connection was down
        await Promise.race([closed, sleep(2 ** 31 - 1, this.stopped.signal)]);
      } catch (error) {
        if (!this.stopping) process.emitWarning(`imap: the IDLE connection on ${folder} dropped (${(error as Error).message}); reconnecting`);
      } finally {
        this.clients.delete(client);
        client.close();
      }
    }
  }

  /** Stops watching, lets the running work finish, closes the connections. */
  async close(): Promise<void> {
    this.stopping = true;
    this.stopped.abort();
    for (const client of this.clients) client.close();
    await Promise.allSettled(this.idles);
    await this.draining;
    await this.handler.close();
    await this.provider.close();
  }
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((ok) => {
    const done = (): void => {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      ok();
    };
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
  });
}
