"""Fabric connections built from inventory hosts (one place that knows SSH options)."""

from __future__ import annotations

import os

from .inventory import Host

CONNECT_TIMEOUT = 10


def connect(host: Host, *, timeout: int = CONNECT_TIMEOUT):
    """A Fabric Connection to ``host`` using the inventory's user, port and key.

    Host keys: known_hosts files are loaded (the user's, and the one named by the
    inventory's `-o UserKnownHostsFile=`). When the inventory names a known_hosts file
    the connection is strict (unknown or changed keys are refused), as `ssh` would be
    with that option; otherwise Fabric's default of accepting new keys applies.
    """
    from fabric import Config, Connection
    from paramiko.client import RejectPolicy

    connect_kwargs = {"banner_timeout": timeout, "auth_timeout": timeout}
    if host.key_file:
        connect_kwargs["key_filename"] = [os.path.expanduser(host.key_file)]
        connect_kwargs["look_for_keys"] = False
        connect_kwargs["allow_agent"] = False
    # Never forward our own stdin (a terminal, a pipe) to a remote command unless a caller
    # hands one over explicitly: Invoke's default reads sys.stdin.
    config = Config(overrides={"run": {"in_stream": False}})
    conn = Connection(host=host.address, user=host.user, port=host.port, config=config,
                      connect_timeout=timeout, connect_kwargs=connect_kwargs)
    user_known = os.path.expanduser("~/.ssh/known_hosts")
    if os.path.exists(user_known):
        conn.client.load_host_keys(user_known)
    if host.known_hosts:
        conn.client.load_host_keys(os.path.expanduser(host.known_hosts))
        conn.client.set_missing_host_key_policy(RejectPolicy())
    return conn
