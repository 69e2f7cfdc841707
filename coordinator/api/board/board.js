// The claims board: who is answering which email, live. Plain JavaScript, no build step, nothing from
// elsewhere: it talks to the coordinator's HTTP/JSON API (the Connect protocol) on the page's own origin.
"use strict";

const API = "/inbox.coordinator.v1.Coordinator/";
const CLAIMED = "SUBJECT_STATE_CLAIMED", SENDING = "SUBJECT_STATE_SENDING";
const IN_DOUBT = "SUBJECT_STATE_IN_DOUBT", REPLIED = "SUBJECT_STATE_REPLIED", FREE = "SUBJECT_STATE_FREE";
const URGENCY = { [IN_DOUBT]: 0, [SENDING]: 1, [CLAIMED]: 2, [REPLIED]: 3 };
const CLAIM_SECONDS = 900; // a person's claim: long enough to write a reply; kept longer on request, given back when done
const WARN_SECONDS = 120; // a person is told this long before their claim ends, with a way to keep it
const FOCUS_WAIT_MS = 5000; // how long the focus waits for the change an action caused to come through the stream
const REFOCUS_MS = 300; // how long a focused row that went away may take to come back (a takeover's two steps)

const $ = (selector) => document.querySelector(selector);
// me, kind and roles: who the coordinator says the signed-in person is (GetCaller), to offer only what they may do.
const session = { token: "", name: "", me: "", kind: "", roles: [], mailboxes: [] };
const rows = new Map(); // "mailbox\u0000kind\u0000id" -> { status, tr }
const seen = new Map(); // mailbox -> the revision of the last snapshot or event: a reconnection resumes there
const shown = new Set([IN_DOUBT, CLAIMED, SENDING, REPLIED]);
const alike = new Map(); // subject line + sender -> the keys of the rows that share them
const warned = new Set(); // keys of the person's own claims they were told are ending
const undone = new Map(); // key -> { by, at }: emails whose reply from the mailbox a person undid (while this page is open)
let recent = []; // the last answer to "Answer an email yourself"
let waiting = []; // what agents leave to people (automated mail nobody claims, stopped conversations), per refresh
let waitingPending = false;
const WAITING_REFRESH_MS = 15000; // how often "Waiting for a person" is asked again, besides after each change
let search = "";
let reorderPending = false;
let focusIntent = null; // where the focus goes once the change an action caused has arrived
let refocus = null; // a focused row that went away: { key, next }, settled after REFOCUS_MS

// --- talking to the coordinator ---------------------------------------------------------------------------

function headers(contentType) {
  const h = { "content-type": contentType };
  if (session.token) h.authorization = "Bearer " + session.token;
  else { h["x-inbox-principal"] = session.name; h["x-inbox-principal-kind"] = "human"; }
  return h;
}

class CallFailed extends Error {
  constructor(code, message) { super(message); this.code = code; }
}

async function call(method, body) {
  let response;
  try {
    response = await fetch(API + method, { method: "POST", headers: headers("application/json"), body: JSON.stringify(body) });
  } catch (error) {
    throw new CallFailed("unavailable", "the coordinator cannot be reached");
  }
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new CallFailed(answer.code || "unknown", answer.message || response.statusText);
  return answer;
}

async function whoAmI() {
  const caller = await call("GetCaller", {});
  session.me = caller.principal;
  session.kind = caller.kind === "HOLDER_KIND_AGENT" ? "agent" : "human";
  session.roles = caller.roles || [];
}

function may(role) { return session.roles.includes(role); }
const mayTakeOver = () => session.kind === "human" && may("takeover");

function requestId() {
  return (crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2) + Date.now()).replace(/-/g, "");
}

