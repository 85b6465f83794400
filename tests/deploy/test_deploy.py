"""The deployment files and the CLI agree, checked without a Docker engine
or a cluster (tests/compose runs docker-compose.yml for real):

- docker-compose.yml: every service's command (with the config files it
  names) parses with pdserve's own parser; ports, discovery names and
  health checks fit the servers; it reserves no GPU (it runs on CPU as it
  is) and docker-compose.gpu.yml gives each engine service one.
- Dockerfile: the base image is a build argument defaulting to the official
  Python image, the compose file passes the same defaults, the image
  installs the runtime pins only (requirements.txt; the test pins live in
  requirements-test.txt) and copies every package pyproject.toml installs.
- deploy/kubernetes: every manifest, and what the base and the overlays
  build to with the real ``kubectl kustomize``, validates strictly against
  the Kubernetes API schemas (kubernetes-validate); every pdserve
  container's arguments, with the ConfigMap's files, parse with the CLI's
  parser; probes, ports, GPUs, drain times and discovery names fit together.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdserve.cli import build_parser
from pdserve.cli.config_file import with_config_files
from tests.deploy.test_dependencies import NOT_INSTALLED_EXTRAS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
BASE, OVERLAY, TP_OVERLAY = K8S / "base", K8S / "overlays" / "example", K8S / "overlays" / "tensor-parallel"
CONFIG_DIR = BASE / "config"
_VAR = re.compile(r"\$\{([A-Z_]+)(?::?-([^}]*))?\}")
ENGINES = ("prefill", "decode")


def _parse(argv: list[str], files: dict[str, str]):
    """Parse ``pdserve`` arguments with the CLI's parser, reading ``--config``
    files from ``files`` (mount path -> YAML text)."""
    assert argv[0] in ("gateway", "prefill", "decode"), argv
    parser = build_parser(argv[0])

    def read(path: str):
        assert path in files, f"{path} is not a mounted config file"
        return yaml.safe_load(files[path])
    return parser.parse_args(with_config_files(parser, argv, read))


# ---- docker-compose.yml ---------------------------------------------------

def substitute(value: str) -> str:
    """Compose interpolation with each variable's default."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _mounted_config(service: dict) -> dict[str, str]:
    """/etc/pdserve/<file> -> contents, for a compose service mounting the config directory."""
    mounts = [v for v in service["volumes"] if v.endswith(":/etc/pdserve:ro")]
    assert mounts, "the config directory is not mounted"
    assert (ROOT / mounts[0].split(":")[0]).resolve() == CONFIG_DIR
    return {f"/etc/pdserve/{p.name}": p.read_text() for p in CONFIG_DIR.glob("*.yaml")}


def compose_argv(compose: dict, name: str) -> list[str]:
    """The pdserve arguments a compose service runs with (after its entrypoint)."""
    service = compose["services"][name]
    argv = [substitute(str(a)) for a in service["command"]]
    if name in ENGINES:  # sh -c 'exec pdserve "$@" --advertise-host <its IP>' pdserve <command>
        entrypoint = service["entrypoint"]
        assert entrypoint[:2] == ["sh", "-c"] and entrypoint[3] == "pdserve"
        assert entrypoint[2].startswith('exec pdserve "$$@" --advertise-host "$$(hostname -i')
        return argv + ["--advertise-host", "172.18.0.5"]
    assert argv[0] == "pdserve"
    return argv[1:]


def test_compose_topology_has_every_service(compose):
    assert {"gateway", "prefill", "decode", "redis", "jaeger"} <= set(compose["services"])


@pytest.mark.parametrize("name", ["gateway", "prefill", "decode"])
def test_compose_commands_parse_with_the_cli(compose, name):
    argv = compose_argv(compose, name)
    assert argv[0] == name
    args = _parse(argv, _mounted_config(compose["services"][name]))
    assert args.host == "0.0.0.0"  # containers bind every interface
    assert args.config == ["/etc/pdserve/shared.yaml", f"/etc/pdserve/{name}.yaml"]


