// The claims board: who is answering which email, live. Plain JavaScript, no build step, nothing from
// elsewhere: it talks to the coordinator's HTTP/JSON API (the Connect protocol) on the page's own origin.
"use strict";

const API = "/inbox.coordinator.v1.Coordinator/";
const CLAIMED = "SUBJECT_STATE_CLAIMED", SENDING = "SUBJECT_STATE_SENDING";
const IN_DOUBT = "SUBJECT_STATE_IN_DOUBT", REPLIED = "SUBJECT_STATE_REPLIED", FREE = "SUBJECT_STATE_FREE";
const URGENCY = { [IN_DOUBT]: 0, [SENDING]: 1, [CLAIMED]: 2, [REPLIED]: 3 };
const CLAIM_SECONDS = 900; // a person's claim: long enough to write a reply; given back when done

const $ = (selector) => document.querySelector(selector);
// me, kind and roles: who the coordinator says the signed-in person is (GetCaller), to offer only what they may do.
const session = { token: "", name: "", me: "", kind: "", roles: [], mailboxes: [] };
const rows = new Map(); // "mailbox\u0000kind\u0000id" -> { status, tr }
const seen = new Map(); // mailbox -> the revision of the last snapshot or event: a reconnection resumes there
const shown = new Set([IN_DOUBT, CLAIMED, SENDING, REPLIED]);
let search = "";
let reorderPending = false;

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
    for (const [key, row] of rows) if (row.status.subject.mailbox === mailbox) { row.tr.remove(); rows.delete(key); }
    for (const status of message.snapshot.subjects || []) upsert(status, false);
    scheduleReorder(); // one sort for the whole snapshot
  } else if (message.event) {
    const status = message.event.status;
    const row = rows.get(keyOf(status.subject));
    if (status.state === FREE) {
      if (row) { row.tr.remove(); rows.delete(keyOf(status.subject)); }
    } else {
      place(upsert(status, true));
    }
    refreshCounts();
    rovingFocus();
  }
}

const before = (a, b) =>
  URGENCY[a.status.state] - URGENCY[b.status.state] || (since(b.status) || 0) - (since(a.status) || 0);

// One changed row moves to its place among the others, without touching them (a thousand rows stay cheap).
function place(row) {
  const body = $("#claims tbody");
  row.tr.remove();
  const others = body.children;
  let low = 0, high = others.length;
  while (low < high) {
    const middle = (low + high) >> 1;
    if (before(rows.get(others[middle].dataset.key), row) <= 0) low = middle + 1; else high = middle;
  }
  body.insertBefore(row.tr, others[low] || null);
}

function upsert(status, fresh) {
  const key = keyOf(status.subject);
  let row = rows.get(key);
  if (!row) {
    const tr = document.createElement("tr");
    tr.tabIndex = -1;
    row = { status, tr };
    rows.set(key, row);
  }
  row.status = status;
  render(row);
  if (fresh && row.tr.animate) row.tr.animate([{ background: "#fff7d6" }, { background: "transparent" }], 1500);
  return row;
}

// --- plain words ------------------------------------------------------------------------------------------

const isAgent = (status) => status.holderKind === "HOLDER_KIND_AGENT";
const when = (stamp) => (stamp ? new Date(stamp) : null);

function clock(date) {
  if (!date) return "";
  const today = new Date().toDateString() === date.toDateString();
  const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  return today ? time : date.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + time;
}

// A reply written outside the coordinator (a person in Gmail, a helpdesk): who, when, and what it meant here.
function answeredOutside(status) {
  const reply = status.outsideReply;
  if (!reply) return "";
  const words = `answered from the mailbox by ${reply.sender || "someone"} at ${clock(when(reply.sentAt))}`;
  if (status.repliedOutside) {
    const stopped = reply.stoppedHolder ? ` ${reply.stoppedHolder} stopped because a person answered.` : "";
    return `${words[0].toUpperCase()}${words.slice(1)}.${stopped}`;
  }
  const both = { [SENDING]: "both replies go out", [IN_DOUBT]: "check whether this one went out too" }[status.state];
  return `Also ${words}: ${both || "both replies went out"}.`;
}

function whatIsHappening(status) {
  const outside = answeredOutside(status);
  if (status.repliedOutside) return outside;
  const here = whatIsHappeningHere(status, status.holder);
  return outside ? `${here}. ${outside}` : here;
}

