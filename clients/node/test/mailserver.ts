// A real mail server on loopback for the Node IMAP tests, as tests/providers/mailserver.py is for Python's: Debian's
// Dovecot (IMAP, IDLE, RFC 6154 special-use folders) from a temporary configuration on a free port (testing.ts's
// freePort), a maildir store and passwd-file users; and an SMTP server (the `smtp-server` package) that delivers each
// message into every local recipient's mailbox with dovecot-lda. As root (CI, these machines) the mail belongs to
// `nobody` (Dovecot refuses to keep mail as root); as anyone else, to that user.
import { execFile, execFileSync } from "node:child_process";
import { chmodSync, chownSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir, userInfo } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { ImapFlow } from "imapflow";
import { SMTPServer } from "smtp-server";
import { freePort } from "../src/testing.js";

export const DOVECOT = "/usr/sbin/dovecot";
export const LDA = "/usr/lib/dovecot/dovecot-lda";
export const PASSWORD = "secret-password";
export const DOMAIN = "example.test";

/** dovecot-lda's exit status for "try again later". */
const EX_TEMPFAIL = 75;
export class TempFail extends Error {}

export const installed = (): boolean => existsSync(DOVECOT) && existsSync(LDA);

function mailUser(): { name: string; uid: number; gid: number } {
  if (process.getuid?.() !== 0) {
    const me = userInfo();
    return { name: me.username, uid: me.uid, gid: me.gid };
  }
  const [, , uid, gid] = execFileSync("getent", ["passwd", "nobody"], { encoding: "utf8" }).trim().split(":");
  return { name: "nobody", uid: Number(uid), gid: Number(gid) };
}

function config(root: string, port: number, user: { name: string; uid: number; gid: number }, asRoot: boolean): string {
  const services = asRoot ? "" : `default_internal_user = ${user.name}\ndefault_login_user = ${user.name}\n`;
  return `
base_dir = ${root}/run
state_dir = ${root}/state
log_path = ${root}/dovecot.log
info_log_path = ${root}/dovecot.log
listen = 127.0.0.1
protocols = imap
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
mail_location = maildir:${root}/mail/%n
first_valid_uid = 1
first_valid_gid = 1
${services}
namespace inbox {
  inbox = yes
  separator = /
  mailbox Sent {
    special_use = \\Sent
    auto = subscribe
  }
}
passdb {
  driver = passwd-file
  args = scheme=PLAIN username_format=%u ${root}/users
}
userdb {
  driver = passwd-file
  args = username_format=%u ${root}/users
  default_fields = uid=${user.uid} gid=${user.gid} home=${root}/home/%n
}
service imap-login {
  inet_listener imap {
    address = 127.0.0.1
    port = ${port}
  }
  inet_listener imaps {
    port = 0
  }
  chroot =
}
service anvil {
  chroot =
}
protocol lda {
  postmaster_address = postmaster@${DOMAIN}
}
`;
}

/** One Dovecot and its users `name@example.test`; restart() keeps its port and its mail. */
export class Dovecot {
  readonly root: string;
  readonly users: string[];
  readonly conf: string;
  port = 0;

  constructor(names: string[]) {
    const asRoot = process.getuid?.() === 0;
    const user = mailUser();
    // Not under a 0700 directory: as root, `nobody` must reach the mail store.
    this.root = mkdtempSync(join(tmpdir(), "inbox-dovecot-node-"));
    chmodSync(this.root, 0o755);
    this.users = names.map((name) => (name.includes("@") ? name : `${name}@${DOMAIN}`));
    for (const folder of ["run", "state", "mail", "home"]) mkdirSync(join(this.root, folder));
    for (const folder of ["mail", "home"]) chownSync(join(this.root, folder), user.uid, user.gid);
    writeFileSync(join(this.root, "users"), this.users.map((u) => `${u}:{PLAIN}${PASSWORD}::::::\n`).join(""));
    this.conf = join(this.root, "dovecot.conf");
    this.asRoot = asRoot;
    this.user = user;
  }

  private readonly asRoot: boolean;
  private readonly user: { name: string; uid: number; gid: number };

  static async start(names: string[]): Promise<Dovecot> {
    const server = new Dovecot(names);
    server.port = await freePort();
    writeFileSync(server.conf, config(server.root, server.port, server.user, server.asRoot));
    await server.start();
    return server;
  }

  async start(): Promise<void> {
    execFileSync(DOVECOT, ["-c", this.conf], { stdio: "ignore", timeout: 30_000 });
    const deadline = performance.now() + 15_000;
    for (;;) {
      try {
        const client = await this.imap(this.users[0]!);
        await client.logout();
        return;
      } catch {
        if (performance.now() > deadline) throw new Error(`Dovecot did not listen on ${this.port}:\n${this.log()}`);
        await sleep(50);
      }
    }
  }

  async stop(): Promise<void> {
    execFileSync(DOVECOT, ["-c", this.conf, "stop"], { stdio: "ignore", timeout: 30_000 });
    const deadline = performance.now() + 15_000;
    while (existsSync(join(this.root, "run", "master.pid")) && performance.now() < deadline) await sleep(50);
  }