// Watch: a Connect server stream, each message framed by a flags byte and a 4-byte big-endian length.
async function watch(mailbox) {
  let delay = 500;
  let interrupted = false, interruptedNotice = "";
  for (;;) {
    try {
      const request = new TextEncoder().encode(JSON.stringify({ mailbox, afterRevision: seen.get(mailbox) || "0" }));
      const frame = new Uint8Array(5 + request.length);
      new DataView(frame.buffer).setUint32(1, request.length);
      frame.set(request, 5);
      const response = await fetch(API + "Watch", { method: "POST", headers: headers("application/connect+json"), body: frame });
      if (!response.ok) {
        const answer = await response.json().catch(() => ({}));
        throw new CallFailed(answer.code || "unknown", answer.message || response.statusText);
      }
      const reader = response.body.getReader();
      let buffer = new Uint8Array(0);
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const joined = new Uint8Array(buffer.length + value.length);
        joined.set(buffer); joined.set(value, buffer.length);
        buffer = joined;
        while (buffer.length >= 5) {
          const size = new DataView(buffer.buffer, buffer.byteOffset + 1, 4).getUint32(0);
          if (buffer.length < 5 + size) break;
          const message = JSON.parse(new TextDecoder().decode(buffer.subarray(5, 5 + size)));
          const flags = buffer[0];
          buffer = buffer.slice(5 + size);
          if (flags & 2) { if (message.error) throw new CallFailed(message.error.code, message.error.message); continue; }
          take(mailbox, message);
          delay = 500;
          // Only the trouble notice is cleared: a person's own answer (say, to a takeover) must stay on screen
          // when the stream brings the change it caused, which may come before or after that answer.
          if (interrupted) { interrupted = false; unsay(interruptedNotice); }
        }
      }
      throw new CallFailed("unavailable", "the live view was interrupted");
    } catch (error) {
      if (error.code === "permission_denied" || error.code === "unauthenticated") { say(plainError(error)); return; }
      interrupted = true;
      interruptedNotice = `Live updates for ${mailbox} paused (${plainError(error)}); reconnecting…`;
      say(interruptedNotice);
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

// --- what the stream says -----------------------------------------------------------------------------------

const keyOf = (subject) => [subject.mailbox, subject.kind, subject.id].join("\u0000");

function take(mailbox, message) {
  const revision = (message.snapshot || message.event || {}).revision;
  if (revision) seen.set(mailbox, revision);
  if (message.snapshot) {
    for (const [key, row] of rows) if (row.status.subject.mailbox === mailbox) remove(key);
    for (const status of message.snapshot.subjects || []) upsert(status, false);
    scheduleReorder(); // one sort for the whole snapshot
  } else if (message.event) {
    const { status, type, previousHolder } = message.event;
    const key = keyOf(status.subject);
    const existing = rows.get(key);
    if (status.state === FREE) {
      if (existing) tellTheHolder(existing.status, type, previousHolder);
      if (type === "EVENT_TYPE_OUTSIDE_REPLY_UNDONE") tellTheUndo(existing ? existing.status : status, message.event);
      if (existing && existing.status.agentsStopped) tellAgentsStopped(existing.status, message.event);
      remove(key);
    } else {
      place(upsert(status, true));
    }
    refreshCounts();
    rovingFocus();
  }
  showRecent();
  showWaiting();
  // Asked again only for a change that may concern it (agents renewing their claims every few seconds do not).
  if (message.event && concernsWaiting(message.event.status)) scheduleWaiting();
  applyFocusIntent();
}

// A person whose own claim ended without their doing hears of it, in words for them.
function tellTheHolder(status, type, previousHolder) {
  if (status.holder !== session.me || status.state !== CLAIMED) return;
  const what = nameOf(status);
  if (type === "EVENT_TYPE_EXPIRED") {
    say(`Your time on ${what} ran out before you said it was answered: it is free again, and an agent may answer it. ` +
      "If you are still writing, take it again from “Answer an email yourself”.", true);
  }
  if (type === "EVENT_TYPE_TAKEN_OVER" && previousHolder === session.me) {
    say(`${what} was taken over from you: it is someone else's now, and what you send for it is refused.`, true);
  }
}

// An agent let go of an email in a conversation where agents were stopped (docs/design.md#reply-storms): it is
// free again, and off the board; everyone watching hears it, in the coordinator's words.
function tellAgentsStopped(status, event) {
  const reason = event.reason || status.agentsStopped.reason;
  say(`${status.holder} let go of ${nameOf(status)}: ${reason}. It waits for a person under “Waiting for a person”.`);
}

// Everyone watching hears that a reply recorded as written outside was undone, by whom: the email is free again.
function tellTheUndo(status, event) {
  undone.set(keyOf(status.subject), { by: event.by, at: event.at });
  if (event.by === session.me) return; // the person who undid it was answered already (undoOutside)
  const reply = event.undone ? `“${outsideWords(event.undone)}”` : "the reply recorded from the mailbox";
  const note = event.reason ? ` (${event.reason})` : "";
  say(`${event.by || "Someone"} undid ${reply} for ${nameOf(status)} at ${clock(when(event.at))}${note}: ` +
    "it was not the answer, and the email can be answered again.");
}

// Agents stopped on a conversation wait for a person, as a send in doubt does: both go first.
const urgency = (status) => (status.agentsStopped ? URGENCY[IN_DOUBT] : URGENCY[status.state]);
const before = (a, b) => urgency(a.status) - urgency(b.status) || (since(b.status) || 0) - (since(a.status) || 0);

// One changed row moves to its place among the others, without touching them (a thousand rows stay cheap).
function place(row) {
  const body = $("#claims tbody");
  const focused = row.tr.contains(document.activeElement) ? document.activeElement : null;
  row.tr.remove();
  const others = body.children;
  let low = 0, high = others.length;
  while (low < high) {
    const middle = (low + high) >> 1;
    if (before(rows.get(others[middle].dataset.key), row) <= 0) low = middle + 1; else high = middle;
  }
  body.insertBefore(row.tr, others[low] || null);
  if (focused) focused.focus();
}

function upsert(status, fresh) {
  const key = keyOf(status.subject);
  let row = rows.get(key);
  if (!row) {
    const tr = document.createElement("tr");
    tr.tabIndex = -1;
    tr.setAttribute("role", "row");
    row = { status, tr };
    rows.set(key, row);
  } else {
    forgetAlike(key, row.status);
    if (row.status.expiresAt !== status.expiresAt) warned.delete(key);
  }
  row.status = status;
  render(row);
  rememberAlike(key, status);
  if (fresh && row.tr.animate) row.tr.animate([{ background: "#fff7d6" }, { background: "transparent" }], 1500);
  return row;
}

function remove(key) {
  const row = rows.get(key);
  if (!row) return;
  // The focus does not fall to the page's end. Where it goes is decided a moment later: a takeover deletes a
  // subject and creates it again (two revisions), so the row may come right back; if not, the next row has it.
  if (row.tr.contains(document.activeElement)) {
    refocus = { key, next: neighbourKey(row.tr) };
    setTimeout(settleRefocus, REFOCUS_MS);
  }
  forgetAlike(key, row.status);
  warned.delete(key);
  row.tr.remove();
  rows.delete(key);
}

function settleRefocus() {
  const pending = refocus;
  refocus = null;
  if (!pending || !focusLost()) return;
  applyFocusIntent();
  if (!focusLost()) return;
  const back = rows.get(pending.key);
  const next = back && !back.tr.hidden ? back : pending.next && rows.get(pending.next);
  if (next && !next.tr.hidden) focusRow(next.tr); else fallbackFocus();
}

function neighbourOf(tr) {
  let next = tr.nextElementSibling;
  while (next && next.hidden) next = next.nextElementSibling;
  if (next) return next;
  let previous = tr.previousElementSibling;
  while (previous && previous.hidden) previous = previous.previousElementSibling;
  return previous;
}

// --- look-alike emails: the same subject line from the same sender ----------------------------------------------

const signatureOf = (status) => {
  const summary = status.summary || {};
  return summary.subjectLine || summary.sender ? `${summary.subjectLine || ""}\u0000${summary.sender || ""}` : "";
};

function rememberAlike(key, status) {
  const signature = signatureOf(status);
  if (!signature) return;
  const keys = alike.get(signature) || new Set();
  keys.add(key);
  alike.set(signature, keys);
  if (keys.size > 1) for (const other of keys) markAlike(other);
}

function forgetAlike(key, status) {
  const signature = signatureOf(status);
  const keys = alike.get(signature);
  if (!keys) return;
  keys.delete(key);
  if (!keys.size) alike.delete(signature);
  for (const other of keys) markAlike(other);
}

function markAlike(key) {
  const row = rows.get(key);
  const line = row && row.tr.querySelector(".alike");
  if (!line) return;
  const count = (alike.get(signatureOf(row.status)) || new Set()).size;
  const received = (row.status.summary || {}).receivedAt;
  line.hidden = count < 2;
  line.textContent = count < 2 ? "" :
    `Same subject and sender as ${count - 1} other${count > 2 ? "s" : ""} here; this one came in ${received ? clock(when(received), true) : "at a time not given"}`;
}

// --- plain words ------------------------------------------------------------------------------------------

const isAgent = (status) => status.holderKind === "HOLDER_KIND_AGENT";
const when = (stamp) => (stamp ? new Date(stamp) : null);

// A time of day (with the date when not today), kept on one line: "08:22 PM" never breaks after "08:22".
function clock(date, seconds = false) {
  if (!date) return "";
  const today = new Date().toDateString() === date.toDateString();
  const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", ...(seconds ? { second: "2-digit" } : {}) });
  const whole = today ? time : date.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + time;
  return whole.replace(/\s/g, "\u00a0");
}

// An email as a person names it: its subject line in quotes, or, without one, what the coordinator knows.
function nameOf(status) {
  const line = (status.summary || {}).subjectLine;
  return line ? `“${plain(line)}”` : `the ${status.subject.kind === "SUBJECT_KIND_THREAD" ? "conversation" : "message"} ${plain(status.subject.id)}`;
}

// A reply written outside the coordinator (a person in Gmail, a helpdesk): who, when, and what it meant here.
// The sender is only what the message's From line says; the principal that reported it vouches for it.
function outsideWords(reply) {
  const recorded = reply.recordedBy ? ` (as its From line says; recorded by ${reply.recordedBy})` : "";
  return `answered from the mailbox by ${reply.sender || "someone"}${recorded} at ${clock(when(reply.sentAt))}`;
}

function answeredOutside(status) {
  const reply = status.outsideReply;
  if (!reply) return "";
  const words = outsideWords(reply);
  if (status.repliedOutside) {
    const stopped = reply.stoppedHolder ? ` ${reply.stoppedHolder} stopped because a person answered.` : "";
    return `${words[0].toUpperCase()}${words.slice(1)}.${stopped}`;
  }
  const both = { [SENDING]: "both replies go out", [IN_DOUBT]: "check whether this one went out too" }[status.state];
  return `Also ${words}: ${both || "both replies went out"}.`;
}

// The reply rules (docs/design.md#reply-storms): agents stopped on a conversation, automated mail agents leave.
// Both are the coordinator's words for people; a person can still answer.
function stoppedWords(status) {
  if (status.agentsStopped && status.agentsStopped.reason) return status.agentsStopped.reason;
  if (status.automated) return `automated message (${status.automated}): agents leave it`;
  return "";
}

function whatIsHappening(status) {
  const outside = answeredOutside(status);
  if (status.repliedOutside) return outside;
  const stopped = stoppedWords(status);
  if (stopped) return outside ? `${stopped}. ${outside}` : stopped;
  const here = whatIsHappeningHere(status, status.holder);
  return outside ? `${here}. ${outside}` : here;
}

function whatIsHappeningHere(status, holder) {
  switch (status.state) {
    case CLAIMED:
      if (isAgent(status)) return `${holder} (an agent) is writing a reply`;
      return holder === session.me
        ? `You are answering this — until ${clock(when(status.expiresAt))}`
        : `${holder} is answering this — until ${clock(when(status.expiresAt))}`;
    case SENDING:
      return `${holder} is sending the reply right now`;
    case IN_DOUBT:
      return `${isAgent(status) ? "An agent" : holder} started sending and never confirmed: check the Sent folder and tell us`;
    case REPLIED:
      if (status.settledBy) return `${status.settledBy} checked: the reply ${holder} started went out (${clock(when(status.sentAt))})`;
      return status.repliedByHand
        ? `Answered by hand by ${holder} at ${clock(when(status.sentAt))}`
        : `Answered by ${holder} at ${clock(when(status.sentAt))}`;
    default:
      return "";
  }
}

// Who the row credits: the person who settled a send, else the holder.
function whoOf(status) {
  if (status.settledBy) return { name: status.settledBy, kind: "person" };
  return { name: status.holder, kind: isAgent(status) ? "agent" : "person" };
}

function since(status) {
  if (status.state === REPLIED) return when(status.sentAt);
  if (status.state === SENDING || status.state === IN_DOUBT) return when(status.sendStartedAt);
  return when(status.acquiredAt);
}

function minutesAndSeconds(seconds) {
  const m = Math.floor(seconds / 60), s = seconds % 60;
  return m >= 60 ? `${Math.floor(m / 60)} h ${m % 60} min` : `${m}:${String(s).padStart(2, "0")}`;
}

// What the "Time left" cell says, and how loudly: an agent renews its short claim while it works (not an
// emergency: only a missed renewal is worth a look); a person's claim counts down, and warns before it ends.
function timeLeft(status, now) {
  if (status.state === IN_DOUBT || status.agentsStopped) return { text: "waiting for a person", level: "urgent" };
  if (status.state === REPLIED) return { text: "" };
  const end = when(status.state === SENDING ? status.sendDeadline : status.expiresAt);
  if (!end) return { text: "" };
  const seconds = Math.round((end - now) / 1000);
  if (status.state === SENDING) return seconds > 0 ? { text: minutesAndSeconds(seconds) } : { text: "should have finished", level: "soon" };
  if (isAgent(status)) {
    const ttl = Number(status.ttlSeconds) || 0;
    if (!ttl || seconds > ttl / 3) return { text: "kept while it works", level: "renewing", label: "renewed by the agent while it works" };
    return seconds > 0
      ? { text: `not renewed: frees in ${minutesAndSeconds(seconds)}`, level: "soon" }
      : { text: "frees now", level: "soon" };
  }
  if (seconds <= 0) return { text: "ending now", level: "urgent" };
  return { text: minutesAndSeconds(seconds), level: seconds <= WARN_SECONDS ? "soon" : "" };
}

function ago(date, now) {
  if (!date) return "";
  const minutes = Math.floor((now - date) / 60000);
  if (minutes < 1) return "just now";
  if (minutes < 60) return `${minutes} min ago`;
  if (minutes < 1440) return `${Math.floor(minutes / 60)} h ${minutes % 60} min ago`;
  return clock(date);
}

function plainError(error) {
  switch (error.code) {
    case "permission_denied": return "Not allowed: " + error.message;
    case "unauthenticated": return "Your sign-in was refused: " + error.message;
    case "failed_precondition": return "Too late for that: " + error.message;
    case "resource_exhausted": return "Too many requests at once; try again in a moment";
    case "unavailable": return "The coordinator cannot be reached right now";
    case "invalid_argument": return "That was not accepted: " + error.message;
    default: return error.message || String(error);
  }
}

// --- the table -----------------------------------------------------------------------------------------------

// What a person does with a claim of their own: on its row only (the list of emails found starts things).
const OWN_CLAIM_ACTIONS = new Set(["I replied", "Keep it longer", "Give it back"]);

const LABELS = { email: "Email", what: "What is happening", holder: "Who", since: "Since", left: "Time left", note: "Note", actions: "Actions" };

function cell(tr, className, text) {
  const td = document.createElement("td");
  td.className = className;
  td.setAttribute("role", "cell");
  td.dataset.label = LABELS[className.split(" ")[0]];
  if (text !== undefined) td.textContent = text;
  tr.appendChild(td);
  return td;
}

// Text from outside (an email's subject line and sender, ids, names, notes) is shown without the characters
// that change how text is shown without being seen (bidirectional overrides, isolates and marks, zero-width
// spaces: "Invoice \u202Egnp.exe" would read "Invoice exe.png"), as the coordinator stores it since it drops
// them (proto: MessageSummary); older records may still have them. Joiners stay (emoji, Persian, Indic).
const INVISIBLE = /(?![\u200c\u200d])[\p{Cf}\u2028\u2029]/gu;
function plain(text) { return (text || "").replace(INVISIBLE, ""); }

// Each piece in an isolate of its own (<bdi>): a right-to-left subject line cannot reorder what is beside it.
function isolated(text) {
  const bdi = document.createElement("bdi");
  bdi.textContent = plain(text);
  return bdi;
}

function line(className, ...pieces) {
  const div = document.createElement("div");
  div.className = className;
  pieces.filter(Boolean).forEach((piece, index) => div.append(...(index ? [" · "] : []), isolated(piece)));
  return div;
}

function render(row) {
  const { status, tr } = row;
  const now = Date.now();
  // A row re-rendered under the keyboard (an agent renews every few seconds) keeps the focus where it was.
  const focusedLabel = tr.contains(document.activeElement) && document.activeElement !== tr ? document.activeElement.textContent : null;
  const rowFocused = document.activeElement === tr;
  tr.dataset.state = status.state;
  tr.dataset.key = keyOf(status.subject);
  tr.replaceChildren();
  const email = cell(tr, "email");
  const summary = status.summary || {};
  const subject = document.createElement("div");
  subject.className = "subject";
  subject.append(summary.subjectLine ? isolated(summary.subjectLine) : "(no subject given)");
  const kind = status.subject.kind === "SUBJECT_KIND_THREAD" ? "conversation" : "message";
  const where = `${kind} ${plain(status.subject.id)}` + (session.mailboxes.length > 1 ? ` in ${plain(status.subject.mailbox)}` : "");
  email.append(
    subject,
    line("sender", summary.sender, summary.receivedAt ? "came in " + clock(when(summary.receivedAt)) : ""),
    line("id", where),
  );
  const alikeLine = document.createElement("div");
  alikeLine.className = "alike";
  alikeLine.hidden = true;
  email.append(alikeLine);
  const what = cell(tr, "what");
  const dot = document.createElement("span");
  dot.className = "dot";
  dot.setAttribute("aria-hidden", "true");
  what.append(dot, plain(whatIsHappening(status)));
  const credited = whoOf(status);
  const who = cell(tr, "holder");
  who.append(isolated(credited.name));
  const kindLine = document.createElement("div");
  kindLine.className = "kind";
  kindLine.textContent = credited.kind;
  who.appendChild(kindLine);
  cell(tr, "since", ago(since(status), now));
  const left = timeLeft(status, now);
  const leftCell = cell(tr, "left", left.text);
  showTimeLeft(tr, leftCell, left, status);
  const note = cell(tr, "note");
  if (status.note) note.append(isolated(status.note));
  const actions = cell(tr, "actions");
  const { offered, why } = actionsFor(status);
  addButtons(actions, offered);
  if (why) {
    const reason = document.createElement("span");
    reason.className = "why";
    reason.textContent = why;
    actions.appendChild(reason);
  }
  tr.hidden = !visible(status);
  markAlike(tr.dataset.key);
  if (focusedLabel !== null) {
    const same = [...tr.querySelectorAll("button")].find((button) => button.textContent === focusedLabel);
    (same || tr.querySelector("button") || tr).focus();
  } else if (rowFocused) tr.focus();
}

function addButtons(parent, offered) {
  for (const [label, run] of offered) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.addEventListener("click", () => act(button, run));
    parent.appendChild(button);
  }
}

function showTimeLeft(tr, leftCell, left, status) {
  leftCell.className = "left" + (left.level ? " " + left.level : "");
  leftCell.setAttribute("aria-label", left.text ? "time left: " + (left.label || left.text) : "");
  tr.classList.toggle("ending", isMine(status) && status.state === CLAIMED && left.level !== "" && left.level !== undefined);
}

const isMine = (status) => status.holder === session.me && !isAgent(status);

function visible(status) {
  if (!shown.has(status.state)) return false;
  if (!search) return true;
  const summary = status.summary || {};
  return [summary.subjectLine, summary.sender, status.holder, status.settledBy, status.subject.id, status.note]
    .some((text) => text && text.toLowerCase().includes(search));
}

// The actions the signed-in person may take on a row (the coordinator checks each call again), and, when one
// that the row's state would allow is not offered to them, why, in words for them.
function actionsFor(status) {
  const subject = status.subject;
  const token = Number(status.fencingToken);
  const offered = [];
  let why = "";
  if (status.state === CLAIMED && isMine(status)) {
    offered.push(["I replied", () => markReplied(status, token)]);
    offered.push(["Keep it longer", () => keep(status, token)]);
    offered.push(["Give it back", () => release(status, token)]);
  } else if (status.state === CLAIMED && isAgent(status)) {
    if (session.kind !== "human") why = "Only a person can take over from an agent.";
    else if (!may("takeover")) why = "You are not allowed to take over from agents: ask your administrator.";
    else offered.push(["Take over", () => takeover(status)]);
  } else if (status.state === CLAIMED) {
    if (mayTakeOver()) offered.push([`Take it from ${plain(status.holder)}`, () => takeFromColleague(status)]);
    else why = `Only ${status.holder} can say it is answered or give it back.`;
  }
  if (status.state === REPLIED && status.repliedOutside) {
    if (session.kind === "human" && may("resolve")) offered.push(["It was not answered", () => undoOutside(status)]);
    else why = "If that reply did not answer this email, someone allowed to settle sends can make it answerable again.";
  }
  if (status.state === IN_DOUBT) {
    if (may("resolve")) {
      offered.push(["It was sent", () => resolve(subject, "OUTCOME_SENT")]);
      offered.push(["It was not sent", () => resolve(subject, "OUTCOME_NOT_SENT")]);
    } else {
      why = "Someone allowed to settle unconfirmed sends must check the Sent folder.";
    }
  }
  return { offered, why };
}

async function act(button, run) {
  // Busy, not disabled: a disabled button loses the focus, which a dialog it opens could then not give back.
  if (button.getAttribute("aria-disabled") === "true") return;
  button.setAttribute("aria-disabled", "true");
  const tr = button.closest("tr");
  try {
    const answer = await run();
    if (answer) say(answer.text || answer, answer.warning);
    if (answer && answer.focus) {
      focusIntent = { ...answer.focus, origin: button, next: tr && neighbourKey(tr), until: Date.now() + FOCUS_WAIT_MS };
    }
  } catch (error) {
    say(plainError(error));
  } finally {
    button.removeAttribute("aria-disabled");
  }
  applyFocusIntent();
  // Whatever happened, the focus never drops to the page: back to the row the action was on, or its neighbour.
  if (focusLost()) {
    if (tr && tr.isConnected && !tr.hidden) focusRow(tr, button.textContent);
    else if (button.isConnected && !button.closest("[hidden]")) button.focus();
    else if (!focusIntent) fallbackFocus();
  }
}

// The focus is nowhere a person can see: on the page itself, or on something hidden (a closed dialog's button).
function focusLost() {
  const element = document.activeElement;
  return !element || element === document.body || !element.isConnected || element.closest("dialog:not([open]), [hidden]") !== null;
}

function neighbourKey(tr) {
  const next = neighbourOf(tr);
  return next ? next.dataset.key : null;
}

function focusRow(tr, label = "") {
  const buttons = [...tr.querySelectorAll("button")];
  const target = buttons.find((button) => button.textContent === label) || buttons[0];
  if (target) { target.focus(); return; }
  for (const other of document.querySelectorAll("#claims tbody tr")) other.tabIndex = -1;
  tr.tabIndex = 0;
  tr.focus();
}

function fallbackFocus() {
  const first = document.querySelector("#claims tbody tr:not([hidden])");
  if (first) focusRow(first); else $("#search").focus();
}

// The next sensible control once an action's change has come through: a button of the row it made (say "I
// replied" on a message just taken), the row itself when it has none left, or, when the row went away, the next.
function applyFocusIntent() {
  const intent = focusIntent;
  if (!intent) return;
  const row = rows.get(intent.key);
  const visibleRow = row && !row.tr.hidden ? row : null;
  // A person who moved on meanwhile (typed in a field, went to another row) keeps the focus they chose.
  if (!focusLost() && !(intent.origin && intent.origin.contains(document.activeElement)) &&
      !(visibleRow && visibleRow.tr.contains(document.activeElement))) {
    focusIntent = null;
    return;
  }
  if (intent.want === "gone" && !visibleRow) {
    focusIntent = null;
    const next = intent.next && rows.get(intent.next);
    if (next && !next.tr.hidden) focusRow(next.tr); else fallbackFocus();
    return;
  }
  if (visibleRow && intent.want === "button") {
    const button = [...visibleRow.tr.querySelectorAll("button")].find((candidate) => candidate.textContent === intent.label);
    if (button) { focusIntent = null; button.focus(); return; }
  }
  if (visibleRow && intent.want === "row" && visibleRow.status.state === intent.state) {
    focusIntent = null;
    focusRow(visibleRow.tr, "");
    return;
  }
  if (Date.now() > intent.until) {
    focusIntent = null;
    if (!focusLost()) return;
    if (visibleRow) focusRow(visibleRow.tr, intent.label); else fallbackFocus();
  }
}

function scheduleReorder() {
  if (reorderPending) return;
  reorderPending = true;
  requestAnimationFrame(() => {
    reorderPending = false;
    const ordered = [...rows.values()].sort(before);
    const body = $("#claims tbody");
    const focused = document.activeElement;
    const fragment = document.createDocumentFragment();
    for (const row of ordered) fragment.appendChild(row.tr);
    body.appendChild(fragment);
    if (focused && body.contains(focused)) focused.focus();
    refreshCounts();
    rovingFocus();
    applyFocusIntent();
  });
}

function refreshCounts() {
  const counts = {};
  let visibleRows = 0;
  for (const { status, tr } of rows.values()) {
    counts[status.state] = (counts[status.state] || 0) + 1;
    if (!tr.hidden) visibleRows++;
  }
  for (const span of document.querySelectorAll("[data-count]")) span.textContent = `(${counts[span.dataset.count] || 0})`;
  $("#empty").hidden = visibleRows > 0;
}

function tick() {
  const now = Date.now();
  for (const [key, { status, tr }] of rows) {
    const left = timeLeft(status, now);
    if (isMine(status) && status.state === CLAIMED && left.level && !warned.has(key)) {
      warned.add(key);
      say(`Your claim on ${nameOf(status)} ends in ${left.text}: “Keep it longer” if you are still writing, ` +
        "or “Give it back”. When it ends, an agent may answer it.", true);
    }
    if (tr.hidden) continue;
    const leftCell = tr.querySelector(".left");
    if (leftCell && leftCell.textContent !== left.text) {
      leftCell.textContent = left.text;
      showTimeLeft(tr, leftCell, left, status);
    }
  }
}

// --- actions ---------------------------------------------------------------------------------------------

// A question in the dialog, with a note field when one is asked for; resolves to the note ("" when none was
// written) or null when cancelled. The focus starts in the first field (the note), else on the confirm button.
function ask(text, { ok = "Confirm", note = "Note for the others (optional)" } = {}) {
  const dialog = $("#ask");
  dialog.returnValue = "";
  $("#ask-text").textContent = text;
  $("#ask-ok").textContent = ok;
  $("#ask-note-label").hidden = !note;
  $("#ask-note-words").textContent = note || "";
  $("#ask-note").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? $("#ask-note").value.trim() : null), { once: true });
    dialog.showModal();
    (note ? $("#ask-note") : $("#ask-ok")).focus();
  });
}

