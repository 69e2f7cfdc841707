// inbox-claims/providers: the mail providers behind one seam (docs/providers.md). Each turns its webhooks into
// MessageFacts, the one value the guard, the webhook adapters (providerWebhook, providerWebhookListener) and the
// outgoing rules read; one module per provider, as the Python client's inbox_claims.providers.
import { AgentMailProvider } from "./agentmail.js";
import { GmailProvider } from "./gmail.js";
import { GraphProvider } from "./graph.js";
import { NylasProvider } from "./nylas.js";
import { ResendProvider } from "./resend.js";
import type { Provider, Transport } from "./seam.js";

export * from "./seam.js";
export { GraphProvider, GraphSendOutcomeUnknown, GraphSendRejected, type GraphProviderOptions } from "./graph.js";
export { GmailProvider, GmailSendOutcomeUnknown, GmailSendRejected, type GmailProviderOptions } from "./gmail.js";
export { AgentMailProvider, AgentMailSendOutcomeUnknown, AgentMailSendRejected, type AgentMailProviderOptions } from "./agentmail.js";
export { ResendProvider, ResendSendOutcomeUnknown, ResendSendRejected, threadOf as resendThreadOf, type ResendProviderOptions } from "./resend.js";
export { ImapProvider, ImapSendOutcomeUnknown, ImapSendRejected, ImapWatcher, IDLE_MS, type ImapProviderOptions, type Wake } from "./imap.js";
export { NylasProvider, factsOf as nylasFactsOf, type NylasProviderOptions } from "./nylas.js";

/** Each provider by name, made from a vector file's settings (conformance/providers/<name>) with its I/O. */
export const PROVIDERS: Readonly<Record<string, { fromSettings(settings: Record<string, unknown>, io?: { transport?: Transport; clock?: () => number }): Provider }>> = {
  nylas: NylasProvider,
  graph: GraphProvider,
  gmail: GmailProvider,
  agentmail: AgentMailProvider,
  resend: ResendProvider,
};
