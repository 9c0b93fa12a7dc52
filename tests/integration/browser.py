"""A real headless browser for page tests: Debian's Chromium driven over the DevTools protocol (websocket-client).

``Chromium()`` starts ``chromium --headless`` on a free debugging port with a throwaway profile; ``open(url)`` gives
a ``Page`` that records every console error, uncaught exception and failed load (``page.errors``), evaluates
JavaScript (``page.eval``) and takes screenshots. The Makefile's test set-up installs Debian's ``chromium`` package
(no browser download: none can be fetched here). ``python -m tests.integration.browser URL OUT.png`` takes a
screenshot of a page (docs/images/dashboard.png is made this way).
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, NAMES) if p), None)


class Page:
    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self.errors: list[str] = []
        self.events: list[dict] = []
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")

    def _event(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        self.events.append(msg)
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append("exception: " + d.get("exception", {}).get("description", d.get("text", "")))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} ({p['entry'].get('url', '')})")

    def send(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def pump(self, seconds: float) -> None:
        """Take the events that arrive within ``seconds``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.ws.settimeout(max(0.01, end - time.monotonic()))
            try:
                self._event(json.loads(self.ws.recv()))
            except websocket.WebSocketTimeoutException:
                break
        self.ws.settimeout(30)

    def navigate(self, url: str, timeout: float = 30) -> None:
        self.send("Page.navigate", url=url)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(e.get("method") == "Page.loadEventFired" for e in self.events):
                return
            self.pump(0.1)
        raise TimeoutError(f"{url} did not load in {timeout} s")

    def eval(self, expression: str):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        """Poll ``expression`` until it is truthy (events keep being recorded meanwhile)."""
        end = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"{expression!r} still false after {timeout} s")
            self.pump(0.2)

    def screenshot(self, path: str) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        self.ws.close()


class Chromium:
    def __init__(self, width: int = 1440, height: int = 900):
        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError(f"none of {NAMES} on PATH (the Makefile's test set-up installs chromium)")
        self.profile = tempfile.mkdtemp(prefix="moe-serve-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.profile, "chromium.log"), "w"))
        self.port = self._port()

    def _port(self) -> int:
        """The port Chromium chose: the first line of DevToolsActivePort in the profile."""
        path = os.path.join(self.profile, "DevToolsActivePort")
        end = time.monotonic() + 30
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                with open(path) as f:
                    first = f.readline().strip()
                if first:
                    return int(first)
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        with open(os.path.join(self.profile, "chromium.log")) as f:
            log = f.read()[-2000:]
        self.close()
        raise RuntimeError(f"chromium did not start its DevTools endpoint:\n{log}")

    def open(self, url: str) -> Page:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as r:
            target = next(t for t in json.load(r) if t["type"] == "page")
        page = Page(target["webSocketDebuggerUrl"])
        page.navigate(url)
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # python -m tests.integration.browser URL OUT.png [WIDTH HEIGHT]
    url, out = sys.argv[1], sys.argv[2]
    w, h = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1440, 900)
    with Chromium(w, h) as browser:
        page = browser.open(url)
        page.wait_for("window.dashboardState && window.dashboardState.updates > 0" if "/dashboard" in url else "1")
        page.pump(float(os.environ.get("SCREENSHOT_WAIT_S", "1")))
        page.screenshot(out)
        print(f"{out}; errors: {page.errors}")
