"""Two simulated hosts on one Linux machine (as root), for multi-host tests and benches.

Each host is a network namespace (the two joined by a veth pair, 10.77.0.1/24
and 10.77.0.2/24 by default), a mount namespace with its own tmpfs on /tmp and
/dev/shm.  Host 1 runs the file server (an sshd on its veth address exporting a
directory), a Redis server and an S3 endpoint (SeaweedFS).  Both hosts mount the
exported directory at the same path with sshfs, host 1 included (through its own
sshd), as every node of a cluster mounts its NFS share: every rank reads and
writes the share through a network filesystem.  ``share_local=True`` keeps the
older shape, where host 1 uses the exported directory directly (its ranks read
the share from local disk, which no cluster node does).
Everything is torn down on ``Hosts.close``: processes, mounts, namespaces,
the veth pair and the temporary directory.

Reproduce by hand as root::

    with Hosts() as hosts:
        hosts[1].run([sys.executable, "-c", "import socket; print(socket.gethostname())"])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Host", "Hosts", "unavailable"]

_TOOLS = ("ip", "nsenter", "unshare", "sshfs", "ssh-keygen", "fusermount3")
_READY_TIMEOUT = 30.0
#: sshfs options of every mount: no name, attribute or directory caching (a file
#: another host created or deleted is seen at once, as close-to-open NFS sees it);
#: AES-GCM (hardware-accelerated: half the CPU of OpenSSH's default ChaCha20, and
#: NFS does not encrypt at all), no compression, and 64 KiB SFTP requests (sshfs's
#: largest; its default is 32 KiB, NFS mounts use 64 KiB to 1 MiB)
SSHFS_OPTIONS = (
    "StrictHostKeyChecking=no",
    "UserKnownHostsFile=/dev/null",
    "LogLevel=ERROR",
    "Ciphers=aes128-gcm@openssh.com",
    "Compression=no",
    "max_read=65536",
    "max_write=65536",
    "dir_cache=no",
    "dcache_timeout=0",
    "attr_timeout=0",
    "entry_timeout=0",
    "negative_timeout=0",
)


def unavailable() -> str | None:
    """Why this machine cannot build the hosts, or None when it can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network and mount namespaces)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if not os.access("/usr/sbin/sshd", os.X_OK):
        missing.append("sshd")
    if missing:
        return (
            f"simulated hosts need {', '.join(missing)}: run stores/install "
            "(apt-get install iproute2 util-linux sshfs openssh-server)"
        )
    if not os.path.exists("/dev/fuse"):
        return "simulated hosts need /dev/fuse for sshfs"
    return None


class Host:
    """One simulated host: network namespace ``netns`` with ``addr`` on the veth pair,
    and its own /tmp and /dev/shm (tmpfs mounts under ``root``, shared by all its
    processes) bound over the machine's in every command it runs."""

    def __init__(self, index: int, netns: str, addr: str, device: str, root: Path):
        self.index, self.netns, self.addr, self.root = index, netns, addr, root
        self.device = device  # for GLOO_SOCKET_IFNAME
        self.binds: list[tuple[Path, str]] = []
        for name, target in (("tmp", "/tmp"), ("shm", "/dev/shm")):
            (root / name).mkdir(parents=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(root / name)], check=True
            )
            self.binds.append((root / name, target))

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network and mounts).

        gatherstore itself stays importable when it lives under /tmp (a checkout
        there): its directory is bound outside /tmp first and put on PYTHONPATH.
        """
        steps = []
        package_root = Path(__file__).resolve().parents[3]
        if Path("/tmp") in package_root.parents:
            stash = self.root / "package"
            stash.mkdir(exist_ok=True)
            steps.append(f"mount --bind {package_root} {stash}")
            steps.append(f'export PYTHONPATH="{stash}${{PYTHONPATH:+:$PYTHONPATH}}"')
        steps += [f"mount --bind {source} {target}" for source, target in self.binds]
        script = " && ".join(steps) + ' && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "sh", "-c", script, "sh", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (``subprocess.Popen`` keyword arguments)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this host to completion (``subprocess.run`` keyword arguments)."""
        return subprocess.run(self.command(argv), **kwargs)

    def stop(self) -> None:
        """Kill every process in this host's network namespace, unmount its tmpfs."""
        pids = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        for source, _ in self.binds[:2]:
            _umount(source)