  async restart(): Promise<void> {
    await this.stop();
    await this.start();
  }

  async remove(): Promise<void> {
    await this.stop().catch(() => undefined);
    rmSync(this.root, { recursive: true, force: true });
  }

  log(): string {
    const path = join(this.root, "dovecot.log");
    return existsSync(path) ? readFileSync(path, "utf8") : "(no log)";
  }

  /** A logged-in IMAP connection of `user` (a person's mail client, or the test reading a mailbox). */
  async imap(user: string): Promise<ImapFlow> {
    const client = new ImapFlow({ host: "127.0.0.1", port: this.port, secure: false, auth: { user, pass: PASSWORD }, logger: false });
    client.on("error", () => undefined);
    await client.connect();
    return client;
  }

  /** dovecot-lda: the message into `recipient`'s `folder`, as an MTA's local delivery does (it works while Dovecot is stopped too). */
  deliver(recipient: string, raw: Buffer, folder = "INBOX"): Promise<void> {
    return new Promise((ok, fail) => {
      const child = execFile(LDA, ["-c", this.conf, "-d", recipient, "-f", `postmaster@${DOMAIN}`, "-m", folder], { timeout: 30_000 }, (error, _out, err) => {
        if (error === null) return ok();
        // 75 (EX_TEMPFAIL): Dovecot's auth is down (the server stopped): an MTA queues the message.
        fail(error.code === EX_TEMPFAIL ? new TempFail(`dovecot-lda for ${recipient}: ${err}`) : new Error(`dovecot-lda for ${recipient}: ${error.message} ${err}`));
      });
      child.stdin!.end(raw);
    });
  }

  /** The header blocks of every message of `user`'s `folder` (a scenario's end count). */
  async messages(user: string, folder = "INBOX"): Promise<{ headers: string; flags: string[] }[]> {
    const client = await this.imap(user);
    try {
      await client.mailboxOpen(folder, { readOnly: true });
      const found = await client.fetchAll("1:*", { headers: true, flags: true }).catch(() => []);
      return found.map((m) => ({ headers: (m.headers ?? Buffer.alloc(0)).toString("utf8"), flags: [...(m.flags ?? [])] }));
    } finally {
      await client.logout();
    }
  }
}

/** An SMTP server on a free port delivering into Dovecot; `filesSent`: a local sender's submission is filed in their Sent too. */
export class Smtp {
  readonly received: { from: string; to: string[] }[] = [];
  filesSent = false;
  /** Milliseconds to wait after delivering, before answering DATA (longer than the client waits: its answer is lost). */
  loseAnswersMs = 0;
  private server: SMTPServer | undefined;
  private constructor(readonly port: number) {}

  static async start(dovecot: Dovecot): Promise<Smtp> {
    const smtp = new Smtp(await freePort());
    const server = new SMTPServer({
      authOptional: true,
      disabledCommands: ["STARTTLS"],
      logger: false,
      onAuth: (_auth, _session, done) => done(null, { user: "anyone" }),
      onData: (stream, session, done) => {
        const chunks: Buffer[] = [];
        stream.on("data", (chunk: Buffer) => chunks.push(chunk));
        stream.on("end", () => {
          const raw = Buffer.concat(chunks);
          const from = session.envelope.mailFrom === false ? "" : session.envelope.mailFrom.address;
          const to = session.envelope.rcptTo.map((r) => r.address);
          void (async () => {
            const deliveries: [string, string][] = to.filter((r) => dovecot.users.includes(r)).map((r) => [r, "INBOX"]);
            if (smtp.filesSent && dovecot.users.includes(from)) deliveries.push([from, "Sent"]);
            smtp.received.push({ from, to });
            // Accepted for delivery, as an MTA does: while Dovecot is down, queued and tried again.
            void smtp.deliverAll(dovecot, deliveries, raw);
            if (smtp.loseAnswersMs > 0) await sleep(smtp.loseAnswersMs);
          })().then(
            () => done(),
            (error: Error) => done(error),
          );
        });
      },
    });
    await new Promise<void>((ok) => server.listen(smtp.port, "127.0.0.1", ok));
    smtp.server = server;
    return smtp;
  }

  /** Messages accepted and not yet in their mailboxes (queued while Dovecot is down). */
  pending = 0;

  async deliverAll(dovecot: Dovecot, deliveries: [string, string][], raw: Buffer): Promise<void> {
    this.pending++;
    try {
      for (const [recipient, folder] of deliveries) {
        for (;;) {
          try {
            await dovecot.deliver(recipient, raw, folder);
            break;
          } catch (error) {
            if (!(error instanceof TempFail)) throw error;
            await sleep(200);
          }
        }
      }
    } finally {
      this.pending--;
    }
  }

  async stop(): Promise<void> {
    await new Promise<void>((ok) => (this.server === undefined ? ok() : this.server.close(() => ok())));
  }
}
