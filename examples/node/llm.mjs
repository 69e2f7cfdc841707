// A stand-in for the LLM call: takes LLM_DELAY_MS, signs the draft with the agent's name.
import { setTimeout as sleep } from "node:timers/promises";

export async function draftReply(message) {
  await sleep(Number(process.env.LLM_DELAY_MS ?? 1000));
  return `Thanks for your message "${message.subject ?? ""}". -- ${process.env.PRINCIPAL ?? "agent"}`;
}
