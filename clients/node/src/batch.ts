// Coalescing concurrent calls into Batch RPCs, the policy of the Python client's inbox_claims._batch: the calls
// that one client's callers make at the same time go as one Batch (one round trip, one server dispatch, one etcd
// group commit); each keeps its own request id, retries and error, exactly as if it had been sent alone.
import { create, type DescMessage, type Message } from "@bufbuild/protobuf";
import * as pb from "./gen/inbox/coordinator/v1/coordinator_pb.js";
import { codeName } from "./errors.js";
import { RpcFailure } from "./rpc.js";

/** The coordinator's limit of calls per Batch RPC. */
export const BATCH_MAX_CALLS = 256;
/** Two: while one batch is out, the next fills; a third would only split the callers into smaller batches. */
export const MAX_BATCHES_IN_FLIGHT = 2;
const SMALLEST_SPLIT = 8;

/** The unary methods a Batch may carry (ClaimReply, ...) and their field in BatchCall / BatchResult, as the .proto declares them. */
export const BATCHABLE: ReadonlyMap<string, string> = new Map(
  (pb.BatchCallSchema.oneofs[0]?.fields ?? [])
    .filter((field) => field.message !== undefined)
    .map((field) => [(field.message as DescMessage).name.replace(/Request$/, ""), field.localName]),
);

/** One attempt of a unary call. */
export interface Rpc {
  readonly method: string;
  readonly request: Message;
  readonly timeoutMs: number;
  /** The call's own metadata besides the client's: its W3C trace context (tracing.ts). */
  readonly headers?: Readonly<Record<string, string>>;
}

/** The one RPC that carries `calls`: the call itself when alone, else a Batch whose deadline is the earliest of theirs. */
export function batchOf(calls: readonly Rpc[]): Rpc {
  if (calls.length === 1) return calls[0]!;
  const request = create(pb.BatchRequestSchema, {
    calls: calls.map((call) =>
      create(pb.BatchCallSchema, {
        call: { case: BATCHABLE.get(call.method), value: call.request } as pb.BatchCall["call"],
        // The call's trace context, which its own metadata would have carried.
        traceparent: call.headers?.["traceparent"] ?? "",
        tracestate: call.headers?.["tracestate"] ?? "",
      }),
    ),
  });
  return { method: "Batch", request, timeoutMs: Math.min(...calls.map((call) => call.timeoutMs)) };
}

/** Each call's answer from what batchOf's RPC answered: its response, or the failure it would have ended with alone. */
export function answers(calls: readonly Rpc[], response: Message): (Message | RpcFailure)[] {
  if (calls.length === 1) return [response];
  const results = (response as pb.BatchResponse).results;
  if (results.length !== calls.length) {
    return calls.map(() => new RpcFailure("INTERNAL", `the coordinator answered ${results.length} of ${calls.length} calls`));
  }
  return calls.map((call, index) => {
    const result = results[index]!.result;
    if (result.case === "error") {
      const retryAfter = result.value.retryAfterMs > 0n ? Number(result.value.retryAfterMs) : undefined;
      return new RpcFailure(codeName(result.value.code), result.value.message, retryAfter);
    }
    if (result.case !== undefined && result.case === BATCHABLE.get(call.method)) return result.value as Message;
    return new RpcFailure("INTERNAL", `the coordinator answered ${result.case ?? "nothing"} to a ${call.method}`);
  });
}

/** The answer that tells a waiting call: the coordinator has no Batch RPC, send yourself alone. */
export const RESEND = Symbol("resend");

export interface Waiter {
  resolve(value: Message | typeof RESEND): void;
  reject(error: unknown): void;
}

/**
 * Queues calls and hands out the batches to send: at most `maxBatch` calls each, at most MAX_BATCHES_IN_FLIGHT
 * out at once, what waits spread over the free slots. Calls that come while the batches in flight are out go
 * together in the next: the busier the client, the bigger its batches; an idle client's call goes at once, alone.
 */
export class Coalescer {
  readonly pending: [Rpc, Waiter][] = [];
  inFlight = 0;
  /** False once the coordinator answered Batch with UNIMPLEMENTED (an old one). */
  supported = true;

  constructor(readonly maxBatch: number) {}

  add(rpc: Rpc, waiter: Waiter): void {
    this.pending.push([rpc, waiter]);
  }

  nextBatch(): [Rpc, Waiter][] | undefined {
    if (this.pending.length === 0 || this.inFlight >= MAX_BATCHES_IN_FLIGHT) return undefined;
    // Two half batches keep the client, the coordinator and etcd busy at once; a few calls are not worth two round trips.
    const free = MAX_BATCHES_IN_FLIGHT - this.inFlight;
    const size = Math.min(Math.max(Math.ceil(this.pending.length / free), SMALLEST_SPLIT), this.maxBatch, this.pending.length);
    this.inFlight += 1;
    return this.pending.splice(0, size);
  }

  finished(): void {
    this.inFlight -= 1;
  }

  /** What each call of an RPC that failed as a whole gets: the failure, or RESEND when the coordinator predates Batch. */
  failed(calls: readonly Rpc[], failure: RpcFailure): (RpcFailure | typeof RESEND)[] {
    if (calls.length > 1 && failure.code === "UNIMPLEMENTED") {
      this.supported = false;
      return calls.map(() => RESEND);
    }
    return calls.map(() => failure);
  }
}

