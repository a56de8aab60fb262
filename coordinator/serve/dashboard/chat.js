// The chat beside the dashboard: streams answers from the cluster's own /v1/chat/completions
// (the server renders the model's chat template), keeps the conversation in this browser's local
// storage, and draws the model's Markdown with DOM nodes and text only, so no output of the model
// is ever parsed as HTML. Loaded after dashboard.js, whose $, el, seconds and apiKey it uses.
"use strict";

(() => {
  const STORE = "moe-cluster-chat";  // {messages: [{role, content, stats?, error?, stopped?}]}
  const SETTINGS = "moe-cluster-chat-settings";
  const FIELDS = {system: "system", temperature: "temperature", top_p: "top-p",
                  max_tokens: "max-tokens"};  // setting -> its input's id
  let model = "";
  let controller = null;  // the answer being streamed, aborted by Stop
  let locked = true;

  function load(key, fallback) {
    try {
      return JSON.parse(localStorage.getItem(key)) || fallback;
    } catch (err) {
      return fallback;  // written by another version, or by hand: start afresh rather than break
    }
  }

  const chat = load(STORE, {messages: []});
  // only turns this page can draw (a store edited by hand may hold anything)
  chat.messages = (Array.isArray(chat.messages) ? chat.messages : []).filter((m) =>
    m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
  const save = () => localStorage.setItem(STORE, JSON.stringify(chat));

  // -- Markdown, as DOM nodes ---------------------------------------------------------------------

  // `code`, **bold** and *italic* within a line; everything else stays text
  const INLINE = new RegExp([/(`+)([\s\S]*?[^`])\1(?!`)/, /\*\*(?=\S)([\s\S]*?\S)\*\*/,
                             /\*(?=[^\s*])([^*]*?[^\s*])\*/].map((r) => r.source).join("|"), "g");

  function inline(text) {
    const out = [];
    let at = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > at) out.push(document.createTextNode(text.slice(at, m.index)));
      if (m[1]) out.push(el("code", {}, m[2]));
      else if (m[3]) out.push(el("strong", {}, ...inline(m[3])));
      else out.push(el("em", {}, m[4]));
      at = m.index + m[0].length;
    }
    if (at < text.length) out.push(document.createTextNode(text.slice(at)));
    return out;
  }

  // Fenced code blocks (an unclosed fence, as while streaming, runs to the end), headings, lists
  // and paragraphs. el() appends strings as text nodes: nothing here is parsed as HTML.
  function markdown(text) {
    const lines = text.split("\n");
    const blocks = [];
    let para = [];
    const flush = () => {
      if (para.length) blocks.push(el("p", {}, ...inline(para.join("\n"))));
      para = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) {
          body.push(lines[i]);
        }
        const code = el("code", {}, body.join("\n"));
        blocks.push(el("pre", fence[2] ? {"data-lang": fence[2]} : {}, code));
        continue;
      }
      const head = line.match(/^(#{1,6})\s+(.*)$/);
      if (head) {
        flush();
        blocks.push(el(head[1].length <= 2 ? "h3" : "h4", {}, ...inline(head[2])));
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (item) {
        flush();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        const last = blocks[blocks.length - 1];
        const list = last && last.tagName === tag.toUpperCase() ? last : el(tag);
        if (list !== last) blocks.push(list);
        list.append(el("li", {}, ...inline(item[2])));
        continue;
      }
      if (line.trim() === "") flush();
      else para.push(line);
    }
    flush();
    return blocks;
  }

  // -- the conversation ---------------------------------------------------------------------------

  function meta(m) {
    const s = m.stats && typeof m.stats === "object" ? m.stats : {};
    const parts = [];
    if (s.ttft_s !== undefined) parts.push(`first token ${seconds(Number(s.ttft_s))}`);
    if (s.tps) parts.push(`${Number(s.tps).toFixed(1)} tok/s`);
    if (s.tokens !== undefined) parts.push(`${s.tokens} tokens`);
    if (m.stopped) parts.push("stopped");
    else if (s.finish) parts.push(s.finish);
    return parts.join(" · ");
  }

  // One message's node; an assistant's text goes through markdown(), restored or streamed alike.
  function drawMessage(m, node) {
    node = node || el("div");
    const live = m === streaming();
    node.className = `msg ${m.role}` + (m.error ? " error" : "") + (live ? " streaming" : "");
    node.dataset.role = m.role;
    const body = el("div", {class: "body"});
    if (m.role === "user") body.append(m.content);
    else if (m.error) body.append(el("div", {}, ...markdown(m.content)), el("p", {}, m.error));
    else body.append(...markdown(m.content));
    node.replaceChildren(body);
    if (m.role === "assistant") {
      node.dataset.state = m.error ? "error" : m.stopped ? "stopped" : live ? "streaming" : "done";
      node.append(el("div", {class: "meta"}, meta(m)));
    }
    return node;
  }

  function streaming() {
    return controller ? chat.messages[chat.messages.length - 1] : null;
  }

  function drawAll() {
    const box = $("messages");
    if (!chat.messages.length) {
      box.replaceChildren(el("p", {class: "empty"},
                             "No messages yet. The heat map moves while the model answers."));
      return;
    }
    box.replaceChildren(...chat.messages.map((m) => drawMessage(m)));
    box.scrollTop = box.scrollHeight;
  }

  // What the model sees: the system prompt, then every turn but failed ones (and their question).
  function history(system) {
    const out = system ? [{role: "system", content: system}] : [];
    chat.messages.forEach((m, i) => {
      const next = chat.messages[i + 1];
      if (m.error || (m.role === "user" && next && next.error)) return;
      if (m.role === "assistant" && !m.content) return;
      out.push({role: m.role, content: m.content});
    });
    return out;
  }

  function settings() {
    const s = {};
    for (const [name, id] of Object.entries(FIELDS)) s[name] = $(id).value;
    return s;
  }

  // Numbers as the API takes them; what is not a number goes as typed, and the API's 400 names it.
  function sampling(s) {
    const num = (v) => (v.trim() !== "" && !isNaN(Number(v)) ? Number(v) : v);
    return {temperature: num(s.temperature), top_p: num(s.top_p), max_tokens: num(s.max_tokens)};
  }

  function auth() {
    const key = apiKey();
    return key ? {"Authorization": "Bearer " + key} : {};
  }

  // Server-sent events: "data: {...}" blocks separated by a blank line.
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buf += decoder.decode(value, {stream: true});
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
        }
      }
    }
  }

  async function errorOf(response) {
    try {
      return (await response.json()).error.message;
    } catch (err) {
      return `HTTP ${response.status}`;
    }
  }

  async function send(text) {
    const question = {role: "user", content: text};
    const answer = {role: "assistant", content: "", stats: {}};
    chat.messages.push(question);
    const messages = history($("system").value.trim());
    const body = {model, stream: true, messages, ...sampling(settings())};
    chat.messages.push(answer);
    controller = new AbortController();
    busy(true);
    drawAll();
    const node = $("messages").lastElementChild;
    const t0 = performance.now();
    let first, last, pieces = 0, final = null;
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal: controller.signal, cache: "no-store",
        headers: {"Content-Type": "application/json", ...auth()}});
      if (!r.ok) {
        if (r.status === 401) checkAccess();
        throw new Error(await errorOf(r));
      }
      for await (const event of events(r)) {
        if (event.error) throw new Error(event.error.message);
        const choice = (event.choices || [])[0] || {};
        const delta = (choice.delta || {}).content;
        if (delta) {
          last = performance.now();
          if (first === undefined) first = last;
          answer.content += delta;
          node.dataset.pieces = String(++pieces);
          answer.stats.ttft_s = (first - t0) / 1000;
          drawMessage(answer, node);
          save();
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) final = event;
      }
    } catch (err) {
      if (err.name === "AbortError") answer.stopped = true;
      else answer.error = String(err.message || err);
    } finally {
      if (final) {
        answer.stats.tokens = final.usage.completion_tokens;
        answer.stats.tps = final.moe_cluster ? final.moe_cluster.generation_tps : undefined;
        answer.stats.finish = final.choices[0].finish_reason;
      } else if (pieces) {
        // stopped: the pieces seen so far (one token each, bar multi-token characters), timed here
        answer.stats.tokens = pieces;
        if (pieces > 1) answer.stats.tps = (pieces - 1) / ((last - first) / 1000);
      }
      controller = null;
      busy(false);
      drawMessage(answer, node);
      save();
    }
  }

  function busy(on) {
    $("send").disabled = on || locked;
    $("stop").disabled = !on;
  }

  // The page chats only once /v1/models answers with the key this browser holds (or without one).
  async function checkAccess() {
    let r;
    try {
      r = await fetch("/v1/models", {headers: auth(), cache: "no-store"});
    } catch (err) {
      return lock("the coordinator is unreachable");
    }
    if (r.status === 401) {
      $("auth").hidden = false;
      return lock(apiKey() ? "That key was refused: enter the cluster's API key in the box above."
                           : "This cluster needs its API key: enter it in the box above.");
    }
    if (!r.ok) return lock(`/v1/models: ${await errorOf(r)}`);
    model = (await r.json()).data[0].id;
    $("chat-model").textContent = model;
    locked = false;
    $("chat-lock").hidden = true;
    busy(controller !== null);
  }

  function lock(why) {
    locked = true;
    $("chat-lock").textContent = why;
    $("chat-lock").hidden = false;
    busy(controller !== null);
  }

  function exportJson() {
    const doc = {model, exported: new Date().toISOString(), settings: settings(),
                 messages: chat.messages};
    const blob = new Blob([JSON.stringify(doc, null, 2)], {type: "application/json"});
    const url = URL.createObjectURL(blob);
    const a = el("a", {href: url, download: `moe-cluster-chat-${Date.now()}.json`});
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  // -- wiring -------------------------------------------------------------------------------------

  const stored = load(SETTINGS, {});
  for (const [name, id] of Object.entries(FIELDS)) {
    if (typeof stored[name] === "string") $(id).value = stored[name];
    $(id).addEventListener("change",
                           () => localStorage.setItem(SETTINGS, JSON.stringify(settings())));
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (locked || controller || !text.trim()) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    chat.messages = [];
    save();
    drawAll();
  });
  $("export").addEventListener("click", exportJson);
  $("use-key").addEventListener("click", checkAccess);  // after dashboard.js stored the key
  drawAll();
  checkAccess();
})();