const toSubjectJson = (subject) => ({ mailbox: subject.mailbox, kind: subject.kind, id: subject.id });

async function claim(subject, summary) {
  const answer = await call("ClaimReply", { requestId: requestId(), subject: toSubjectJson(subject), ttlSeconds: CLAIM_SECONDS, ...(summary ? { summary } : {}) });
  const key = keyOf(subject);
  if (answer.result === "GRANTED") {
    session.me = answer.status.holder;
    return { text: `It is yours now, for ${CLAIM_SECONDS / 60} minutes (you can keep it longer): nobody else will answer it.`, focus: { key, want: "button", label: "I replied" } };
  }
  if (answer.result === "HELD") return `${answer.status.holder} is already answering it.`;
  return "It has already been answered (or is being sent).";
}

async function takeover(status, fromPerson = "") {
  const answer = await call("Takeover", { requestId: requestId(), subject: toSubjectJson(status.subject), ttlSeconds: CLAIM_SECONDS, ...(fromPerson ? { fromPerson } : {}) });
  const focus = { key: keyOf(status.subject), want: "button", label: "I replied" };
  if (answer.result === "TAKEN_OVER" || answer.result === "GRANTED") {
    session.me = answer.status.holder;
    const previous = answer.previousHolder;
    if (!previous) return { text: "You are answering it now.", focus };
    return {
      text: fromPerson
        ? `You are answering it now; ${previous} no longer has it, and what ${previous} sends for it is refused.`
        : `You are answering it now; ${previous} can no longer send it and will stop at its next step.`,
      focus,
    };
  }
  if (answer.result === "HELD") return `${answer.status.holder} (a person) is answering it: it was not taken from them.`;
  return "Too late: the reply is already being sent or went out.";
}