def test_compose_ports_discovery_and_health_checks_fit(compose):
    from decode_service.server import DEFAULT_PORT as DECODE_PORT
    from prefill_service.server import DEFAULT_PORT as PREFILL_PORT

    s = compose["services"]
    files = _mounted_config(s["gateway"])
    pre, dec, gw = (_parse(compose_argv(compose, n), files) for n in ("prefill", "decode", "gateway"))
    assert (pre.port, dec.port) == (PREFILL_PORT, DECODE_PORT) == (50061, 50071)
    assert (gw.http_port, gw.grpc_port) == (8000, 50051)
    assert {"8000:8000", "50051:50051"} <= {substitute(p) for p in s["gateway"]["ports"]}
    for name in ENGINES:  # engines publish nothing: scaled services cannot share a host port
        assert "ports" not in s[name]
    # The gateway finds the engines by their service aliases, on their ports.
    assert gw.prefill == f"dns:pdserve-prefill:{PREFILL_PORT}" and gw.decode == f"dns:pdserve-decode:{DECODE_PORT}"
    assert "pdserve-prefill" in s["prefill"]["networks"]["default"]["aliases"]
    assert "pdserve-decode" in s["decode"]["networks"]["default"]["aliases"]
    # Redis and Jaeger answer to the same names as on Kubernetes.
    assert gw.redis_url == pre.redis_url == dec.redis_url == "redis://pdserve-redis:6379/0"
    assert "pdserve-redis" in s["redis"]["networks"]["default"]["aliases"]
    assert "pdserve-jaeger" in s["jaeger"]["networks"]["default"]["aliases"]
    for name, args in (("prefill", pre), ("decode", dec)):
        test = s[name]["healthcheck"]["test"]
        module = test[test.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
        assert test[-1] == f"127.0.0.1:{args.port}"
        assert _seconds(s[name]["stop_grace_period"]) > args.drain_timeout
    assert f"127.0.0.1:{gw.http_port}/health" in " ".join(s["gateway"]["healthcheck"]["test"])
    assert _seconds(s["gateway"]["stop_grace_period"]) > gw.shutdown_timeout


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def test_compose_reserves_no_gpu_and_the_gpu_override_one_per_engine(compose):
    for name, service in compose["services"].items():
        assert "deploy" not in service, f"{name}: `docker compose up` on a CPU-only host needs no device"
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) == set(ENGINES)
    for name in ENGINES:
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert gpu[name]["image"] != compose["services"][name]["image"]  # a CUDA image never mixes with the CPU one


