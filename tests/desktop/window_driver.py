"""Runs `rebar desktop`'s window (rebar.desktop.window.run_window, as the command does) and drives
its page from inside: the page's own key works and other callers are refused, a PDF goes in through
the Documents view's file input, the summary appears, a screenshot is taken, the same PDF is
dropped on the panel (the server's summary cache answers), then the window closes. Writes what it saw as JSON.

    python window_driver.py CONFIG DOCUMENT SCREENSHOT RESULT_JSON   (DISPLAY set)
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rebar.desktop.server import EmbeddedServer
from rebar.desktop.window import WindowOptions, run_window

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the suite's own waits
from waiting import wait_until

GENERATION_TIMEOUT_S = 240.0

# Puts the document into the page's file input (what choosing it in the file dialog does) and
# asks for key points.
OPEN_DOCUMENT = """(() => {
  const bytes = Uint8Array.from(atob(%s), (c) => c.charCodeAt(0));
  const files = new DataTransfer();
  files.items.add(new File([bytes], %s, { type: "application/pdf" }));
  document.getElementById("documents").open = true;
  const input = document.getElementById("document-file");
  input.files = files.files;
  input.dispatchEvent(new Event("change", { bubbles: true }));
  document.getElementById("document-style").value = "key_points";
  document.getElementById("document-summarize").click();
  return input.files.length;
})()"""
# Drops the same document on the Documents panel, as a file dragged from a file manager arrives;
# true when the page took it (its drop handler cancels the browser's default).
DROP_DOCUMENT = """(() => {
  const bytes = Uint8Array.from(atob(%s), (c) => c.charCodeAt(0));
  const files = new DataTransfer();
  files.items.add(new File([bytes], %s, { type: "application/pdf" }));
  document.getElementById("document-progress").textContent = "";
  const drop = new DragEvent("drop", { dataTransfer: files, bubbles: true, cancelable: true });
  return !document.getElementById("document-drop").dispatchEvent(drop);
})()"""
STATEMENTS = """[...document.querySelectorAll("#document-summary .statement")].map(
  (item) => [item.querySelector("span").textContent, item.querySelector(".pages").textContent])"""
TAKE_SCREENSHOT = """
import sys, gi
gi.require_version("Gdk", "3.0")
from gi.repository import Gdk
root = Gdk.get_default_root_window()
Gdk.pixbuf_get_from_window(root, 0, 0, root.get_width(), root.get_height()).savev(
    sys.argv[1], "png", [], [])
"""


def wait_for(window: Any, script: str, timeout_s: float) -> Any:
    """The page's value of `script` once it is truthy (the timeout only bounds a hang)."""
    if not wait_until(lambda: window.evaluate_js(script), timeout_s, poll_s=0.2):
        raise AssertionError(f"timed out waiting for {script!r}")
    return window.evaluate_js(script)


def status_of(url: str, key: str | None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as error:
        return error.code


def drive(window: Any, server: EmbeddedServer, document: Path, screenshot: Path) -> dict:
    seen: dict[str, Any] = {"port": server.port, "server_pid": server.pid}
    seen["address_after_load"] = window.evaluate_js("location.href")
    seen["page_key_matches"] = window.evaluate_js("document.getElementById('api-key').value") == (
        server.key
    )
    models = f"{server.base_url}/v1/models"
    seen["status_without_key"] = status_of(models, None)
    seen["status_with_wrong_key"] = status_of(models, "not-the-window-key")
    seen["status_with_key"] = status_of(models, server.key)
    seen["model"] = wait_for(window, "document.getElementById('model').value", 120)
    # The page lists the model before it has loaded.
    ready = wait_until(lambda: status_of(f"{server.base_url}/ready", None) == 200, 120, 0.2)
    assert ready, "the window's server never became ready"
    payload = json.dumps(base64.b64encode(document.read_bytes()).decode())
    seen["files_in_input"] = window.evaluate_js(
        OPEN_DOCUMENT % (payload, json.dumps(document.name))
    )
    done = f"['{document.name}: done', '{document.name}: error'].some((s) => " + (
        "document.getElementById('document-progress').textContent.startsWith(s))"
    )
    wait_for(window, done, GENERATION_TIMEOUT_S)
    seen["progress"] = window.evaluate_js(
        "document.getElementById('document-progress').textContent"
    )
    seen["statements"] = window.evaluate_js(STATEMENTS)
    subprocess.run([sys.executable, "-c", TAKE_SCREENSHOT, str(screenshot)], check=True)
    seen["drop_taken"] = window.evaluate_js(DROP_DOCUMENT % (payload, json.dumps(document.name)))
    wait_for(window, done, GENERATION_TIMEOUT_S)
    seen["dropped_progress"] = window.evaluate_js(
        "document.getElementById('document-progress').textContent"
    )
    seen["dropped_statements"] = window.evaluate_js(STATEMENTS)
    return seen


def main() -> None:
    config, document, screenshot, result = (Path(arg) for arg in sys.argv[1:5])
    seen: dict[str, Any] = {}
    server = EmbeddedServer(config=config)
    run_window(
        server,
        WindowOptions(),
        lambda window, srv: seen.update(drive(window, srv, document, screenshot)),
    )
    result.write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
