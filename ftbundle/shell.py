"""Run a short bash script on a host: a local process, or one Fabric command over SSH.

For the quick, bounded chores around a run (stop a node, read a log's end, read the run
directory's state); the long-lived node programs are :mod:`ftbundle.launch`'s business.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

from .inventory import Host
from .ssh import connect


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.code == 0


def run_script(host: Host, script: str, *, timeout: float = 30, connect_timeout: int = 10) -> Result:
    """Run ``script`` with bash on ``host``; raises on SSH failure or timeout."""
    if host.local:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    conn = connect(host, timeout=connect_timeout)
    try:
        result = conn.run("bash -c " + shlex.quote(script), hide=True, warn=True, timeout=timeout, pty=False)
        return Result(result.exited, result.stdout, result.stderr)
    finally:
        conn.close()


def stream_script(host: Host, script: str, out) -> int:
    """Run ``script`` on ``host`` with its output going to ``out`` as it comes."""
    if host.local:
        return subprocess.run(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    conn = connect(host)
    try:
        return conn.run("bash -c " + shlex.quote(script), out_stream=out, err_stream=out, warn=True,
                        pty=False, hide=False).exited
    finally:
        conn.close()


def write_files(host: Host, directory: str, files: dict[str, str]) -> None:
    """Create ``directory`` on ``host`` and write ``files`` (name -> text) into it."""
    import io
    import os

    if host.local:
        os.makedirs(directory, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(directory, name), "w") as f:
                f.write(text)
        return
    conn = connect(host)
    try:
        conn.run(f"mkdir -p {shlex.quote(directory)}", hide=True)
        for name, text in files.items():
            conn.put(io.BytesIO(text.encode()), f"{directory}/{name}")
    finally:
        conn.close()
