"""A command running on a host, the same handle for a paramiko channel and a local process.

:class:`Proc`: bytes in with one ``send``, bytes out with blocking ``read_out``/``read_err``,
an exit code. :class:`ChannelProc` is a command on a channel of a host's open transport,
:class:`LocalProc` one on this machine; :class:`Result` what a short command left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .paramiko_fixes import data_message, eof_message, ordered_send

READ_CHUNK = 64 * 1024

# What this process's environment names that belongs to this process alone: a command on this
# machine inherits the rest, as a login on a host would not. WANDB_SERVICE is the socket of the
# wandb service of the process that started ftbundle (a notebook that called wandb.init, a test):
# rank 0 would log through that service, which outlives a killed rank and refuses the restart's
# rank 0 its own run ("run ID ... is in use"), and dies with its process.
LAUNCHER_ONLY = ("WANDB_SERVICE",)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.code == 0


class Proc:
    """A command running on a host. Thread-safe for one writer and one reader per stream."""

    def send(self, data: bytes) -> bool:
        """Write to the command's stdin in one go; False when it is gone."""
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def read_out(self) -> bytes:
        """The next chunk of stdout; b"" at its end. Blocks."""
        raise NotImplementedError

    def read_err(self) -> bytes:
        """The next chunk of stderr; b"" at its end. Blocks."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None when not finished within ``timeout``. -1: no code
        (the connection or the process was lost without one)."""
        raise NotImplementedError

    def close(self) -> None:
        """Drop the command: close the channel, or kill the local process group."""
        raise NotImplementedError

    def unread(self) -> bool:
        """Whether the command said something (output, its end) that no reader has taken
        yet: a backlog on our side, not silence on the host's."""
        return False

    def communicate(self, data: bytes = b"", timeout: float | None = None,
                    on_err: Callable[[bytes], None] | None = None, then: Callable[[Proc], None] | None = None,
                    keep_stdin: bool = False) -> Result:
        """Send ``data``, close stdin, collect all output and the exit code; ``on_err``: each
        chunk of stderr as it comes (a command's progress lines); ``then``: called with this
        command after ``data`` went, while it runs, to send what follows once it is known;
        ``keep_stdin``: stdin stays open until the command ends (it ends by itself; what ``then``
        set up may still :meth:`send` to it meanwhile)."""
        out: list[bytes] = []
        err: list[bytes] = []

        def err_sink(chunk: bytes) -> None:
            err.append(chunk)
            if on_err is not None:
                on_err(chunk)

        readers = [threading.Thread(target=_drain, args=(self.read_out, out.append), daemon=True),
                   threading.Thread(target=_drain, args=(self.read_err, err_sink), daemon=True)]
        for t in readers:
            t.start()
        if data:
            self.send(data)
        if then is not None:
            then(self)
        if not keep_stdin:
            self.close_stdin()
        code = self.wait(timeout)
        if keep_stdin:
            self.close_stdin()
        if code is None:
            self.close()
            raise TimeoutError(f"command did not finish within {timeout}s")
        for t in readers:
            t.join(timeout=2)
        return Result(code, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"))


def _drain(read: Callable[[], bytes], sink: Callable[[bytes], None]) -> None:
    try:
        while chunk := read():
            sink(chunk)
    except (OSError, EOFError, ValueError):
        pass



class ChannelProc(Proc):
    """A command on a paramiko channel of an open transport. Data and EOF go out in order
    with the transport thread's handling of the channel's end (see :func:`ordered_send`)."""

    def __init__(self, channel):
        self.chan = channel

    def send(self, data: bytes) -> bool:
        from paramiko.ssh_exception import SSHException

        rest = memoryview(data)  # (slices of it copy nothing)
        try:
            while rest:
                made = ordered_send(self.chan, lambda: data_message(self.chan, bytes(rest[:READ_CHUNK])))
                if made is None:
                    return False
                rest = rest[made[1]:]
            return True
        except (OSError, EOFError, SSHException):  # (socket.timeout is an OSError)
            return False

    def close_stdin(self) -> None:
        from paramiko.ssh_exception import SSHException

        try:
            ordered_send(self.chan, lambda: eof_message(self.chan))
        except (OSError, EOFError, SSHException):
            pass

    def read_out(self) -> bytes:
        return self.chan.recv(READ_CHUNK)

    def read_err(self) -> bytes:
        return self.chan.recv_stderr(READ_CHUNK)

    def unread(self) -> bool:
        chan = self.chan
        return chan.recv_stderr_ready() or chan.recv_ready() or chan.exit_status_ready()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.chan.status_event.wait(timeout):
            return None
        return self.chan.exit_status  # -1 when the channel closed without a status

    def close(self) -> None:
        try:
            self.chan.close()
        except (OSError, EOFError):
            pass


class LocalProc(Proc):
    """A command on this machine, in a process group of its own."""

    def __init__(self, argv: Sequence[str]):
        env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_ONLY}
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env)
        self._stdin_lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        with self._stdin_lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
                return True
            except (OSError, ValueError):
                return False

    def close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def read_out(self) -> bytes:
        return self.proc.stdout.read1(READ_CHUNK)

    def read_err(self) -> bytes:
        return self.proc.stderr.read1(READ_CHUNK)

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass


def bash_argv(program: str, *args: str) -> list[str]:
    """`bash -c PROGRAM NAME ARGS...`: the program text is fixed, values are arguments."""
    return ["bash", "-c", program, *args]
