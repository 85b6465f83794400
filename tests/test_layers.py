"""Packages import only downward, and no project modules import each other in a circle.

Layers, lowest first; a module may import its own package and the layers listed beside it:

    pdserve.v1         generated gRPC stubs                   nothing of the project
    kernels            Triton launchers + references          nothing of the project
    engine             model, KV cache, scheduler             kernels
    kv_transfer        KV pairs and the two KV roles          engine, kernels
    rpc                gRPC plumbing the servers share        engine, kv_transfer, kernels, pdserve.v1
    gateway            the front end (no torch)               rpc, pdserve.v1, and the engine's torch-free
                                                              shared values (GATEWAY_SHARED_VALUES)
    prefill_service,   the two engine servers                 engine, kv_transfer, rpc, kernels, pdserve.v1
    decode_service
    cli                pdserve.cli: up, trace, --config       everything but tests
    bench              benchmarks                             everything but tests
    tests                                                     everything

The ``pdserve`` package holds only the stubs (pdserve.v1) and the CLI (pdserve.cli); its
``__init__`` belongs with the stubs and imports nothing, so a service that imports the stubs
does not run the CLI's code. Every module of a top-level package has a layer.

So nothing but the CLI, bench and the tests imports the CLI or bench. Every import the
parser sees counts, wherever it is: at module level, inside a function (a lazy import
climbs all the same) or under ``if TYPE_CHECKING``. An import is an edge to the most
specific project module it names: ``from engine.block_hash import NONE_HASH`` to
engine.block_hash, ``from kernels import prefill_attention`` to kernels.prefill_attention,
``from engine import LLM`` to engine (its ``__init__``). The ``__init__`` of the parent
packages that Python runs on the way is not an edge (every package that re-exports a
submodule would otherwise sit in a circle with it). ``importlib.import_module`` with a
computed name is invisible here.

``KNOWN_CLIMBS`` and ``KNOWN_CYCLES`` list what is wrong today, each with the reason and
the change that removes it. A listed exception that no longer occurs fails
``test_known_exceptions_still_occur``: delete it, so the lists only shrink.
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# layer -> the other layers it may import
LAYERS: dict[str, frozenset[str]] = {
    "pdserve.v1": frozenset(),
    "kernels": frozenset(),
    "engine": frozenset({"kernels"}),
    # the KV pairs and the two roles of KV transfer: below the services and rpc, above the
    # engine, whose value objects and named operations it uses (the engine never imports it)
    "kv_transfer": frozenset({"engine", "kernels"}),
    "rpc": frozenset({"engine", "kv_transfer", "kernels", "pdserve.v1"}),
    "gateway": frozenset({"rpc", "pdserve.v1"}),
    "prefill_service": frozenset({"engine", "kv_transfer", "rpc", "kernels", "pdserve.v1"}),
    "decode_service": frozenset({"engine", "kv_transfer", "rpc", "kernels", "pdserve.v1"}),
    "cli": frozenset({"pdserve.v1", "kernels", "engine", "kv_transfer", "rpc", "gateway", "prefill_service",
                      "decode_service", "bench"}),
    "bench": frozenset({"pdserve.v1", "kernels", "engine", "kv_transfer", "rpc", "gateway", "prefill_service",
                        "decode_service", "cli"}),
    "tests": frozenset({"pdserve.v1", "kernels", "engine", "kv_transfer", "rpc", "gateway", "prefill_service",
                        "decode_service", "cli", "bench"}),
}

# The gateway shares values with the engine through these torch-free engine modules: the
# sampling parameters and structured-output specs it validates and forwards, the chained
# block hash it routes by (it must equal the engine's), the tokenizer and incremental
# detokenizer, the model's files and shape, a size parser. The gateway may import them and
# no other engine module; tests/gateway/test_gateway_imports.py checks that its process
# never loads torch.
GATEWAY_SHARED_VALUES = frozenset({
    "engine.block_hash", "engine.config", "engine.detokenizer", "engine.model_files", "engine.sampling_params",
    "engine.structured_outputs", "engine.tokenizer",
})

# (importing module, imported module) -> why it is allowed for now
KNOWN_CLIMBS: dict[tuple[str, str], str] = {}

# the modules of one circle -> why it is allowed for now
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def layer_of(module: str) -> str | None:
    top = module.split(".")[0]
    if top == "pdserve":  # pdserve/__init__.py and pdserve/v1/: the stubs; pdserve/cli/: the CLI
        second = module.split(".")[1] if "." in module else None
        return {None: "pdserve.v1", "v1": "pdserve.v1", "cli": "cli"}.get(second)
    return top if top in LAYERS else None


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.text}"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every project module: name -> (file, whether it is a package's __init__)."""
    modules = {}
    for package in _top_level_packages():
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _top_level_packages() -> list[str]:
    return sorted(p.name for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _project_module(name: str, modules: dict) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


@functools.lru_cache(maxsize=None)
def _imports() -> tuple[Import, ...]:
    modules = _modules()
    found = []
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package holding this module, up level - 1
                    base = module.split(".")[:None if is_package else -1]
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # from X import name: the submodule X.name where there is one, else X
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
            else:
                continue
            for target in {_project_module(name, modules) for name in names} - {None, module}:
                found.append(Import(module, target, path, node.lineno, ast.unparse(node)))
    return tuple(found)


def _climbs(imports: tuple[Import, ...]) -> list[Import]:
    return [i for i in imports if layer_of(i.source) in LAYERS and layer_of(i.source) != layer_of(i.target)
            and layer_of(i.target) not in LAYERS[layer_of(i.source)]]


def _cycles(imports: tuple[Import, ...]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _one_circle(component: list[str], imports: tuple[Import, ...]) -> list[Import]:
    """A shortest circle through the component's first module, as the imports that make it."""
    members = set(component)
    edges: dict[str, list[Import]] = defaultdict(list)
    for i in sorted(imports, key=lambda i: (i.source, i.target, i.line)):
        if i.source in members and i.target in members:
            edges[i.source].append(i)
    start = component[0]
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for i in edges[node]:
            if i.target == start:
                path = [i]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if i.target not in came_by:
                came_by[i.target] = i
                queue.append(i.target)
    raise AssertionError(f"no circle through {start} in {component}")


def test_every_package_has_a_layer():
    missing = [p for p in _top_level_packages() if layer_of(p) is None]
    if missing:
        pytest.fail(f"top-level packages with no layer (add them to LAYERS in {Path(__file__).name}): {missing}",
                    pytrace=False)
    # e.g. a module written into pdserve/ beside the stubs instead of into pdserve/cli/
    stray = sorted(m for m in _modules() if layer_of(m) is None)
    if stray:
        pytest.fail(f"modules with no layer: {stray}", pytrace=False)


def test_pdserve_init_imports_nothing():
    """rpc/ and the services import pdserve.v1, which runs pdserve/__init__.py first."""
    path, _ = _modules()["pdserve"]
    imports = [ast.unparse(n) for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == [], f"{path.relative_to(REPO)} imports {imports}"


def _shared_value(i: Import) -> bool:
    return layer_of(i.source) == "gateway" and i.target in GATEWAY_SHARED_VALUES


def test_imports_only_go_down():
    lines = []
    for i in _climbs(_imports()):
        if (i.source, i.target) not in KNOWN_CLIMBS and not _shared_value(i):
            allowed = ", ".join(sorted(LAYERS[layer_of(i.source)])) or "nothing of the project"
            lines.append(f"{i.where()}\n    {layer_of(i.source)} imports {layer_of(i.target)}; it may import: {allowed}")
    if lines:
        pytest.fail("imports that climb a layer:\n" + "\n".join(lines), pytrace=False)


def test_no_import_circles():
    imports = _imports()
    lines = []
    for component in _cycles(imports):
        if frozenset(component) in KNOWN_CYCLES:
            continue
        circle = _one_circle(component, imports)
        lines.append(" -> ".join([i.source for i in circle] + [circle[0].source])
                     + (f"  (one circle of several among {', '.join(component)})" if len(component) > len(circle) else "")
                     + "".join(f"\n    {i.where()}" for i in circle))
    if lines:
        pytest.fail("import circles:\n" + "\n".join(lines), pytrace=False)


def test_known_exceptions_still_occur():
    imports = _imports()
    climbs = {(i.source, i.target) for i in _climbs(imports)}
    cycles = {frozenset(c) for c in _cycles(imports)}
    gone = [f"KNOWN_CLIMBS {key}" for key in KNOWN_CLIMBS if key not in climbs]
    gone += [f"KNOWN_CYCLES {sorted(key)}" for key in KNOWN_CYCLES if key not in cycles]
    if gone:
        pytest.fail("no longer occur, so delete them from the allow-list:\n" + "\n".join(gone), pytrace=False)
