// Which notifications are about a message the mailbox sent, as the Python client's inbox_claims._outgoing: such a
// message is never handed to the user's work, and is reported to the coordinator instead (RecordOutgoing).
//
// Nylas sends message.created for every message of the mailbox, the ones it sends included: the agent's own
// replies, and what people send from Gmail, Outlook or a helpdesk. A message is outgoing when one of its
// `folders` is a sent folder (Google's SENT label always; for Microsoft and IMAP the ids of the grant's folders
// whose `attributes` hold \Sent, which Nylas.sentFolderIds lists) or one of its `from` addresses is one of the
// mailbox's own (compared without case). A claim's stamp alone never makes a message outgoing: the stamp is no
// secret and anyone can write the header into a mail they send (docs/design.md#providers). The rules read the
// neutral facts every provider gives (judge); match() reads a Nylas message object. The cases both clients run are
// JSON: conformance/outgoing.json.

/** Google's label id of sent mail: the same for every Gmail and Workspace grant. */
export const DEFAULT_SENT_FOLDERS: readonly string[] = ["SENT"];
export const SENT_FOLDERS_ENV = "INBOX_SENT_FOLDERS";
export const MAILBOX_ADDRESSES_ENV = "INBOX_MAILBOX_ADDRESSES";

/** Why a message is outgoing: the rule that matched and the folder id or address it matched on. */
export interface OutgoingMatch {
  readonly rule: "sent_folder" | "mailbox_address";
  readonly value: string;
}

/** The match as the log line says it. */
export function describeMatch(match: OutgoingMatch): string {
  if (match.rule === "sent_folder") return `it is in the sent folder ${JSON.stringify(match.value)}`;
  return `it is from the mailbox's own address ${JSON.stringify(match.value)}`;
}

const normalAddress = (address: string): string => address.trim().toLowerCase();

/** A setting given as one comma-separated string (the environment) or as strings, without empty entries. */
export function splitSetting(value: string | readonly string[] | undefined, name: string): string[] {
  if (value === undefined) return [];
  const items: unknown[] = typeof value === "string" ? value.split(",") : [...value];
  if (!items.every((item): item is string => typeof item === "string")) {
    throw new TypeError(`${name} must be strings (or one comma-separated string), not ${JSON.stringify(value)}`);
  }
  return items.map((item) => item.trim()).filter((item) => item !== "");
}

/** The client's settings for telling outgoing messages: sent folder ids (besides SENT) and the mailbox's own addresses. */
export class OutgoingRules {
  readonly sentFolders: ReadonlySet<string>;
  readonly mailboxAddresses: ReadonlySet<string>;

  constructor(sentFolders?: string | readonly string[], mailboxAddresses?: string | readonly string[]) {
    const addresses = splitSetting(mailboxAddresses, "mailboxAddresses");
    for (const address of addresses) {
      if (!address.includes("@")) throw new RangeError(`mailboxAddresses: ${JSON.stringify(address)} is not an email address`);
    }
    this.sentFolders = new Set([...DEFAULT_SENT_FOLDERS, ...splitSetting(sentFolders, "sentFolders")]);
    this.mailboxAddresses = new Set(addresses.map(normalAddress));
  }

  /**
   * Why a message is outgoing, from the neutral facts every provider gives (its folder or label ids, its sender
   * addresses), or undefined when it is incoming. `moreAddresses`: the mailbox's addresses a provider knows besides
   * the settings (Gmail's user). A claim stamp alone never makes a message outgoing (docs/design.md#providers).
   */
  judge(folders: Iterable<string>, fromAddresses: Iterable<string>, moreAddresses: Iterable<string> = []): OutgoingMatch | undefined {
    for (const folder of folders) {
      if (this.sentFolders.has(folder)) return { rule: "sent_folder", value: folder };
    }
    const own = new Set(this.mailboxAddresses);
    for (const address of moreAddresses) own.add(normalAddress(address));
    for (const address of fromAddresses) {
      if (own.has(normalAddress(address))) return { rule: "mailbox_address", value: normalAddress(address) };
    }
    return undefined;
  }

  /** Why the Nylas message object is outgoing (its `folders` and `from`), or undefined when it is incoming. Other shapes are ignored, never errors. */
  match(message: Readonly<Record<string, unknown>>): OutgoingMatch | undefined {
    const folders = message["folders"];
    const senders = message["from"];
    return this.judge(
      Array.isArray(folders) ? folders.filter((folder): folder is string => typeof folder === "string") : [],
      (Array.isArray(senders) ? senders : []).flatMap((sender: unknown) => {
        const email = typeof sender === "object" && sender !== null && !Array.isArray(sender) ? (sender as Record<string, unknown>)["email"] : undefined;
        return typeof email === "string" ? [email] : [];
      }),
    );
  }
}
