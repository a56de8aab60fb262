"""Headless Chromium for the page tests: the flags that keep it to loopback, and one tab driven over
the DevTools protocol (its WebSocket, through aiohttp) with real key presses and clicks."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import aiohttp

# Chromium resolves no name and reaches no address but loopback (everything else goes to a proxy
# that is not there, port 9 of this machine): a page must draw from the coordinator alone.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=127.0.0.1:9",
]  # loopback bypasses a proxy by Chromium's own rule


class Page:
    """One Chromium tab over the DevTools protocol: evaluate, type, click, wait."""

    def __init__(self, profile: Path, downloads: Path):
        """A fresh Chromium on `profile` (its local storage), saving downloads into `downloads`."""
        cmd = [
            "chromium",
            *CHROMIUM_FLAGS,
            "--window-size=1400,900",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            assert self.proc.poll() is None and time.monotonic() < deadline, "no Chromium"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._open(f"http://127.0.0.1:{port}"))
        self.next_id = 0
        self.watched = {"Fetch.requestPaused"}  # events kept for event(); the others are dropped
        self.events: list[dict] = []
        self.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads))
        # every Content-Security-Policy violation, from the first script on
        self.call(
            "Page.addScriptToEvaluateOnNewDocument",
            source=(
                "window.__csp = []; document.addEventListener('securitypolicyviolation', "
                "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
            ),
        )

    async def _open(self, base: str) -> None:
        self.session = aiohttp.ClientSession()
        async with self.session.get(base + "/json/list") as r:
            tab = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await self.session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0)

    async def _call(self, method: str, params: dict) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == self.next_id:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]
            if msg.get("method") in self.watched:
                self.events.append(msg)

    async def _event(self, method: str, timeout: float) -> dict:
        while True:
            hit = next((m for m in self.events if m["method"] == method), None)
            if hit:
                self.events.remove(hit)
                return hit["params"]
            msg = await self.ws.receive_json(timeout=timeout)
            if msg.get("method") in self.watched:
                self.events.append(msg)

    def event(self, method: str, timeout: float = 60) -> dict:
        """The params of the next `method` event (one of self.watched), even one seen in a call."""
        return self.loop.run_until_complete(self._event(method, timeout))

    def call(self, method: str, **params) -> dict:
        return self.loop.run_until_complete(self._call(method, params))

    def js(self, expression: str):
        r = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 60, what: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {what or expression}"
            time.sleep(0.05)

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait(
            "document.readyState === 'complete' && !!document.getElementById('chat')",
            what="the page",
        )

    def click(self, element_id: str) -> None:
        """A mouse click at the element's centre, as a person's (a disabled button stays dead)."""
        x, y = self.js(
            f"(() => {{ const e = document.getElementById('{element_id}'); "
            "e.scrollIntoView(); const r = e.getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, element_id: str, text: str, enter: bool = False) -> None:
        self.js(f"document.getElementById('{element_id}').focus()")
        self.call("Input.insertText", text=text)
        if enter:
            for kind in ("keyDown", "keyUp"):
                self.call(
                    "Input.dispatchKeyEvent",
                    type=kind,
                    key="Enter",
                    code="Enter",
                    windowsVirtualKeyCode=13,
                )

    def set_field(self, element_id: str, value: str) -> None:
        self.js(
            f"(() => {{ const e = document.getElementById('{element_id}'); e.value = ''; "
            "e.focus(); })()"
        )
        self.call("Input.insertText", text=value)
        self.js(f"document.getElementById('{element_id}').dispatchEvent(new Event('change'))")

    def stored(self) -> list[dict]:
        """The conversation the page keeps in local storage."""
        return self.js(
            "(JSON.parse(localStorage.getItem('moe-cluster-chat')) || {messages: []}).messages"
        )

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
            self.loop.run_until_complete(self.session.close())
        finally:
            self.loop.close()
            self.proc.terminate()
            self.proc.wait(timeout=30)
