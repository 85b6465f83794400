"""Where benchmark results go: one JSON file per run."""
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