async function takeFromColleague(status) {
  const holder = plain(status.holder);
  const confirmed = await ask(`Take ${nameOf(status)} from ${holder}? ${holder} has been answering it since ${clock(when(status.acquiredAt))}. ` +
    `${holder}'s claim ends now: if ${holder} is still writing, "I replied" and sending are refused for ${holder}.`, { ok: `Take it from ${holder}`, note: null });
  if (confirmed === null) return "";
  return takeover(status, status.holder);
}

async function markReplied(status, token) {
  const note = await ask("You answered this email yourself (in your mail app, or by phone)? Agents will then leave it alone.",
    { ok: "Yes, I answered it", note: "How you answered, for the others (optional)" });
  if (note === null) return "";
  const answer = await call("MarkReplied", { requestId: requestId(), subject: toSubjectJson(status.subject), fencingToken: token, note });
  return answer.result === "FENCE_RESULT_OK"
    ? { text: "Recorded as answered by you.", focus: { key: keyOf(status.subject), want: "row", state: REPLIED } }
    : "It was no longer yours (your time ran out or someone took it over): nothing was recorded.";
}

async function keep(status, token) {
  const answer = await call("RenewClaim", { requestId: requestId(), subject: toSubjectJson(status.subject), fencingToken: token, ttlSeconds: CLAIM_SECONDS });
  if (answer.result !== "FENCE_RESULT_OK") return "It was no longer yours (your time ran out or someone took it over).";
  return { text: `It is yours for ${CLAIM_SECONDS / 60} more minutes.`, focus: { key: keyOf(status.subject), want: "button", label: "Keep it longer" } };
}

