export { Coordinator, DEFAULT_RETRY, DEFAULT_TARGET, ENV_DEFAULT_TIMEOUT_MS, ENVIRONMENT, newRequestId, optionsFromEnv, type ClaimOptions, type CoordinatorOptions, CORRESPONDENT_MAX_BYTES, type Envelope, type IncomingOptions, type OutgoingOptions, type RetryPolicy } from "./client.js";
export { AUTO_SUBMITTED_HEADER, AUTO_SUBMITTED_VALUE, judgeAutomated, NOT_AUTOMATED, type HeaderSource } from "./automated.js";
export { DEFAULT_SENT_FOLDERS, OutgoingRules, type OutgoingMatch } from "./outgoing.js";
export { Claim, cleanText, NO_IDEMPOTENCY_KEY_WARNING, summaryOf, type ReplyOptions, type ReplyTarget, type Scope } from "./claim.js";
export * from "./errors.js";
export * from "./types.js";
export { canonicalMessageId, MESSAGE_ID_WHITESPACE } from "./messageIds.js";
export { EnvelopeError, parseNotification, type Notification, type NotificationVariant } from "./envelope.js";
export {
  NYLAS_SIGNATURE_HEADER,
  WebhookVerificationError,
  nylasChallengeResponse,
  signNylas,
  signStandardWebhook,
  verifyNylasSignature,
  verifyStandardWebhook,
  verifySvixWebhook,
} from "./webhooks.js";
export {
  DEFAULT_ADMISSION_TIMEOUT_MS,
  DEFAULT_EVENTS,
  DEFAULT_MAX_BODY_BYTES,
  nylasWebhook,
  nylasWebhookListener,
  providerWebhook,
  providerWebhookListener,
  type ProviderWebhookOptions,
  type WebhookHandler,
  type WebhookOptions,
} from "./middleware.js";
export type { Automated, ClaimStamp, Cursors, CursorRange, MessageFacts, Provider } from "./providers/seam.js";
export { claimCustomHeaders, claimHeaders, idempotencyOverrides, sdkError, sentIdOf, UNGUARDED_SEND_WARNING, UnguardedSend, type CustomHeader } from "./sdks.js";
