// forkyard console: a terminal in the browser over envd's PTY, with no library.
//
// The page is served by the API server, whose sandbox proxy forwards any request carrying
// E2b-Sandbox-Id / E2b-Sandbox-Port to envd (the same route the SDKs take with E2B_SANDBOX_URL).
// envd speaks Connect RPC; this file uses its JSON codec: process.Process/Start (a server stream
// of enveloped JSON messages) opens a login shell on a PTY, SendInput carries keystrokes and
// Update the size. The screen is a small VT100 subset: enough for bash/readline, less, top.
"use strict";

(function () {
  const el = document.getElementById("terminal");
  const statusEl = document.getElementById("term-status");
  const ROWS = 24, COLS = 80;
  const headers = {
    "Connect-Protocol-Version": "1",
    "E2b-Sandbox-Id": el.dataset.sandbox,
    "E2b-Sandbox-Port": el.dataset.port,
    // envd's default user is `user`; the SDKs name it the same way (Basic, no password).
    "Authorization": "Basic " + btoa("user:"),
  };
  if (el.dataset.token) headers["X-Access-Token"] = el.dataset.token;

  // -- the screen ------------------------------------------------------------------------------
  const blank = () => new Array(COLS).fill(" ");
  let screen = Array.from({ length: ROWS }, blank);
  let row = 0, col = 0, savedRow = 0, savedCol = 0;
  let parseState = "text", params = "", pending = false;

  function scroll() {
    screen.shift();
    screen.push(blank());
    row = ROWS - 1;
  }
  function newline() {
    row += 1;
    if (row >= ROWS) scroll();
  }
  function put(ch) {
    if (col >= COLS) { col = 0; newline(); }
    screen[row][col] = ch;
    col += 1;
  }
  function eraseLine(r, from, to) {
    for (let c = from; c < to; c++) screen[r][c] = " ";
  }
  function csi(final, raw) {
    const priv = raw.startsWith("?");
    const nums = (priv ? raw.slice(1) : raw).split(";").map((n) => parseInt(n, 10));
    const n = (i, d) => (Number.isNaN(nums[i]) || nums[i] === undefined ? d : nums[i]);
    if (priv) return; // modes (bracketed paste, cursor keys, alternate screen): ignored
    switch (final) {
      case "A": row = Math.max(0, row - n(0, 1)); break;
      case "B": row = Math.min(ROWS - 1, row + n(0, 1)); break;
      case "C": col = Math.min(COLS - 1, col + n(0, 1)); break;
      case "D": col = Math.max(0, col - n(0, 1)); break;
      case "G": col = Math.min(COLS - 1, n(0, 1) - 1); break;
      case "d": row = Math.min(ROWS - 1, n(0, 1) - 1); break;
      case "H": case "f": row = Math.min(ROWS - 1, n(0, 1) - 1); col = Math.min(COLS - 1, n(1, 1) - 1); break;
      case "J": {
        const mode = n(0, 0);
        if (mode === 0) { eraseLine(row, col, COLS); for (let r = row + 1; r < ROWS; r++) eraseLine(r, 0, COLS); }
        else if (mode === 1) { eraseLine(row, 0, col + 1); for (let r = 0; r < row; r++) eraseLine(r, 0, COLS); }
        else screen = Array.from({ length: ROWS }, blank);
        break;
      }
      case "K": {
        const mode = n(0, 0);
        if (mode === 0) eraseLine(row, col, COLS);
        else if (mode === 1) eraseLine(row, 0, col + 1);
        else eraseLine(row, 0, COLS);
        break;
      }
      case "P": { const k = n(0, 1); screen[row].splice(col, k); while (screen[row].length < COLS) screen[row].push(" "); break; }
      case "@": { const k = n(0, 1); screen[row].splice(col, 0, ...new Array(k).fill(" ")); screen[row].length = COLS; break; }
      case "X": eraseLine(row, col, Math.min(COLS, col + n(0, 1))); break;
      case "L": for (let i = 0; i < n(0, 1); i++) { screen.splice(row, 0, blank()); screen.length = ROWS; } break;
      case "M": for (let i = 0; i < n(0, 1); i++) { screen.splice(row, 1); screen.push(blank()); } break;
      case "s": savedRow = row; savedCol = col; break;
      case "u": row = savedRow; col = savedCol; break;
      default: break; // colours (m) and the rest: ignored
    }
  }
  function write(text) {
    for (const ch of text) {
      if (parseState === "esc") {
        if (ch === "[") { parseState = "csi"; params = ""; }
        else if (ch === "]") parseState = "osc";
        else if (ch === "(" || ch === ")") parseState = "charset";
        else if (ch === "7") { savedRow = row; savedCol = col; parseState = "text"; }
        else if (ch === "8") { row = savedRow; col = savedCol; parseState = "text"; }
        else parseState = "text";
        continue;
      }
      if (parseState === "charset") { parseState = "text"; continue; }
      if (parseState === "csi") {
        if (ch >= "@" && ch <= "~" && ch !== "?" ) { csi(ch, params); parseState = "text"; }
        else params += ch;
        continue;
      }
      if (parseState === "osc") { // window titles: up to BEL or ESC \
        if (ch === "\x07") parseState = "text";
        else if (ch === "\x1b") parseState = "esc";
        continue;
      }
      switch (ch) {
        case "\x1b": parseState = "esc"; break;
        case "\r": col = 0; break;
        case "\n": newline(); break;
        case "\b": col = Math.max(0, col - 1); break;
        case "\t": col = Math.min(COLS - 1, (Math.floor(col / 8) + 1) * 8); break;
        case "\x07": break;
        default: if (ch >= " ") put(ch);
      }
    }
    if (!pending) { pending = true; requestAnimationFrame(render); }
  }
  const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function render() {
    pending = false;
    el.innerHTML = screen.map((line, r) => {
      if (r !== row) return esc(line.join(""));
      const c = Math.min(col, COLS - 1);
      return esc(line.slice(0, c).join("")) + '<span class="cursor">' + esc(line[c]) + "</span>" +
        esc(line.slice(c + 1).join(""));
    }).join("\n");
  }

  // -- envd over Connect (JSON codec) ------------------------------------------------------------
  const encoder = new TextEncoder();
  function envelope(message) {
    const body = encoder.encode(JSON.stringify(message));
    const out = new Uint8Array(5 + body.length);
    new DataView(out.buffer).setUint32(1, body.length);
    out.set(body, 5);
    return out;
  }
  function b64(bytes) {
    let s = "";
    for (const b of bytes) s += String.fromCharCode(b);
    return btoa(s);
  }
  function unb64(text) {
    const s = atob(text);
    const out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  async function unary(method, message) {
    const resp = await fetch("/process.Process/" + method, {
      method: "POST",
      headers: { ...headers, "Content-Type": "application/json" },
      body: JSON.stringify(message),
    });
    if (!resp.ok) throw new Error(method + ": " + resp.status + " " + (await resp.text()));
  }

  let pid = null;
  let sending = Promise.resolve();
  function send(bytes) {
    if (pid === null) return;
    const message = { process: { pid: pid }, input: { pty: b64(bytes) } };
    // One at a time, in order: keystrokes must not overtake each other.
    sending = sending.then(() => unary("SendInput", message)).catch((e) => setStatus("input failed: " + e.message));
  }
  function setStatus(text, state) {
    statusEl.textContent = text;
    if (state) el.dataset.state = state;
  }

  async function start() {
    el.dataset.state = "connecting";
    const decoder = new TextDecoder();
    const request = {
      process: { cmd: "/bin/bash", args: ["-i", "-l"], envs: { TERM: "xterm", LANG: "C.UTF-8" } },
      pty: { size: { cols: COLS, rows: ROWS } },
    };
    const resp = await fetch("/process.Process/Start", {
      method: "POST",
      headers: { ...headers, "Content-Type": "application/connect+json" },
      body: envelope(request),
    });
    if (!resp.ok) throw new Error(resp.status + " " + (await resp.text()));
    const reader = resp.body.getReader();
    let buf = new Uint8Array(0);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const joined = new Uint8Array(buf.length + value.length);
      joined.set(buf);
      joined.set(value, buf.length);
      buf = joined;
      while (buf.length >= 5) {
        const len = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
        if (buf.length < 5 + len) break;
        const flags = buf[0];
        const msg = JSON.parse(new TextDecoder().decode(buf.slice(5, 5 + len)) || "{}");
        buf = buf.slice(5 + len);
        if (flags & 2) { // end of stream: an error, or nothing
          if (msg.error) throw new Error(msg.error.code + ": " + (msg.error.message || ""));
          continue;
        }
        const ev = msg.event || {};
        if (ev.start) { pid = ev.start.pid; setStatus("connected (pid " + pid + ")", "open"); }
        else if (ev.data && ev.data.pty) write(decoder.decode(unb64(ev.data.pty), { stream: true }));
        else if (ev.end) {
          setStatus("shell exited (" + (ev.end.status || ev.end.exitCode || 0) + ")", "closed");
          pid = null;
        }
      }
    }
    if (el.dataset.state !== "closed") setStatus("disconnected", "closed");
  }

  // -- keyboard ------------------------------------------------------------------------------
  const KEYS = {
    Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b",
    ArrowUp: "\x1b[A", ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D",
    Home: "\x1b[H", End: "\x1b[F", Delete: "\x1b[3~", PageUp: "\x1b[5~", PageDown: "\x1b[6~",
  };
  el.addEventListener("keydown", (e) => {
    let out = null;
    if (e.ctrlKey && !e.altKey && e.key.length === 1) {
      const code = e.key.toUpperCase().charCodeAt(0);
      if (code >= 64 && code <= 95) out = String.fromCharCode(code - 64);
    } else if (KEYS[e.key]) out = KEYS[e.key];
    else if (e.key.length === 1 && !e.metaKey) out = (e.altKey ? "\x1b" : "") + e.key;
    if (out !== null) {
      e.preventDefault();
      send(encoder.encode(out));
    }
  });
  el.addEventListener("paste", (e) => {
    e.preventDefault();
    send(encoder.encode(e.clipboardData.getData("text")));
  });

  render();
  el.focus();
  start().catch((e) => setStatus("error: " + e.message, "closed"));
})();
