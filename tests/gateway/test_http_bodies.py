"""Request bodies as clients really send them, against a real gateway process
(tests/gateway/conftest.py): a JSON body is read as JSON whatever its
Content-Type says (none, text/plain, curl's -d form type), and a body that is
not a JSON object is an OpenAI-shaped 400 ``invalid_json`` that says where
(line and column) and, when it did not come as JSON, what it came as."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.conftest import API_KEY

BODY = json.dumps({"prompt": "Hello", "max_tokens": 3}).encode()
BAD = b'{"prompt": "Hello",\n  "max_tokens": 3,\n}'  # a trailing comma: line 3, column 1
AS_JSON = "application/json"


def _post(cluster, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(cluster.main.http_url + "/v1/completions", content=body, headers=headers, timeout=20)


@pytest.mark.parametrize("content_type", [AS_JSON, None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=utf-8"])
def test_a_json_body_is_served_whatever_its_content_type(cluster, content_type):
    r = _post(cluster, BODY, content_type)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_json"}}


SENT_AS = "; send JSON with Content-Type: application/json)"


@pytest.mark.parametrize("body, content_type, message", [
    (BAD, AS_JSON, "the request body is not valid JSON: Expecting property name enclosed in double quotes at "
                   "line 3, column 1"),
    (b'{"prompt": "a" "max_tokens": 3}', AS_JSON,
     "the request body is not valid JSON: Expecting ',' delimiter at line 1, column 16"),
    (BAD, "text/plain", "the request body is not valid JSON: Expecting property name enclosed in double quotes at "
                        "line 3, column 1 (it was sent as Content-Type: text/plain" + SENT_AS),
    (b"prompt=Hello", None, "the request body is not valid JSON: Expecting value at line 1, column 1 (it was sent "
                            "without a Content-Type" + SENT_AS),
    (b"", AS_JSON, "the request body is empty; send a JSON object"),
    (b'["Hello"]', AS_JSON, "the request body must be a JSON object, got an array"),
    (b'"Hello"', "text/plain", "the request body must be a JSON object, got a string (it was sent as "
                               "Content-Type: text/plain" + SENT_AS),
    (b'{"prompt": "\xff"}', AS_JSON, "the request body cannot be read as JSON: it is not UTF-8 text, or it is nested too deeply"),
])
def test_a_body_that_is_not_a_json_object_says_where_and_what(cluster, body, content_type, message):
    r = _post(cluster, body, content_type)
    assert (r.status_code, r.json()) == (400, _error(message))
