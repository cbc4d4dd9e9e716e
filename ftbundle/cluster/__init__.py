"""The controller's side of the hosts: one SSH transport per host, opened once, reused by all.

- :mod:`.connections`: :class:`Cluster`, one Fabric connection per remote host, opened in
  parallel (capped per sshd and overall), every command a channel on it;
- :mod:`.procs`: :class:`Proc`, the same handle for a command on a channel or on this machine,
  and :class:`Result`, what a short command left;
- :mod:`.paramiko_fixes`: paramiko's races on a shared transport, worked around;
- :mod:`.errors`: what went wrong with a host, in words (:func:`first_line`);
- :mod:`.fanout`: :func:`parallel`, work for many hosts at once.

Invoke's ``run`` is not used for anything long-lived or fed from our side: it feeds stdin
one byte per 10 ms and keeps all output in memory (see shared/ENVIRONMENT.md).
"""

from .connections import CONNECT_TIMEOUT_S, Cluster
from .errors import HostUnreachable, first_line
from .fanout import parallel
from .paramiko_fixes import REKEY_WAIT_S
from .procs import ChannelProc, LocalProc, Proc, Result, bash_argv

__all__ = ["CONNECT_TIMEOUT_S", "REKEY_WAIT_S", "ChannelProc", "Cluster", "HostUnreachable", "LocalProc", "Proc",
           "Result", "bash_argv", "first_line", "parallel"]
