"""A throwaway PostgreSQL server for the tests: a cluster in a temporary folder, listening on a free
loopback port (and a unix socket in that folder), trust authentication, one database.

initdb refuses to run as root, which is how CI and the development machines run the tests: as root
the server's commands run as the `postgres` user (Debian's package creates it) through runuser.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "evotune"
DATABASE = "evotune"


def find_bindir() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: [int(x) if x.isdigit() else 0 for x in p.split("/")[4].split(".")])
    return Path(found[-1]).parent if found else None


def missing() -> str | None:
    """Why a server cannot be started here, or None."""
    if find_bindir() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found (Debian: apt-get install postgresql)"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed (pip install 'evotune[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
        if not (shutil.which("runuser") or shutil.which("su")):
            return "running as root without runuser or su to run the server as `postgres`"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self):
        self.bindir = find_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="evotune-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_postgres:
            cmd = (["runuser", "-u", "postgres", "--", *cmd] if shutil.which("runuser")
                   else ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(f"'{a}'" for a in cmd)])
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root)
        if proc.returncode != 0:
            log = (self.root / "server.log").read_text() if (self.root / "server.log").exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr.strip()}\n{log[-2000:]}")
        return proc

    def start(self) -> "PostgresServer":
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "--no-locale", "-E", "UTF8",
                  "--no-sync")
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "server.log"), "-w", "-t", "60",
                  "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, DATABASE)
        return self

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
