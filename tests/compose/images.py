"""The images the compose test runs, made on a machine that may not reach
Docker Hub.

- Base images. ``python:3.11-slim`` (the Dockerfile's default base) and
  ``redis:7-alpine`` are pulled when Docker Hub answers. Where it does not,
  stand-ins are built from Debian bookworm packages (debootstrap; Python 3.11
  and Debian's redis-server) and imported as ``pdserve-stand-in/python:3.11-slim``
  and ``pdserve-stand-in/redis:7-alpine``: never under the official names. The
  build then gets ``BASE_IMAGE`` and the test's override file ``REDIS_IMAGE``.
  A stand-in is kept in the Docker engine and saved under ``$PDSERVE_DOCKER_CACHE``
  (default ``~/.cache/pdserve/docker``), so later runs load it in seconds; a
  change of its recipe builds it again.
- torch. The image takes PyTorch's CPU wheel from download.pytorch.org; where
  that cannot be reached, the CPU wheel of the pinned release from pip's
  ``find-links`` is put in deploy/docker/wheels and ``TORCH_INDEX`` is emptied.
- CA certificates. Certificates that this machine's pip trusts (``PIP_CERT`` or
  ``pip config``'s ``cert``) and the base image does not (a TLS-intercepting
  proxy's root) go to the build as ``CA_CERTS``.
- pdserve's image, built by ``docker-compose build`` from docker-compose.yml
  with those build arguments, as a user behind a proxy would.

``python -m tests.compose.images`` does all of it and prints what it chose,
the time taken and the image size.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PDSERVE_IMAGE = "pdserve:latest"
WHEELS = ROOT / "deploy" / "docker" / "wheels"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SUITE = "bookworm"  # Debian 12: Python 3.11, as in python:3.11-slim
STAND_IN_LABEL = "org.pdserve.stand-in"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class StandIn:
    official: str
    packages: tuple[str, ...]
    changes: tuple[str, ...]  # docker import --change
    files: tuple[tuple[str, str], ...] = ()  # (path in the root file system, text), made executable

    @property
    def name(self) -> str:
        return f"pdserve-stand-in/{self.official}"

    @property
    def recipe(self) -> str:
        text = json.dumps([SUITE, self.packages, self.changes, self.files])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


STAND_INS = {
    "python": StandIn("python:3.11-slim", ("python3", "python3-venv", "ca-certificates"),
                      (f"ENV PATH={_PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]')),
    # The official image turns protected mode off (containers reach it over
    # their network, not loopback); so does this wrapper.
    "redis": StandIn("redis:7-alpine", ("redis-server",),
                     (f"ENV PATH={_PATH}", "EXPOSE 6379", 'CMD ["redis-server"]'),
                     (("usr/local/bin/redis-server",
                       '#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n'),)),
}


def log(message: str) -> None:
    print(f"[compose-test] {message}", flush=True)


def docker(*args: str, check: bool = True, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=check, timeout=timeout, text=True, capture_output=True, **kw)


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def image_label(name: str, label: str) -> str | None:
    out = docker("image", "inspect", "-f", "{{json .Config.Labels}}", name, check=False)
    if out.returncode:
        return None
    return (json.loads(out.stdout) or {}).get(label)


def image_size(name: str) -> int:
    return int(docker("image", "inspect", "-f", "{{.Size}}", name).stdout)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_DOCKER_CACHE") or Path.home() / ".cache" / "pdserve" / "docker")


# ---- base images ------------------------------------------------------------

@dataclass(frozen=True)
class BaseImages:
    python: str
    redis: str
    stand_ins: bool


def base_images() -> BaseImages:
    """The official base images when Docker Hub gives them, else stand-ins."""
    official = [s.official for s in STAND_INS.values()]
    if all(_official_present(name) or _pull(name) for name in official):
        log(f"base images: {', '.join(official)} from Docker Hub")
        return BaseImages(*official, stand_ins=False)
    log("Docker Hub cannot be reached: the base images are STAND-INS built from Debian "
        f"{SUITE} packages (debootstrap), for this test only")
    for stand_in in STAND_INS.values():
        ensure_stand_in(stand_in)
    return BaseImages(STAND_INS["python"].name, STAND_INS["redis"].name, stand_ins=True)


def _official_present(name: str) -> bool:
    return image_exists(name) and image_label(name, STAND_IN_LABEL) is None


def _pull(name: str) -> bool:
    try:
        return docker("pull", "-q", name, check=False, timeout=600).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def ensure_stand_in(s: StandIn) -> None:
    if image_label(s.name, STAND_IN_LABEL) == s.recipe:
        log(f"  {s.name} (stands in for {s.official}): in the Docker engine already")
        return
    saved = cache_dir() / f"{s.name.replace('/', '_').replace(':', '_')}-{s.recipe}.tar"
    if saved.is_file():
        docker("load", "-q", "-i", str(saved))
        log(f"  {s.name} (stands in for {s.official}): loaded from {saved}")
        return
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-stand-in-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(s.packages)}", SUITE,
                        str(rootfs), debian_mirror()], check=True, stdout=subprocess.DEVNULL)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                     "usr/share/info"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        for path, text in s.files:
            (rootfs / path).write_text(text)
            (rootfs / path).chmod(0o755)
        changes = [*s.changes, f"LABEL {STAND_IN_LABEL}={s.recipe}"]
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", *(a for c in changes for a in ("--change", c)), "-", s.name],
                       stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        if tar.wait():
            raise RuntimeError(f"tar of {rootfs} failed")
    saved.parent.mkdir(parents=True, exist_ok=True)
    partial = saved.with_suffix(".partial")
    docker("save", "-o", str(partial), s.name)
    partial.replace(saved)
    log(f"  {s.name} (stands in for {s.official}): built from Debian packages in {time.monotonic() - start:.0f} s, "
        f"saved to {saved}")


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 or one-line sources)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text()
        for m in re.finditer(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            uri = m.group(1) or m.group(2)
            if "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


# ---- build arguments --------------------------------------------------------

def pip_config(key: str) -> str | None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, value = line.partition("=")
        if name.rsplit(".", 1)[-1] == key:
            return value.strip().strip("'\"")
    return None


def _pem_blocks(text: str) -> list[str]:
    return re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)


def extra_ca_certs(base: str) -> str:
    """PEM of the certificates pip trusts here that ``base`` does not."""
    bundle = os.environ.get("PIP_CERT") or pip_config("cert")
    if not bundle or not Path(bundle).is_file():
        return ""
    ours = _pem_blocks(Path(bundle).read_text())
    theirs = docker("run", "--rm", "--network", "none", "--entrypoint", "cat", base,
                    "/etc/ssl/certs/ca-certificates.crt", check=False).stdout
    known = {"".join(b.split()) for b in _pem_blocks(theirs)}
    extra = [b for b in ours if "".join(b.split()) not in known]
    if extra:
        log(f"CA certificates: {len(extra)} that {bundle} holds and {base} lacks go to the build as CA_CERTS")
    return "\n".join(extra)


def torch_pin() -> str:
    return re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)


def torch_index() -> str:
    """TORCH_INDEX for the build: PyTorch's CPU index, or empty with the CPU
    wheel from pip's find-links in deploy/docker/wheels."""
    try:
        urllib.request.urlopen(TORCH_CPU_INDEX + "/torch/", timeout=15).close()
        log(f"torch: the CPU build from {TORCH_CPU_INDEX}")
        return TORCH_CPU_INDEX
    except OSError as e:
        reason = getattr(e, "reason", e)
    version = torch_pin()
    for folder in filter(None, re.split(r"[\s]+", os.environ.get("PIP_FIND_LINKS") or pip_config("find-links") or "")):
        for wheel in sorted(Path(folder.removeprefix("file://")).glob(f"torch-{version}+cpu-cp311-*linux*x86_64.whl")):
            target = WHEELS / wheel.name
            if not target.exists():
                try:
                    os.link(wheel, target)
                except OSError:
                    shutil.copy2(wheel, target)
            log(f"torch: {TORCH_CPU_INDEX} cannot be reached ({reason}); the CPU wheel {wheel} goes in "
                f"through {target.relative_to(ROOT)}")
            return ""
    raise RuntimeError(f"no CPU build of torch {version}: {TORCH_CPU_INDEX} cannot be reached ({reason}) and "
                       "pip's find-links holds no such wheel")


# ---- pdserve's image ------------------------------------------------------------

def build_pdserve_image(base: BaseImages) -> float:
    """``docker-compose build`` of pdserve:latest; returns the seconds it took."""
    env = {**os.environ, "BASE_IMAGE": base.python, "TORCH_INDEX": torch_index(),
           "CA_CERTS": extra_ca_certs(base.python)}
    start = time.monotonic()
    log(f"building {PDSERVE_IMAGE} (docker-compose build, BASE_IMAGE={base.python})")
    proc = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "build", "gateway"], cwd=ROOT, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode:
        print(proc.stdout[-20000:])
        raise RuntimeError(f"docker-compose build failed ({proc.returncode})")
    return time.monotonic() - start


def prepare() -> BaseImages:
    base = base_images()
    seconds = build_pdserve_image(base)
    size, base_size = image_size(PDSERVE_IMAGE), image_size(base.python)
    log(f"{PDSERVE_IMAGE}: built in {seconds:.0f} s, {size / 1e9:.2f} GB ({(size - base_size) / 1e9:.2f} GB "
        f"on top of {base.python}, {base_size / 1e6:.0f} MB)")
    return base


if __name__ == "__main__":
    prepare()
