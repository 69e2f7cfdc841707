// inbox-claims/nylas: the Nylas send adapter and the Nylas provider (its home is providers/nylas.ts, behind the seam
// every provider shares: docs/providers.md). This entry point stays for the code that imports it.
export * from "./providers/nylas.js";
