// One spelling of a message id, so that one message is one claim however its id was written: the rule of
// conformance/message_ids.json, byte for byte what the Python client does (inbox_claims/_message_ids.py).
// The whitespace around the id is dropped; an id enclosed whole in one pair of angle brackets, with none inside,
// is the id within them (an RFC 5322 Message-ID as a header writes it), its own surrounding whitespace dropped
// too. Nothing else is rewritten: no case folding, no Unicode normalisation.

/** What is dropped around an id: Unicode's White_Space characters and U+FEFF (String.prototype.trim's set differs). */
export const MESSAGE_ID_WHITESPACE =
  "\t\n\u000b\u000c\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" +
  "\u2028\u2029\u202f\u205f\u3000\ufeff";

function strip(text: string): string {
  let start = 0;
  let end = text.length;
  while (start < end && MESSAGE_ID_WHITESPACE.includes(text[start]!)) start++;
  while (end > start && MESSAGE_ID_WHITESPACE.includes(text[end - 1]!)) end--;
  return text.slice(start, end);
}

/** `messageId` as every client claims it: " <m1@x> " and "m1@x" are one message. */
export function canonicalMessageId(messageId: string): string {
  const trimmed = strip(messageId);
  if (trimmed.length > 2 && trimmed.startsWith("<") && trimmed.endsWith(">")) {
    const inner = trimmed.slice(1, -1);
    if (!inner.includes("<") && !inner.includes(">") && strip(inner) !== "") return strip(inner);
  }
  return trimmed;
}
