"""Where benchmark results go: one JSON file per run; and what a server's /metrics says."""
from __future__ import annotations

import json
import time
from pathlib import Path


def result_path(kind: str, path: str | None) -> Path:
    """``path``, or bench/results/<kind>-<time>.json."""
    return Path(path or f"bench/results/{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def write_result(result: dict, kind: str, path: str | Path | None, quiet: bool = False) -> Path:
    """Write ``result`` to ``path`` (default ``result_path(kind, None)``), whole: the file is
    replaced, never left half written (a run killed while writing keeps the previous one)."""
    out = Path(path) if path else result_path(kind, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=2, default=str))
    partial.replace(out)
    if not quiet:
        print(f"wrote {out}")
    return out


def metric_samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called ``name`` in a Prometheus /metrics body (a counter's with its ``_total``):
    (labels, value) each."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == name]
