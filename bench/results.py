"""Where benchmark results go: one JSON file per run; and what a server's /metrics says."""
from __future__ import annotations

import json
import time
from pathlib import Path


def write_result(result: dict, kind: str, path: str | None) -> Path:
    """Write ``result`` to ``path`` (default bench/results/<kind>-<time>.json)."""
    out = Path(path or f"bench/results/{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")
    return out


def metric_samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called ``name`` in a Prometheus /metrics body (a counter's with its ``_total``):
    (labels, value) each."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == name]
