"""An SSH port that accepts connections and never answers (issue 45, item 3): the host is named
with what happened, in one line ("timed out after N s waiting for the SSH banner: ... nothing there
speaks SSH"), not paramiko's "No existing session", and paramiko's own logging ("Exception
(client): Error reading SSH protocol banner" and its tracebacks) does not reach the terminal.
A real TCP server on this machine, real paramiko; no containers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

from tests.support.helpers import REPO


def silent_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])  # accepted, and never a byte back
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def open_against(server: socket.socket, port: int, name: str, tries: int) -> tuple[dict, str]:
    """A fresh interpreter's Cluster opened to 127.0.0.1:port (connect timeout 2 s): (its
    errors, its stderr); the server closed after."""
    code = f"""
import json
from ftbundle.cluster import Cluster
from ftbundle.inventory import Host
host = Host(name={name!r}, address="127.0.0.1", port={port}, user=None, key_file=None, local=False,
            known_hosts=None, proxy_jump=None, vars={{}})
cluster = Cluster([host], connect_timeout=2, connect_tries={tries}).open()
print(json.dumps(cluster.errors))
"""
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_port_that_never_answers_is_named_in_one_line_without_paramikos_traceback():
    server, port = silent_server()
    errors, stderr = open_against(server, port, "silent", tries=1)
    assert errors == {"silent": f"cannot SSH to 127.0.0.1:{port}: timed out after 2 s waiting for the SSH banner: the "
                                f"port accepts connections but nothing there speaks SSH: the host hangs (its kernel still "
                                f"answers TCP) or {port} is not its sshd's port"}
    assert "Exception (client)" not in stderr and "Traceback" not in stderr, stderr


def resetting_server() -> tuple[socket.socket, int]:
    """Accepts and resets at once, as an sshd at its MaxStartups drops a connection before
    its banner: refused (worth another try), not a port where nothing speaks SSH."""
    import struct

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def accept():
        while True:
            try:
                conn = server.accept()[0]
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def test_a_connection_reset_before_the_banner_is_refused_and_tried_again_not_called_silent():
    server, port = resetting_server()
    errors, _ = open_against(server, port, "reset", tries=2)
    assert list(errors) == ["reset"]
    assert "speaks SSH" not in errors["reset"], errors
    assert "closed the connection before its SSH banner" in errors["reset"] and "(2 tries)" in errors["reset"], errors
