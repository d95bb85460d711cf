"""Open a page in headless Chromium (Debian's ``chromium`` package) and report what a user's browser saw.

Speaks the DevTools protocol over a websocket: console errors, uncaught exceptions and failed loads are
collected while the page loads; then every ``<img>``'s decoded size is read and a full-page screenshot is
written. ``scripts/setup.sh`` installs the package where apt is available; :func:`chromium` says where it is.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["Rendered", "artifacts_dir", "check_rendered", "chromium", "need_browser", "render"]

ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    return Path(os.environ.get("RLALIGN_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def need_browser() -> None:
    if chromium() is None:
        if os.environ.get("RLALIGN_REQUIRE_BROWSER") == "1":
            pytest.fail("RLALIGN_REQUIRE_BROWSER=1 but no chromium executable (apt-get install chromium)")
        pytest.skip("no chromium executable")


def check_rendered(seen: Rendered, screenshot: Path, images: int, captions: list[str]) -> None:
    """No console errors, ``images`` images each decoded at a useful size, the ``captions`` visible."""
    assert seen.errors == [], seen.errors
    assert len(seen.images) == images
    for image in seen.images:
        assert image["complete"] and image["width"] >= 400 and image["height"] >= 200, image
    for caption in captions:
        assert caption in seen.text, caption
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 50_000


@dataclass
class Rendered:
    """What the browser saw: ``errors`` (console errors, exceptions, failed loads), ``images``, the title."""

    title: str = ""
    errors: list[str] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)
    text: str = ""


def chromium() -> str | None:
    """The Chromium executable, or None."""
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class _Page:
    def __init__(self, ws) -> None:
        self._ws = ws
        self._next = 0
        self.events: list[dict] = []

    def call(self, method: str, timeout: float = 60.0, **params) -> dict:
        self._next += 1
        ident = self._next
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic()))))


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            out.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            out.append(
                "console.error: "
                + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            out.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}".strip())
        elif method == "Network.loadingFailed":
            out.append(f"load failed: {params.get('errorText')}")
    return out


def render(page: Path, screenshot: Path, width: int = 1280, timeout: float = 90.0) -> Rendered:
    """Load ``page`` (a local HTML file) in headless Chromium; write a full-page PNG to ``screenshot``."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable (apt-get install chromium, or set CHROMIUM)")
    profile = tempfile.mkdtemp(prefix="rlalign-chromium-")
    try:
        proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},900",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            port = _devtools_port(proc, timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
                targets = [t for t in json.load(r) if t.get("type") == "page"]
            from websockets.sync.client import connect

            with connect(targets[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
                tab = _Page(ws)
                for domain in ("Page", "Runtime", "Log", "Network"):
                    tab.call(f"{domain}.enable")
                tab.call("Page.navigate", url=page.resolve().as_uri())
                tab.wait_for("Page.loadEventFired", timeout)
                got = tab.call(
                    "Runtime.evaluate",
                    expression="JSON.stringify({title: document.title, text: document.body.innerText,"
                    " images: [...document.images].map(i => ({alt: i.alt, complete: i.complete,"
                    " width: i.naturalWidth, height: i.naturalHeight}))})",
                    returnByValue=True,
                )
                seen = json.loads(got["result"]["value"])
                shot = tab.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                return Rendered(seen["title"], _errors(tab.events), seen["images"], seen["text"])
        finally:
            _stop(proc)
    finally:
        _remove(profile)


def _stop(proc: subprocess.Popen) -> None:
    """Kill Chromium and its helper processes (renderer, GPU, crashpad: its session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _remove(profile: str) -> None:
    """Remove the profile directory; a helper that outlived the kill by a moment may still write into it."""
    for _ in range(20):
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.25)
    shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before DevTools listened")
        match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if match:
            # keep draining chromium's log, or a full pipe would stall the browser
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return int(match.group(1))
    raise TimeoutError("chromium's DevTools did not start")
