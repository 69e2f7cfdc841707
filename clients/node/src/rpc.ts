// What a failed attempt of an RPC is, before the retry loop decides whether it is final.
import { ConnectError } from "@connectrpc/connect";
import { codeName, errorFor, type CoordinatorError, type StatusCodeName } from "./errors.js";

/** The trailer (and BatchResult field) in which the coordinator says how long to wait before retrying. */
export const RETRY_AFTER_METADATA = "retry-after-ms";

export class RpcFailure extends Error {
  constructor(
    readonly code: StatusCodeName,
    readonly details: string,
    readonly retryAfterMs?: number,
  ) {
    super(`${code}: ${details}`);
  }

  static from(error: unknown): RpcFailure {
    if (!(error instanceof ConnectError)) throw error;
    const hint = Number.parseInt(error.metadata.get(RETRY_AFTER_METADATA) ?? "", 10);
    return new RpcFailure(codeName(error.code), error.rawMessage, Number.isFinite(hint) ? Math.max(hint, 0) : undefined);
  }

  error(method: string, attempts: number): CoordinatorError {
    return errorFor(this.code, this.details, method, attempts, this.retryAfterMs);
  }
}
