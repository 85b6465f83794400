"""Server-Sent Events framing as the OpenAI streaming API uses it:
``data: <json>\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``."""
from __future__ import annotations

import json
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


def sse_event(obj: Any) -> bytes:
    """One event carrying ``obj`` as compact JSON. ``json.dumps`` escapes
    newlines inside strings, so the payload never breaks the framing."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
