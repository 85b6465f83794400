"""The `pdserve trace --html` page in real headless Chromium: it loads from a
file with no console message (so no script error), its script runs to the
end (``data-ready``) and fills the details panel with the request span's
attributes. Skipped when no Chromium is installed (Debian: ``chromium``)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pdserve.cli import trace_model
from pdserve.cli.trace_html import render_html
from tests.tracing.trace_samples import write_sample_file

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")


def _load(page) -> tuple[str, str]:
    """(DOM after scripts ran, Chromium's log)."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def test_page_loads_without_errors_and_its_script_runs(tmp_path):
    traces = trace_model.load_file(str(write_sample_file(tmp_path / "t.jsonl")))
    page = tmp_path / "trace.html"
    page.write_text(render_html([trace_model.find_request(traces, "cmpl-a")[0]]
                                + trace_model.slowest(traces.values(), 2)))
    dom, log = _load(page)
    assert re.findall(r"CONSOLE[^\n]*", log) == []
    assert 'data-ready="true"' in dom
    # The script filled each trace's details panel with its request span.
    panel = re.search(r'<div class="details" id="details-0">(.*?)</div>', dom, re.S).group(1)
    assert "pdserve-gateway / text_completion m" in panel and "pdserve.request_id" in panel
    assert dom.count('class="details" id="details-') == 3


def test_a_script_error_would_be_seen(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>document.body.dataset.ready = missing.value;</script></body></html>")
    dom, log = _load(page)
    assert "Uncaught ReferenceError" in log and 'data-ready="true"' not in dom
