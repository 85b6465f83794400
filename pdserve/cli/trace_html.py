"""`pdserve trace --html`: one self-contained page (inline CSS and script, no
network) with each trace's timeline, its time-to-first-token breakdown, and
the attributes and events of the span clicked. The bars are plain HTML, so
the timeline reads without scripting; the script fills the details panel and
marks ``<body data-ready="true">`` once it has run."""
from __future__ import annotations

import html
import json
from typing import Any

from pdserve.cli.trace_model import Trace, ttft_breakdown

_SERVICE_COLOURS = {"pdserve-gateway": "#4e79a7", "pdserve-prefill": "#f28e2b", "pdserve-decode": "#59a14f"}
_PHASE_COLOURS = {"gateway": "#4e79a7", "decode reservation": "#b07aa1", "prefill queue": "#edc948",
                  "prefill compute": "#f28e2b", "KV transfer": "#e15759", "first decode step": "#59a14f",
                  "rest": "#bab0ac"}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 4px}
.meta{color:#555;margin-bottom:12px}.mono{font-family:ui-monospace,monospace}
.tl{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 0}
.row{display:flex;align-items:center;height:24px;cursor:pointer}
.row:hover,.row.sel{background:#eef3fb}
.name{box-sizing:border-box;width:380px;flex:none;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;padding-left:8px}
.svc{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.track{position:relative;flex:1;height:16px;margin-right:110px}
.bar{position:absolute;top:0;height:16px;border-radius:3px;min-width:2px}
.bar.err{outline:2px solid #c00}
.dur{position:absolute;top:0;font-size:12px;color:#444;white-space:nowrap;padding-left:4px}
.ft{position:absolute;top:-4px;bottom:-4px;width:0;border-left:2px dashed #c33}
.stack{display:flex;height:22px;border-radius:4px;overflow:hidden;margin:8px 0;max-width:900px}
.legend span{display:inline-block;margin-right:16px}.sw{display:inline-block;width:10px;height:10px;margin-right:4px}
table{border-collapse:collapse;margin-top:8px}td{border-bottom:1px solid #eee;padding:2px 10px 2px 0;vertical-align:top}
.details{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;margin-top:12px;min-height:40px}
"""

_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById('trace-data').textContent);
  function cell(text) { var td = document.createElement('td'); td.textContent = text; return td; }
  function show(ti, si) {
    var span = data[ti].spans[si], panel = document.getElementById('details-' + ti);
    panel.textContent = '';
    var title = document.createElement('b');
    title.textContent = span.service + ' / ' + span.name + ' (' + span.duration_ms.toFixed(2) + ' ms, ' +
      span.kind.toLowerCase() + (span.status === 'ERROR' ? ', error' : '') + ')';
    panel.appendChild(title);
    var table = document.createElement('table');
    Object.keys(span.attributes).sort().forEach(function (k) {
      var tr = document.createElement('tr');
      tr.appendChild(cell(k)); tr.appendChild(cell(JSON.stringify(span.attributes[k])));
      table.appendChild(tr);
    });
    span.events.forEach(function (e) {
      var tr = document.createElement('tr');
      tr.appendChild(cell('event ' + e.name)); tr.appendChild(cell('+' + e.offset_ms.toFixed(2) + ' ms'));
      table.appendChild(tr);
    });
    panel.appendChild(table);
    document.querySelectorAll('.row[data-trace="' + ti + '"]').forEach(function (r) {
      r.classList.toggle('sel', +r.dataset.span === si);
    });
  }
  document.querySelectorAll('.row').forEach(function (r) {
    r.addEventListener('click', function () { show(+r.dataset.trace, +r.dataset.span); });
  });
  data.forEach(function (t, ti) { show(ti, t.request_span); });
  document.body.dataset.ready = 'true';
})();
"""


def _span_json(t: Trace) -> list[dict[str, Any]]:
    t0 = t.start_ns
    return [{"name": s.name, "service": s.service, "kind": s.kind, "status": s.status,
             "duration_ms": s.duration_ms, "attributes": s.attributes,
             "events": [{"name": e.get("name", ""), "offset_ms": (int(e["time_ns"]) - t0) / 1e6} for e in s.events]}
            for _, s in t.walk()]


def _request_index(t: Trace) -> int:
    """Position of the gateway's request span in tree order (shown first)."""
    root = t.root
    return next((i for i, (_, s) in enumerate(t.walk()) if s is root), 0)


def _trace_section(ti: int, t: Trace) -> str:
    t0 = t.start_ns
    total = max(1, max(s.end_ns for s in t.spans) - t0)
    ttft = t.ttft_ms
    esc = html.escape
    out = [f'<h2>request <span class="mono">{esc(t.request_id)}</span></h2>',
           f'<div class="meta">trace <span class="mono">{esc(t.trace_id)}</span> &middot; {len(t.spans)} spans '
           f'&middot; end to end {t.e2e_ms:.1f} ms'
           + (f' &middot; time to first token {ttft:.1f} ms' if ttft is not None else "") + "</div>",
           '<div class="tl">']
    for si, (depth, s) in enumerate(t.walk()):
        left = (s.start_ns - t0) / total * 100
        width = (s.end_ns - s.start_ns) / total * 100
        colour = _SERVICE_COLOURS.get(s.service, "#999")
        marker = (f'<div class="ft" style="left:{ttft * 1e6 / total * 100 + (t.root.start_ns - t0) / total * 100:.3f}%"'
                  f' title="first token"></div>' if ttft is not None else "")
        out.append(
            f'<div class="row" data-trace="{ti}" data-span="{si}" title="{esc(s.service)}: {esc(s.name)}">'
            f'<div class="name" style="padding-left:{8 + 16 * depth}px"><span class="svc" '
            f'style="background:{colour}"></span>{esc(s.name)}</div><div class="track">{marker}'
            f'<div class="bar{" err" if s.status == "ERROR" else ""}" style="left:{left:.3f}%;width:{width:.3f}%;'
            f'background:{colour}"></div><div class="dur" style="left:{min(left + width, 100):.3f}%">'
            f'{s.duration_ms:.1f} ms</div></div></div>')
    out.append("</div>")
    rows = ttft_breakdown(t)
    if rows:
        out.append("<h2>time to first token</h2><div class=\"stack\">")
        for name, ms in rows:
            if ms > 0 and ttft:
                out.append(f'<div style="width:{ms / ttft * 100:.3f}%;background:{_PHASE_COLOURS[name]}" '
                           f'title="{esc(name)}: {ms:.1f} ms"></div>')
        out.append('</div><div class="legend">')
        for name, ms in rows:
            out.append(f'<span><i class="sw" style="background:{_PHASE_COLOURS[name]}"></i>{esc(name)} '
                       f'{ms:.1f} ms</span>')
        out.append("</div>")
    out.append(f'<div class="details" id="details-{ti}"></div>')
    return "\n".join(out)


def render_html(traces: list[Trace]) -> str:
    """The page for ``traces`` (one section each)."""
    data = json.dumps([{"trace_id": t.trace_id, "spans": _span_json(t), "request_span": _request_index(t)}
                       for t in traces], default=str)
    legend = " ".join(f'<span><i class="sw" style="background:{c}"></i>{html.escape(s)}</span>'
                      for s, c in _SERVICE_COLOURS.items())
    title = f"pdserve trace {traces[0].request_id}" if len(traces) == 1 else f"pdserve: {len(traces)} slowest requests"
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>"
            f'<div class="legend meta">{legend} &middot; dashed line: first token &middot; click a row for details'
            f"</div>\n" + "\n".join(_trace_section(i, t) for i, t in enumerate(traces))
            + '\n<script type="application/json" id="trace-data">' + data.replace("</", "<\\/") + "</script>\n"
            f"<script>{_SCRIPT}</script>\n</body></html>\n")