def test_compose_exports_traces_to_jaeger(compose):
    s = compose["services"]
    assert s["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in s["jaeger"]["ports"] and "4317:4317" in s["jaeger"]["ports"]
    for name in ("gateway", "prefill", "decode"):
        assert s[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://pdserve-jaeger:4317"


def test_compose_environment_variables_are_named_after_flags(compose):
    s = compose["services"]
    for name in ("gateway", "prefill", "decode"):
        raw = [str(a) for a in s[name]["command"]]
        found = [(raw[i - 1], m.group(1)) for i, a in enumerate(raw) if (m := _VAR.search(a))]
        for flag, var in found:
            assert flag.startswith("--") and var == flag[2:].upper().replace("-", "_"), (name, flag, var)
        wanted = {"MODEL"} | ({"DTYPE", "DEVICE"} if name in ENGINES else set())
        assert wanted <= {var for _, var in found}, (name, found)


# ---- Dockerfile, requirements --------------------------------------------------

def _dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return {m.group(1): m.group(2).strip('"') for m in re.finditer(r"^ARG (\w+)=(.*)$", text, re.M)}


def test_the_base_image_is_a_build_argument_defaulting_to_the_official_python():
    text = (ROOT / "Dockerfile").read_text()
    args = _dockerfile_args()
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu" and args["CA_CERTS"] == ""


def test_compose_builds_with_the_dockerfiles_defaults(compose):
    for name in ("gateway", "prefill", "decode"):
        build = compose["services"][name]["build"]
        assert build["context"] == "."
        assert {k: substitute(v) for k, v in build["args"].items()} == _dockerfile_args()


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, version = line.split("==")
            pins[canonicalize_name(package)] = version
    return pins


def test_requirements_are_split_into_runtime_and_test_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    extras = {canonicalize_name(Requirement(r).name) for group in project["optional-dependencies"].values()
              for r in group}
    runtime, test = _pins("requirements.txt"), _pins("requirements-test.txt")
    assert set(runtime) <= declared, set(runtime) - declared
    assert set(test) <= extras, set(test) - extras
    unpinned = {canonicalize_name(d) for d in NOT_INSTALLED_EXTRAS.values()}  # built from source, not installed
    assert extras - unpinned <= set(test), extras - unpinned - set(test)  # every test pin is in the test file
    assert not set(runtime) & set(test)


def test_the_image_installs_runtime_pins_and_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    assert "requirements.txt" in text and "requirements-test" not in text
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", text, re.M))
    assert {p.rstrip("*") for p in packages} == copied
    # .dockerignore is an allowlist: each path the Dockerfile copies is let through.
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    sources = {src.rstrip("/") for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M)
               for src in line.split()}
    sources = {s if not s.startswith("engine/") else "engine" for s in sources}
    let_through = {s for s in sources if any(a == s or a.startswith(s + "/") for a in allowed)}
    assert sources == let_through, sources - let_through


# ---- Kubernetes: what kubectl kustomize builds -------------------------------

def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build(directory: Path) -> list[dict]:
    """What ``kubectl kustomize directory`` makes: the objects a cluster gets."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it builds the kustomizations)")
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _containers(objects: list[dict]) -> list[dict]:
    return [c for o in objects if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]]


# The oldest Kubernetes whose defaults run these manifests (the preStop
# sleep action is on by default from 1.30), and the newest schemas at hand.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())


def _validate(obj: dict, where: str) -> None:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{where}: {obj['kind']}/{obj['metadata'].get('name')} (Kubernetes {version}): "
                                 f"{'.'.join(map(str, e.path))}: {e.message}") from None


@pytest.fixture(scope="module", params=["base", "overlay", "tensor-parallel"])
def built(request) -> list[dict]:
    return build({"base": BASE, "overlay": OVERLAY, "tensor-parallel": TP_OVERLAY}[request.param])


def _manifest_files() -> list[Path]:
    """Every Kubernetes object file (not kustomizations, patches or pdserve config)."""
    files = [p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"
             and CONFIG_DIR not in p.parents and "patches" not in p.parts]
    assert len(files) >= 6, files
    return files


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_strictly(path):
    for obj in _load_all(path):
        _validate(obj, str(path.relative_to(ROOT)))


def test_what_the_kustomizations_build_validates_strictly(built):
    assert {o["kind"] for o in built} >= {"Deployment", "Service", "ConfigMap"}
    for obj in built:
        _validate(obj, "built")


def test_the_schema_check_is_strict():
    obj = _load_all(BASE / "gateway.yaml")[0]
    obj["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health"}}
    with pytest.raises(AssertionError, match="readinesProbe"):
        _validate(obj, "typo")


# ---- Kubernetes: the pdserve containers ---------------------------------------

def _config_map(objects: list[dict]) -> dict:
    """The generated pdserve-config ConfigMap (its name carries a hash of its contents)."""
    found = [o for o in objects if o["kind"] == "ConfigMap" and
             re.fullmatch(r"pdserve-config-[a-z0-9]{10}", o["metadata"]["name"])]
    assert len(found) == 1, [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    return found[0]


def _pdserve_containers(objects: list[dict]) -> dict[str, tuple[dict, dict, object]]:
    """role -> (pod spec, container, parsed arguments) for each pdserve container."""
    config_map = _config_map(objects)
    config = config_map["data"]
    out = {}
    for o in objects:
        if o["kind"] != "Deployment":
            continue
        spec = o["spec"]["template"]["spec"]
        for c in spec["containers"]:
            if c.get("command") != ["pdserve"]:
                continue
            mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
            volume = next(v for v in spec["volumes"] if v["name"] == "config")
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            files = {f"{mount}/{name}": text for name, text in config.items()}
            env = {e["name"] for e in c.get("env", [])}
            argv = [re.sub(r"\$\((\w+)\)", lambda m: "10.1.2.3" if m.group(1) in env else m.group(0), a)
                    for a in c["args"]]
            out[argv[0]] = (spec, c, _parse(argv, files))
    assert set(out) == {"gateway", "prefill", "decode"}, set(out)
    return out


def _port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def _service(objects: list[dict], name: str) -> dict:
    return _find(objects, "Service", name)


def test_engine_servers_have_gpus_grpc_probes_drain_and_headless_services(built):
    for role, (spec, c, args) in _pdserve_containers(built).items():
        if role not in ENGINES:
            continue
        assert args.host == "0.0.0.0" and args.advertise_host == "10.1.2.3"  # $(POD_IP)
        assert next(e for e in c["env"] if e["name"] == "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == \
            "status.podIP"
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert _port(c, "grpc") == args.port and _port(c, "metrics") == args.metrics_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == args.port, probe  # grpc.health.v1 on the server's own port
        # SIGTERM comes after preStop; the drain must fit in what is left of the grace period.
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + args.drain_timeout + 10
        # The liveness probe tolerates NOT_SERVING for a whole drain.
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > args.drain_timeout
        svc = _service(built, f"pdserve-{role}")
        assert svc["spec"]["clusterIP"] == "None"  # headless: DNS answers with every ready pod
        assert svc["spec"]["selector"].items() <= spec_labels(built, f"pdserve-{role}").items()
        assert {p["port"] for p in svc["spec"]["ports"]} == {args.port, args.metrics_port}


def test_every_engine_has_a_gpu_per_tensor_parallel_rank(built):
    for role, (_, c, args) in _pdserve_containers(built).items():
        if role in ENGINES:
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == args.tensor_parallel_size, role
            shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")  # the ranks' NCCL/gloo
            volume = next(v for v in _find(built, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
                          ["volumes"] if v["name"] == shm["name"])
            assert volume["emptyDir"]["medium"] == "Memory"


def test_the_tensor_parallel_overlay_gives_prefill_two_ranks():
    containers = _pdserve_containers(build(TP_OVERLAY))
    assert containers["prefill"][2].tensor_parallel_size == 2 and containers["decode"][2].tensor_parallel_size == 1
    base = _pdserve_containers(build(BASE))
    assert base["prefill"][1]["args"] == containers["prefill"][1]["args"][:len(base["prefill"][1]["args"])]


def spec_labels(objects: list[dict], deployment: str) -> dict:
    return _find(objects, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def test_gateway_probes_over_http_and_finds_the_engines(built):
    containers = _pdserve_containers(built)
    spec, c, gw = containers["gateway"]
    assert gw.host == "0.0.0.0"
    assert _port(c, "http") == gw.http_port and _port(c, "grpc") == gw.grpc_port
    ready = c["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and _port(c, ready["port"]) == gw.http_port
    live = c["livenessProbe"]["httpGet"]
    assert live["path"] in ("/health", "/metrics") and _port(c, live["port"]) == gw.http_port
    assert spec["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + \
        gw.shutdown_timeout + 10
    svc = _service(built, "pdserve-gateway")
    assert {p["port"] for p in svc["spec"]["ports"]} == {gw.http_port, gw.grpc_port}
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    # Discovery: each tier's headless Service by name, on that tier's port.
    for role, entry in (("prefill", gw.prefill), ("decode", gw.decode)):
        port = containers[role][2].port
        assert entry == f"dns:pdserve-{role}:{port}", entry
    # Every pdserve service shares the Redis Service and exports traces to Jaeger's OTLP port.
    redis_port = _service(built, "pdserve-redis")["spec"]["ports"][0]["port"]
    otlp = next(p["port"] for p in _service(built, "pdserve-jaeger")["spec"]["ports"] if p["name"] == "otlp-grpc")
    for role, (_, container, args) in containers.items():
        assert args.redis_url == f"redis://pdserve-redis:{redis_port}/0", role
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://pdserve-jaeger:{otlp}", role


def test_the_example_overlay_sets_images_replicas_and_resources():
    base, overlay = build(BASE), build(OVERLAY)
    images = {c["name"]: c["image"] for c in _containers(overlay)}
    assert images["gateway"] == images["prefill"] == images["decode"] == "registry.example.com/ml/pdserve:0.1.0"
    assert {c["image"] for c in _containers(base) if c["name"] in ("gateway", "prefill", "decode")} == \
        {"pdserve:latest"}
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in overlay if o["kind"] == "Deployment"}
    assert replicas == {"pdserve-gateway": 2, "pdserve-prefill": 2, "pdserve-decode": 4, "pdserve-redis": 1,
                        "pdserve-jaeger": 1}
    for role in ENGINES:
        c = next(c for c in _containers(overlay) if c["name"] == role)
        b = next(c for c in _containers(base) if c["name"] == role)
        assert c["resources"] != b["resources"] and c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["args"] == b["args"] and c["readinessProbe"] == b["readinessProbe"]  # the patch touched only sizes
    assert {o["metadata"].get("namespace") for o in overlay if o["kind"] != "Namespace"} == {"pdserve"}