class Hosts:
    """Two hosts joined by a veth pair, with a shared sshfs directory, Redis and S3 on host 1.

    ``hosts[1]``, ``hosts[2]``; ``shared`` is the shared directory (the same
    path on both, mounted over sshfs on both; with ``share_local`` host 1 uses
    the exported directory itself); ``redis_url`` the Redis server on host 1; ``s3_url`` a
    ``s3://bucket/prefix`` on host 1's S3 endpoint, whose address and credentials
    are ``s3_environ`` (``GATHERSTORE_TEST_S3_*``, for the jobs' environment) and
    ``s3_options`` (fsspec storage options); ``workdir`` a directory outside /tmp
    visible to both hosts (for scripts).

    Raises:
        RuntimeError: (on entry) the machine cannot build them; see ``unavailable``.
    """

    def __init__(self, subnet: str = "10.77.0", *, share_local: bool = False) -> None:
        self.subnet, self.share_local = subnet, share_local
        self.tag = uuid.uuid4().hex[:6]
        self._stack = contextlib.ExitStack()
        self.hosts: list[Host] = []
        self.redis_url = self.s3_url = ""
        self.s3_environ: dict[str, str] = {}

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index - 1]

    @property
    def s3_options(self) -> dict[str, Any]:
        """fsspec storage options for ``s3_url`` (as ``gatherstore.open_store`` takes them)."""
        from gatherstore.testing.plugin import S3Endpoint

        env = self.s3_environ
        return S3Endpoint(
            *(env[f"GATHERSTORE_TEST_S3_{name}"] for name in ("ENDPOINT", "KEY", "SECRET"))
        ).storage_options

    def __enter__(self) -> Hosts:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Tear down everything, last built first; safe to call twice."""
        self._stack.close()

    def _build(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="gatherstore-hosts-", dir="/var/tmp"))
        self._stack.callback(shutil.rmtree, self.workdir, True)
        self.shared = self.workdir / "shared"
        self.shared.mkdir()
        names = [f"gs{self.tag}h{i}" for i in (1, 2)]
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
            self._stack.callback(subprocess.run, ["ip", "netns", "del", name], check=False)
        veth = [f"gs{self.tag}v{i}" for i in (1, 2)]
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i, (name, dev) in enumerate(zip(names, veth, strict=True), start=1):
            _ip("link", "set", dev, "netns", name)
            _ip("-n", name, "addr", "add", f"{self.subnet}.{i}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        for i, name in enumerate(names, start=1):
            self._stack.callback(self._stop_host, i)
            addr, root = f"{self.subnet}.{i}", self.workdir / f"host{i}"
            self.hosts.append(Host(i, name, addr, veth[i - 1], root))
        self._share()
        self.redis_url = self._serve("redis")[0]
        bucket = "gatherstore"
        self.s3_environ = self._serve("s3", "--bucket", bucket)[1]
        self.s3_url = f"s3://{bucket}/jobs"

    def _share(self) -> None:
        """sshd on host 1; sshfs of its ``shared`` directory at the same path on the hosts
        that mount it (both, or host 2 alone with ``share_local``)."""
        ssh = self.workdir / "ssh"
        ssh.mkdir(mode=0o700)
        for key in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)], check=True
            )
        shutil.copy(ssh / "client_key.pub", ssh / "authorized_keys")
        config = ssh / "sshd_config"
        config.write_text(
            f"ListenAddress {self[1].addr}\nPort 22\nHostKey {ssh / 'host_key'}\n"
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}\nPidFile {ssh / 'sshd.pid'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
            "StrictModes no\nSubsystem sftp internal-sftp\n"
        )
        if not os.path.isdir("/run/sshd"):  # sshd's privilege separation directory
            os.makedirs("/run/sshd", mode=0o755)
            self._stack.callback(shutil.rmtree, "/run/sshd", True)
        log = ssh / "sshd.log"
        with log.open("w") as err:
            sshd = self[1].popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=err)
        self._stack.callback(_end, sshd)
        # sshfs mounts before it connects, and leaves when the connection fails: a
        # mount seen while sshd is not listening yet may vanish a moment later
        deadline = time.monotonic() + _READY_TIMEOUT
        while "Server listening" not in log.read_text():
            if sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start on host 1:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        for host in self.hosts[1:] if self.share_local else self.hosts:
            self._mount(host, ssh / "client_key")

    def _mount(self, host: Host, key: Path) -> None:
        """sshfs of host 1's ``shared`` on ``host``, bound over ``shared`` in its commands."""
        options = [f"IdentityFile={key}", *SSHFS_OPTIONS]
        target, view = f"root@{self[1].addr}:{self.shared}", host.root / "shared"
        view.mkdir()
        # mounted in this machine's mount namespace (the host's commands bind it over
        # `shared`) by an sshfs in the host's network namespace
        argv = ["nsenter", f"--net=/run/netns/{host.netns}", "sshfs", "-f", target, str(view)]
        deadline = time.monotonic() + _READY_TIMEOUT
        while not self._mounted(view):  # sshd may not listen yet: try again
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshfs could not mount {target} on host {host.index}")
            sshfs = subprocess.Popen([*argv, "-o", ",".join(options)], **_QUIET)
            self._stack.callback(_end, sshfs)
            self._stack.callback(_umount, view)
            while sshfs.poll() is None and not self._mounted(view):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            # the first request through the mount waits for the connection: served, or
            # refused once sshfs gave up (and unmounted)
            with contextlib.suppress(OSError):
                os.stat(view)
        host.binds.append((view, str(self.shared)))

    def _stop_host(self, index: int) -> None:
        if len(self.hosts) >= index:
            self[index].stop()

    def _mounted(self, path: Path) -> bool:
        mounts = Path("/proc/self/mounts").read_text()
        return any(line.split()[1] == str(path) for line in mounts.splitlines())

    def _serve(self, kind: str, *args: str) -> tuple[str, dict[str, str]]:
        """``gatherstore.testing.services KIND`` bound to host 1's veth address: its URL
        and the variables it exports."""
        log = self.workdir / f"{kind}.log"
        argv = [sys.executable, "-m", "gatherstore.testing.services", kind, *args]
        with log.open("w") as err:
            server = self[1].popen(
                [*argv, "--host", self[1].addr],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=self.workdir,
                env={**os.environ, "TMPDIR": str(self.workdir)},  # the host's /tmp stays empty
            )
        self._stack.callback(_end, server)
        assert server.stdout is not None
        url = server.stdout.readline().strip()  # after the exports: the server is ready
        if not url:
            raise RuntimeError(f"{kind} did not start on host 1:\n{log.read_text()[-3000:]}")
        lines = log.read_text().splitlines()
        exports = [line.removeprefix("export ") for line in lines if line.startswith("export ")]
        return url, dict(line.split("=", 1) for line in exports)


_QUIET: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], **_QUIET)


def _end(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
