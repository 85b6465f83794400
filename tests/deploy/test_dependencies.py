"""pyproject.toml declares what the code imports, as ranges that admit the
exact pins of requirements.txt and requirements-test.txt (what `make` installs), and torch's range
cannot pull a newer (CUDA) build onto a CPU machine."""
from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kv_transfer", "kernels", "rpc", "gateway", "prefill_service", "decode_service", "pdserve", "bench")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(group: str | None = None) -> dict[str, Requirement]:
    project = _project()
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def _pins() -> dict[str, str]:
    """The exact pins of both locks: runtime (requirements.txt) and test (requirements-test.txt)."""
    pins = {}
    for lock in ("requirements.txt", "requirements-test.txt"):
        for line in (ROOT / lock).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):  # "-r requirements.txt" includes the other lock
                name, version = line.split("==")
                pins[canonicalize_name(name)] = version
    return pins


def _optional_features() -> dict[str, Requirement]:
    """The extras other than "test": features imported only where a flag or a bench asks."""
    groups = set(_project()["optional-dependencies"]) - {"test"}
    return {n: r for g in sorted(groups) for n, r in _declared(g).items()}


def test_every_pin_is_declared_and_inside_its_range():
    declared = {**_declared(), **_declared("test"), **_optional_features()}
    pins = _pins()
    assert set(pins) <= set(declared), set(pins) - set(declared)
    outside = {n: (pins[n], str(declared[n].specifier)) for n in pins
               if not declared[n].specifier.contains(pins[n], prereleases=True)}
    assert not outside, outside


def test_torch_range_stops_at_the_pinned_cpu_build():
    torch = _declared()["torch"].specifier
    pin = _pins()["torch"]
    assert torch.contains(pin) and torch.contains(pin + "+cpu")
    major, minor, patch = map(int, pin.split("."))
    for newer in (f"{major}.{minor}.{patch + 1}", f"{major}.{minor + 1}.0", f"{major + 1}.0.0"):
        assert not torch.contains(newer), newer


def _third_party_imports() -> set[str]:
    """Top-level modules imported anywhere in the shipped packages, minus the
    standard library and the packages themselves."""
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


# Optional peers the suite does not install (built from source), by the module they import as.
NOT_INSTALLED_EXTRAS = {"llama_cpp": "llama-cpp-python"}  # bench.local's llama.cpp


def test_every_imported_distribution_is_a_runtime_dependency():
    # ... or of an optional extra ("plot" for --plot, "compare" for bench.grammar_engines).
    runtime = set(_declared()) | set(_optional_features())
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_third_party_imports()):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        if not dists and module in NOT_INSTALLED_EXTRAS:
            assert canonicalize_name(NOT_INSTALLED_EXTRAS[module]) in set(_optional_features()), module
            continue
        assert dists, f"{module} is imported but no installed distribution provides it"
        if not dists & runtime:
            missing[module] = sorted(dists)
    assert not missing, f"imported but not in [project] dependencies: {missing}"
