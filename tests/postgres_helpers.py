"""A real PostgreSQL for tests that share an Optuna study: initdb + pg_ctl in a temporary folder, on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server_helpers import free_port


def start_postgres() -> tuple[str, Callable[[], None]]:
    """A real PostgreSQL in a temporary folder, run as the `postgres` user; (URL, stop). Skips when it cannot start."""
    initdb = shutil.which("initdb") or "/usr/lib/postgresql/15/bin/initdb"
    pg_ctl = shutil.which("pg_ctl") or "/usr/lib/postgresql/15/bin/pg_ctl"
    if not Path(initdb).exists() or not shutil.which("runuser"):
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    # outside pytest's tmp folder, which only root may enter
    data = Path(tempfile.mkdtemp(prefix="slotune-pg-"))
    if as_pg:
        shutil.chown(data, "postgres")
    port = free_port()
    r = subprocess.run(as_pg + [initdb, "-D", str(data), "-A", "trust", "-U", "postgres"], capture_output=True,
                       text=True)
    if r.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        pytest.skip(f"initdb failed: {r.stderr[-300:]}")
    r = subprocess.run(as_pg + [pg_ctl, "-D", str(data), "-l", str(data / "log"), "-w", "-o",
                                f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {r.stderr[-300:]}")

    def stop() -> None:
        subprocess.run(as_pg + [pg_ctl, "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)
    subprocess.run(as_pg + [shutil.which("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U",
                            "postgres", "optuna"], check=True, capture_output=True)
    return f"postgresql://postgres@127.0.0.1:{port}/optuna", stop