async function release(status, token) {
  const answer = await call("ReleaseClaim", { requestId: requestId(), subject: toSubjectJson(status.subject), fencingToken: token });
  return answer.result === "FENCE_RESULT_OK"
    ? { text: "Given back: someone else may answer it.", focus: { key: keyOf(status.subject), want: "gone" } }
    : "It was no longer yours.";
}

async function resolve(subject, outcome) {
  const sent = outcome === "OUTCOME_SENT";
  const note = await ask(sent
    ? "You found the reply in the mailbox's Sent folder? It will be recorded as answered, with your name."
    : "You checked the mailbox's Sent folder and the reply is not there? The email will be free to answer again.",
  { ok: sent ? "Yes, it was sent" : "Yes, it was not sent", note: "What you checked, for the others (optional)" });
  if (note === null) return "";
  await call("ResolveInDoubt", { requestId: requestId(), subject: toSubjectJson(subject), outcome, note });
  const key = keyOf(subject);
  return sent
    ? { text: "Recorded as sent, checked by you.", focus: { key, want: "row", state: REPLIED } }
    : { text: "Recorded as not sent: it can be answered again.", focus: { key, want: "gone" } };
}

async function undoOutside(status) {
  const reply = status.outsideReply || {};
  const note = await ask(`The coordinator shows ${nameOf(status)} as ${outsideWords(reply)}. That reply did not answer it? ` +
    "The email will be free to answer again, and your name recorded with this.",
  { ok: "Yes, it was not answered", note: "What you checked, for the others (optional)" });
  if (note === null) return "";
  const answer = await call("UndoOutsideReply", { requestId: requestId(), subject: toSubjectJson(status.subject), note });
  return {
    text: `Undone, with your name, at ${clock(when(answer.undoneAt))}: that reply no longer counts as the answer to ` +
      `${nameOf(status)}, and it can be answered again.`,
    focus: { key: keyOf(status.subject), want: "gone" },
  };
}