function whatIsHappeningHere(status, holder) {
  switch (status.state) {
    case CLAIMED:
      return isAgent(status)
        ? `${holder} (an agent) is writing a reply — until ${clock(when(status.expiresAt))}`
        : `${holder} is answering this — until ${clock(when(status.expiresAt))}`;
    case SENDING:
      return `${holder} is sending the reply right now`;
    case IN_DOUBT:
      return `${isAgent(status) ? "An agent" : holder} started sending and never confirmed: check the Sent folder and tell us`;
    case REPLIED:
      return status.repliedByHand
        ? `Answered by hand by ${holder} at ${clock(when(status.sentAt))}`
        : `Answered by ${holder} at ${clock(when(status.sentAt))}`;
    default:
      return "";
  }
}

function since(status) {
  if (status.state === REPLIED) return when(status.sentAt);
  if (status.state === SENDING || status.state === IN_DOUBT) return when(status.sendStartedAt);
  return when(status.acquiredAt);
}

function timeLeft(status, now) {
  if (status.state === IN_DOUBT) return { text: "waiting for a person", soon: true };
  if (status.state === REPLIED) return { text: "" };
  const end = when(status.state === SENDING ? status.sendDeadline : status.expiresAt);
  if (!end) return { text: "" };
  const seconds = Math.round((end - now) / 1000);
  if (seconds <= 0) return { text: status.state === SENDING ? "should have finished" : "ending now", soon: true };
  const m = Math.floor(seconds / 60), s = seconds % 60;
  const text = m >= 60 ? `${Math.floor(m / 60)} h ${m % 60} min` : `${m}:${String(s).padStart(2, "0")}`;
  return { text, soon: seconds < 60 };
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

function cell(tr, className, text) {
  const td = document.createElement("td");
  td.className = className;
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

function render(row) {
  const { status, tr } = row;
  const now = Date.now();
  tr.dataset.state = status.state;
  tr.dataset.key = keyOf(status.subject);
  tr.replaceChildren();
  const email = cell(tr, "email");
  const summary = status.summary || {};
  const subject = document.createElement("div");
  subject.className = "subject";
  subject.append(summary.subjectLine ? isolated(summary.subjectLine) : "(no subject given)");
  const sender = document.createElement("div");
  sender.className = "sender";
  const where = `${status.subject.kind === "SUBJECT_KIND_THREAD" ? "conversation" : "message"} ${plain(status.subject.id)}` +
    (session.mailboxes.length > 1 ? ` in ${plain(status.subject.mailbox)}` : "");
  const pieces = [summary.sender, summary.receivedAt ? clock(when(summary.receivedAt)) : "", where].filter(Boolean);
  pieces.forEach((piece, index) => sender.append(...(index ? [" · "] : []), isolated(piece)));
  email.title = where;
  email.append(subject, sender);
  cell(tr, "what", plain(whatIsHappening(status)));
  const who = cell(tr, "holder");
  who.append(isolated(status.holder));
  const kind = document.createElement("div");
  kind.className = "kind";
  kind.textContent = isAgent(status) ? "agent" : "person";
  who.appendChild(kind);
  cell(tr, "since", ago(since(status), now));
  const left = timeLeft(status, now);
  const leftCell = cell(tr, "left" + (left.soon ? " soon" : ""), left.text);
  leftCell.setAttribute("aria-label", left.text ? "time left: " + left.text : "");
  cell(tr, "note").append(isolated(status.note));
  const actions = cell(tr, "actions");
  const { offered, why } = actionsFor(status);
  for (const [label, run] of offered) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.addEventListener("click", () => act(button, run));
    actions.appendChild(button);
  }
  if (why) {
    const reason = document.createElement("span");
    reason.className = "why";
    reason.textContent = why;
    actions.appendChild(reason);
  }
  tr.hidden = !visible(status);
}

function visible(status) {
  if (!shown.has(status.state)) return false;
  if (!search) return true;
  const summary = status.summary || {};
  return [summary.subjectLine, summary.sender, status.holder, status.subject.id, status.note]
    .some((text) => text && text.toLowerCase().includes(search));
}

// The actions the signed-in person may take on a row (the coordinator checks each call again), and, when one
// that the row's state would allow is not offered to them, why, in words for them.
function actionsFor(status) {
  const subject = status.subject;
  const token = Number(status.fencingToken);
  const mine = status.holder === session.me;
  const offered = [];
  let why = "";
  if (status.state === CLAIMED && mine) {
    offered.push(["I replied", () => markReplied(subject, token)]);
    offered.push(["Give it back", () => release(subject, token)]);
  } else if (status.state === CLAIMED && isAgent(status)) {
    if (session.kind !== "human") why = "Only a person can take over from an agent.";
    else if (!may("takeover")) why = "You are not allowed to take over from agents: ask your administrator.";
    else offered.push(["Take over", () => takeover(subject)]);
  } else if (status.state === CLAIMED) {
    why = `Only ${status.holder} can say it is answered or give it back.`;
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
  button.disabled = true;
  try { say(await run()); } catch (error) { say(plainError(error)); } finally { button.disabled = false; }
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
  for (const { status, tr } of rows.values()) {
    if (tr.hidden) continue;
    const left = timeLeft(status, now);
    const leftCell = tr.querySelector(".left");
    if (leftCell && leftCell.textContent !== left.text) {
      leftCell.textContent = left.text;
      leftCell.classList.toggle("soon", Boolean(left.soon));
    }
  }
}

// --- actions ---------------------------------------------------------------------------------------------

function ask(text, withSentId) {
  const dialog = $("#ask");
  dialog.returnValue = "";
  $("#ask-text").textContent = text;
  $("#ask-sent-label").hidden = !withSentId;
  $("#ask-sent").value = "";
  $("#ask-note").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"
      ? { sentMessageId: $("#ask-sent").value.trim(), note: $("#ask-note").value.trim() } : null), { once: true });
    dialog.showModal();
    $("#ask-note").focus();
  });
}

