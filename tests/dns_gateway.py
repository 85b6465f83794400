"""``pdserve gateway ...`` with names resolved from a JSON file instead of DNS,
for tests that change what a name resolves to while the gateway runs.

    PDSERVE_TEST_HOSTS=hosts.json python -m tests.dns_gateway --prefill dns:p.test:50061 ...

hosts.json maps a name to its addresses, e.g. ``{"p.test": ["127.0.0.2",
"127.0.0.3"]}``, and is read at every look-up (replace it atomically); a name
it lacks does not exist. Everything else is the real gateway.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gateway import discovery
from gateway.config import join_host_port
from pdserve.cli import main


def resolve_from_file(name: str, port: int) -> list[str]:
    hosts = json.loads(Path(os.environ["PDSERVE_TEST_HOSTS"]).read_text())
    return [join_host_port(host, port) for host in hosts.get(name, [])]


if __name__ == "__main__":
    discovery.resolve_host = resolve_from_file
    sys.exit(main(["gateway", *sys.argv[1:]]))