// --- answering an email yourself: the mailbox's recent emails, as the coordinator saw them -----------------------

async function findRecent(event) {
  if (event) event.preventDefault();
  const query = $("#answer-query").value.trim();
  const mailboxes = session.mailboxes.length > 1 && $("#answer-mailbox").value ? [$("#answer-mailbox").value] : session.mailboxes;
  $("#answer-note").textContent = "Looking…";
  try {
    const answers = await Promise.all(mailboxes.map((mailbox) => call("ListRecentMessages", { mailbox, query, pageSize: 20 })));
    recent = answers.flatMap((answer) => answer.messages || [])
      .sort((a, b) => (when(b.firstSeenAt) || 0) - (when(a.firstSeenAt) || 0));
    $("#answer-note").textContent = recent.length
      ? `${recent.length} email${recent.length > 1 ? "s" : ""} ${query ? `matching “${query}”` : "that came in most recently"}:`
      : query ? `No email that came in today matches “${query}”.` : "No email came in today that the coordinator knows of.";
  } catch (error) {
    recent = [];
    $("#answer-note").textContent = plainError(error);
  }
  showRecent();
}

// One email a person may answer (found, or waiting for a person): what it is, what is happening, what they can do.
function emailItem(message, status, stateText) {
  const summary = message.summary || {};
  const item = document.createElement("li");
  item.dataset.key = keyOf(message.subject);
  const found = document.createElement("div");
  found.className = "found";
  const subject = document.createElement("div");
  subject.className = "subject";
  subject.append(summary.subjectLine ? isolated(summary.subjectLine) : `(no subject given) message ${plain(message.subject.id)}`);
  const received = summary.receivedAt || message.firstSeenAt;
  found.append(subject, line("sender", summary.sender, received ? "came in " + clock(when(received)) : ""));
  const state = document.createElement("div");
  state.className = "state";
  state.textContent = stateText;
  found.append(state);
  item.append(found);
  let offered = [];
  if (status.state === FREE) offered = [["I'm answering this", () => claim(message.subject, message.summary)]];
  else offered = actionsFor(status).offered.filter(([label]) => !OWN_CLAIM_ACTIONS.has(label));
  addButtons(item, offered);
  return item;
}

