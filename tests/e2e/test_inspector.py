"""The inspector page in a real browser (issue 23): Debian's Chromium driven by
Playwright, against compactor in front of a small scripted upstream (fast) and
in front of the real llama.cpp (slow, a small window so it compacts soon).

What a user sees is asserted: the conversation listed with its occupancy, the
chart with one point per turn and a compaction marker, the compaction table
row; record content absent by default and present with ``show_content``;
no data without the token or with a wrong one. A screenshot is saved under the
test's tmp dir, and to ``$INSPECTOR_SCREENSHOT`` when set.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")

TOKEN = "inspector-e2e-token"
SUMMARY_TEXT = "INSPECTOR-SUMMARY: the user read files one by one."
MODEL = "inspect-m"


class ScriptedUpstream:
    """Counts prompt tokens as bytes/4, reports the shared prefix with the
    previous request as cached tokens, answers summary calls with a fixed
    text."""

    def __init__(self) -> None:
        self.prev: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
                self.send_response(200 if self.path.endswith("/models") else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                req = json.loads(self.rfile.read(n) or b"{}")
                msgs = [json.dumps(m, sort_keys=True) for m in req.get("messages", [])]
                prompt = max(1, sum(len(m) for m in msgs) // 4)
                text = json.dumps(req).lower()
                summary = "summar" in text and "checkpoint" in text or "summarization agent" in text
                if summary:
                    content, cached = SUMMARY_TEXT, 0
                else:
                    common = 0
                    for a, b in zip(outer.prev, msgs):
                        if a != b:
                            break
                        common += len(a)
                    cached = common // 4
                    outer.prev = msgs
                    content = "Done."
                body = json.dumps({
                    "id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": 5,
                              "total_tokens": prompt + 5,
                              "prompt_tokens_details": {"cached_tokens": cached}},
                }).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()


def post_chat(url: str, messages: list[dict], model: str, session: str) -> dict:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({"model": model, "messages": messages, "max_tokens": 48}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer sk-e2e",
                 "x-session-id": session},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return {"action": r.headers.get("x-compactor-action"),
                "session": r.headers.get("x-compactor-session"),
                "body": json.loads(r.read())}


def converse(url: str, model: str, turns: int, filler: int, session: str) -> tuple[str, list[str]]:
    """A conversation of ``turns`` turns, each user message ``filler`` bytes."""
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    actions, key = [], ""
    for i in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Step {i}: read part {i}. " + ("lorem ipsum " * filler)[:filler]})
        r = post_chat(url, messages, model, session)
        actions.append(r["action"])
        key = r["session"]
        messages.append({"role": "assistant", "content": r["body"]["choices"][0]["message"]["content"] or "ok"})
    return key, actions


def browser():
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(exe).exists():
        pytest.skip("chromium not installed (scripts/install_prereqs.sh)")
    p = playwright_sync.sync_playwright().start()
    b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
    return p, b


def open_ui(page, url: str, token: str | None) -> None:
    page.goto(url + "/_compactor/ui")
    page.wait_for_selector("#login:not([hidden])")
    if token is not None:
        page.fill("#token", token)
        page.click("#login button[type=submit]")


def check_ui(url: str, key: str, turns: int, tmp_path: Path, content: bool, name: str) -> None:
    p, b = browser()
    errors: list[str] = []
    try:
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        # A wrong token: no data, the login form again.
        open_ui(page, url, "wrong-token")
        page.wait_for_selector("#login-error:text('missing or wrong admin token')")
        assert page.locator(f"tr[data-session='{key}']").count() == 0

        open_ui(page, url, TOKEN)
        row = page.locator(f"tr[data-session='{key}']")
        row.wait_for()
        occ = row.locator(".occ-text").inner_text()
        assert "/" in occ and "trigger" in occ, occ
        assert row.locator(".bar .fill").evaluate("e => parseFloat(e.style.width)") > 0
        assert row.locator(".turns").inner_text() == str(turns)
        assert int(row.locator(".compactions").inner_text().split()[0]) >= 1
        assert row.locator(".api").inner_text() == "chat"
        assert row.locator(".id-kind").inner_text() == "header"
        # The filter hides what does not match.
        page.fill("#filter", "no-such-model")
        assert row.count() == 0 or not row.is_visible()
        page.fill("#filter", "")

        row.locator(".session a").click()
        page.wait_for_selector("#chart[data-points]")
        page.wait_for_function("window.inspectorChart !== undefined")
        points = page.evaluate("window.inspectorChart.data[0].length")
        assert points == turns, points
        markers = page.evaluate("window.inspectorChart.data[5].filter(v => v !== null).length"
                                " + window.inspectorChart.data[6].filter(v => v !== null).length")
        assert markers >= 1
        table = page.locator("#compactions tbody tr")
        assert table.count() >= 1
        assert "→" in table.first.locator(".rows").inner_text()
        if content:
            page.wait_for_selector("#content:not([hidden])")
            assert page.locator("#content-body pre.summary").count() >= 1
        else:
            assert page.locator("#content").is_hidden()
            assert SUMMARY_TEXT not in page.content()
        shot = tmp_path / f"inspector-{name}.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("INSPECTOR_SCREENSHOT"):
            shutil.copy(shot, os.environ["INSPECTOR_SCREENSHOT"])

        # Without a token the page shows the login form and fetches nothing.
        fresh = b.new_page()
        open_ui(fresh, url, None)
        assert fresh.locator("#sessions tbody tr").count() == 0
        assert not [e for e in errors if "401" not in e], errors
    finally:
        b.close()
        p.stop()


@pytest.mark.parametrize("content", [False, True], ids=["content-free", "show-content"])
def test_inspector_with_scripted_upstream(compactor, tmp_path, content):
    up = ScriptedUpstream()
    try:
        cfg = (f'[admin]\ntoken = "{TOKEN}"\nshow_content = {str(content).lower()}\n'
               f'[models."{MODEL}"]\ncontext_length = 4096\n')
        via = compactor(up.url, config=cfg)
        key, actions = converse(via.url, MODEL, turns=12, filler=1200, session="inspect-a")
        assert "compacted" in actions, actions
        check_ui(via.url, key, 12, tmp_path, content, "mock-content" if content else "mock")
    finally:
        up.close()


def test_inspector_page_is_off_without_a_token(compactor, tmp_path):
    up = ScriptedUpstream()
    try:
        via = compactor(up.url)
        p, b = browser()
        try:
            page = b.new_page()
            page.goto(via.url + "/_compactor/ui")
            assert "inspector is disabled" in page.inner_text("body")
        finally:
            b.close()
            p.stop()
    finally:
        up.close()


def test_inspector_with_real_llama(llama, compactor, tmp_path):
    via = compactor(llama.url, config=f'[admin]\ntoken = "{TOKEN}"\n')
    key, actions = converse(via.url, "gemma", turns=7, filler=1500, session="inspect-llama")
    assert "compacted" in actions, actions
    check_ui(via.url, key, 7, tmp_path, False, "llama")
