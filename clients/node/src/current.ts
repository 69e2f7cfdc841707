// Which claim a send runs under, for the send paths that mark an agent's reply (the Python client's
// inbox_claims._current.agent_headers): claim.send runs its function inside this context, so that Nylas.send,
// GraphProvider.reply and GmailProvider.reply know whether the reply is a person's without being told.
import { AsyncLocalStorage } from "node:async_hooks";
import { AUTO_SUBMITTED_HEADER, AUTO_SUBMITTED_VALUE } from "./automated.js";

const current = new AsyncLocalStorage<{ readonly byPerson: boolean }>();

/** @internal Runs `fn` as the send of a claim held by a person (`byPerson`) or an agent. */
export function sendingAs<T>(byPerson: boolean, fn: () => T): T {
  return current.run({ byPerson }, fn);
}

/**
 * The headers a reply sent now carries to say it is automatic (RFC 3834 section 5: `Auto-Submitted: auto-replied`),
 * so that auto-responders and other agents do not answer it and no loop starts: every send path adds them unless the
 * claim it is sent under is a person's (a person's reply is never marked). Outside any claim the send path is an
 * agent's: people answer through their mail client or inboxctl.
 */
export function agentHeaders(): readonly (readonly [string, string])[] {
  return current.getStore()?.byPerson ? [] : [[AUTO_SUBMITTED_HEADER, AUTO_SUBMITTED_VALUE]];
}