// --- waiting for a person: what agents leave (docs/design.md#reply-storms) ----------------------------------------

// Conversations where agents are stopped stay until their reply budget frees, whoever holds them; automated mail
// stays while nobody has claimed or answered it. Both come from ListRecentMessages (the newest 100 per mailbox).
async function refreshWaiting() {
  waitingPending = false;
  try {
    const answers = await Promise.all(session.mailboxes.map((mailbox) => call("ListRecentMessages", { mailbox, pageSize: 100 })));
    waiting = answers.flatMap((answer) => [
      ...(answer.agentsStopped || []).map((message) => ({ message, stopped: message.agentsStopped })),
      ...(answer.messages || []).filter((message) => message.automated).map((message) => ({ message, stopped: null })),
    ]);
  } catch (error) {
    return; // the next refresh tries again; the board's own stream says when the coordinator is unreachable
  }
  showWaiting();
}

function concernsWaiting(status) {
  const key = keyOf(status.subject);
  return Boolean(status.agentsStopped) || waiting.some(({ message }) => keyOf(message.subject) === key);
}

function scheduleWaiting() {
  if (waitingPending) return;
  waitingPending = true;
  setTimeout(refreshWaiting, 500);
}

function automatedWords(reason) { return `automated message (${plain(reason)}): agents leave it`; }

function showWaiting() {
  const list = $("#waiting-list");
  if (!list) return;
  const focusedKey = list.contains(document.activeElement) ? document.activeElement.closest("li")?.dataset.key : null;
  const items = [];
  for (const { message, stopped } of waiting) {
    const row = rows.get(keyOf(message.subject));
    const status = row ? row.status : { subject: message.subject, state: FREE, summary: message.summary };
    if (!stopped && status.state !== FREE) continue; // someone took the automated message up: it is on the board
    const now = status.state === FREE ? " Nobody is answering it."
      : status.agentsStopped ? "" : ` Now: ${plain(whatIsHappening(status))}.`;
    const text = stopped
      ? `${plain(stopped.reason)}. ${plain(message.seenBy)} was stopped at ${clock(when(message.firstSeenAt))}; ` +
        `agents may answer again from ${clock(when(stopped.freesAt))}.${now}`
      : `${automatedWords(message.automated)}; you can still answer it.`;
    const item = emailItem(message, status, text);
    item.classList.add(stopped ? "stopped" : "automated");
    items.push(item);
  }
  list.replaceChildren(...items);
  $("#waiting").hidden = items.length === 0;
  $("#waiting-count").textContent = String(items.length);
  if (focusedKey && !focusIntent) {
    const again = list.querySelector(`li[data-key="${CSS.escape(focusedKey)}"] button`);
    if (again) again.focus();
  }
}