async function claim(subject) {
  const answer = await call("ClaimReply", { requestId: requestId(), subject, ttlSeconds: CLAIM_SECONDS });
  if (answer.result === "GRANTED") { session.me = answer.status.holder; return "It is yours now: nobody else will answer it."; }
  if (answer.result === "HELD") return `${answer.status.holder} is already answering it.`;
  return "It has already been answered (or is being sent).";
}

async function takeover(subject) {
  const answer = await call("Takeover", { requestId: requestId(), subject, ttlSeconds: CLAIM_SECONDS });
  if (answer.result === "TAKEN_OVER" || answer.result === "GRANTED") {
    session.me = answer.status.holder;
    return answer.previousHolder
      ? `You are answering it now; ${answer.previousHolder} has stopped and cannot send.`
      : "You are answering it now.";
  }
  if (answer.result === "HELD") return `${answer.status.holder} (a person) is already answering it.`;
  return "Too late: the reply is already being sent or went out.";
}

async function markReplied(subject, token) {
  const answers = await ask("You answered this message yourself? Agents will then leave it alone.", true);
  if (!answers) return "";
  const answer = await call("MarkReplied", { requestId: requestId(), subject, fencingToken: token, ...answers });
  return answer.result === "FENCE_RESULT_OK"
    ? "Recorded as answered by you."
    : "It was no longer yours (your time ran out or someone took it over): nothing was recorded.";
}

async function release(subject, token) {
  const answer = await call("ReleaseClaim", { requestId: requestId(), subject, fencingToken: token });
  return answer.result === "FENCE_RESULT_OK" ? "Given back: someone else may answer it." : "It was no longer yours.";
}

async function resolve(subject, outcome) {
  const sent = outcome === "OUTCOME_SENT";
  const answers = await ask(sent
    ? "You found the reply in the Sent folder? It will be recorded as answered."
    : "You checked the Sent folder and the reply is not there? The message will be free to answer again.", sent);
  if (!answers) return "";
  await call("ResolveInDoubt", { requestId: requestId(), subject, outcome, ...answers });
  return sent ? "Recorded as sent." : "Recorded as not sent: it can be answered again.";
}

// --- the page ------------------------------------------------------------------------------------------------

function say(text) { $("#status-line").textContent = text; }
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
  const rights = [may("takeover") && session.kind === "human" ? "may take over from agents" : "",
    may("resolve") ? "may settle unconfirmed sends" : ""].filter(Boolean);
  who.textContent = `Signed in as ${session.me}` + (rights.length ? ` (${rights.join(", ")})` : "") +
    ` · ${session.mailboxes.join(", ")}`;
  const select = $("#claim-mailbox");
  select.replaceChildren(...session.mailboxes.map((mailbox) => new Option(mailbox, mailbox)));
  select.hidden = session.mailboxes.length < 2;
  refreshCounts();
  for (const mailbox of session.mailboxes) watch(mailbox);
  setInterval(tick, 1000);
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
  $("#claim-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const id = $("#claim-id").value.trim();
    const mailbox = $("#claim-mailbox").value || session.mailboxes[0];
    act(event.submitter || $("#claim-form button"), () => claim({ mailbox, kind: "SUBJECT_KIND_MESSAGE", id }));
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