// What can be done with each email found, from what the board shows about it now.
function showRecent() {
  const list = $("#answer-results");
  if (!list || !$("#answer").open) return;
  const focusedKey = list.contains(document.activeElement) ? document.activeElement.closest("li")?.dataset.key : null;
  list.replaceChildren(...recent.map((message) => {
    const key = keyOf(message.subject);
    const row = rows.get(key);
    const status = row ? row.status : { subject: message.subject, state: FREE, summary: message.summary };
    const reopened = undone.get(key);
    const automated = message.automated ? `${automatedWords(message.automated)}; you can still answer it.` : "";
    return emailItem(message, status, status.state !== FREE ? plain(whatIsHappening(status)) + "." : reopened
      ? `Nobody is answering it: ${plain(reopened.by)} undid the reply from the mailbox recorded for it at ${clock(when(reopened.at))}.`
      : automated || "Nobody is answering it.");
  }));
  if (focusedKey && !focusIntent) {
    const again = list.querySelector(`li[data-key="${CSS.escape(focusedKey)}"] button`);
    if (again) again.focus();
  }
}

// --- the page ------------------------------------------------------------------------------------------------

function say(text, warning = false) {
  const status = $("#status-line");
  status.textContent = text;
  status.classList.toggle("warning", Boolean(warning && text));
}
function unsay(text) { if ($("#status-line").textContent === text) say(""); }

function rovingFocus() {
  const visibleRows = [...document.querySelectorAll("#claims tbody tr:not([hidden])")];
  if (!visibleRows.some((tr) => tr.tabIndex === 0) && visibleRows.length) visibleRows[0].tabIndex = 0;
}

function onKey(event) {
  if (event.target.matches("input, select, textarea") || $("#ask").open) return;
  if (event.key === "/") { event.preventDefault(); $("#search").focus(); return; }
  const tr = event.target.closest && event.target.closest("#claims tbody tr");
  if (!tr) return;
  const visibleRows = [...document.querySelectorAll("#claims tbody tr:not([hidden])")];
  const index = visibleRows.indexOf(tr);
  let next = null;
  if (event.key === "ArrowDown" || event.key === "j") next = visibleRows[index + 1];
  if (event.key === "ArrowUp" || event.key === "k") next = visibleRows[index - 1];
  if (event.key === "Home") next = visibleRows[0];
  if (event.key === "End") next = visibleRows[visibleRows.length - 1];
  if (event.key === "Enter" && event.target === tr) {
    const button = tr.querySelector("button");
    if (button) { event.preventDefault(); button.focus(); } // focus only: acting is a second, deliberate Enter
  }
  if (next) {
    event.preventDefault();
    tr.tabIndex = -1;
    next.tabIndex = 0;
    next.focus();
  }
}

async function signIn(event) {
  event.preventDefault();
  session.token = $("#token").value.trim();
  session.name = $("#name").value.trim();
  session.mailboxes = $("#mailboxes").value.split(",").map((m) => m.trim()).filter(Boolean);
  const error = $("#signin-error");
  error.textContent = "";
  if (!session.token && !session.name) { error.textContent = "Give your access token (or, on a test coordinator, your name)."; return; }
  try {
    await whoAmI();
  } catch (failure) {
    error.textContent = plainError(failure);
    return;
  }
  for (const mailbox of session.mailboxes) {
    try {
      await call("ListClaims", { mailbox, pageSize: 1 });
    } catch (failure) {
      error.textContent = failure.code === "permission_denied"
        ? `You are not allowed to see the mailbox ${mailbox}. ${failure.message}`
        : plainError(failure);
      return;
    }
  }
  sessionStorage.setItem("board", JSON.stringify({ token: session.token, name: session.name, mailboxes: session.mailboxes }));
  start();
}

function start() {
  $("#signin").hidden = true;
  $("#board").hidden = false;
  const who = $("#who");
  who.hidden = false;
  const rights = [mayTakeOver() ? "may take over from agents and colleagues" : "",
    may("resolve") ? "may settle unconfirmed sends and undo a wrong reply from the mailbox" : ""].filter(Boolean);
  who.textContent = `Signed in as ${session.me}` + (rights.length ? ` (${rights.join(", ")})` : "") +
    ` · ${session.mailboxes.join(", ")}`;
  const select = $("#answer-mailbox");
  select.replaceChildren(new Option("every mailbox", ""), ...session.mailboxes.map((mailbox) => new Option(mailbox, mailbox)));
  select.hidden = session.mailboxes.length < 2;
  refreshCounts();
  for (const mailbox of session.mailboxes) watch(mailbox);
  refreshWaiting();
  setInterval(refreshWaiting, WAITING_REFRESH_MS);
  setInterval(tick, 1000);
  tick();
}

function init() {
  const params = new URLSearchParams(location.search);
  const saved = JSON.parse(sessionStorage.getItem("board") || "null");
  $("#mailboxes").value = params.get("mailbox") || (saved ? saved.mailboxes.join(", ") : "");
  if (params.get("name")) $("#name").value = params.get("name");
  $("#signin").addEventListener("submit", signIn);
  $("#filters").addEventListener("change", (event) => {
    if (event.target.checked) shown.add(event.target.value); else shown.delete(event.target.value);
    for (const row of rows.values()) row.tr.hidden = !visible(row.status);
    refreshCounts();
    rovingFocus();
  });
  $("#search").addEventListener("input", (event) => {
    search = event.target.value.trim().toLowerCase();
    for (const row of rows.values()) row.tr.hidden = !visible(row.status);
    refreshCounts();
    rovingFocus();
  });
  $("#answer-form").addEventListener("submit", findRecent);
  // Opening the panel lists the newest emails at once: a person often answers the one that just came in.
  $("#answer").addEventListener("toggle", () => {
    if (!$("#answer").open) return;
    $("#answer-query").focus();
    findRecent();
  });
  // Cancel is not a submit button, so that Enter in a field of the dialog confirms.
  $("#ask-cancel").addEventListener("click", () => $("#ask").close("cancel"));
  document.addEventListener("keydown", onKey);
  if (saved && !params.get("mailbox")) {
    Object.assign(session, saved);
    whoAmI().then(start, (failure) => { $("#signin-error").textContent = plainError(failure); });
  }
}

init();
