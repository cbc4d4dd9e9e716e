"""The detached watcher's hands (ftbundle/remote/watch.py): work on shared storage in threads
never waited for beyond a timeout, whole-file writes, and this host's side of the job (its
processes from /proc, the node program's own ``stop`` and ``xids``). Shipped after
watch_rules.py's text and before watch.py's, one program (launch/stall.py ``WATCH_PARTS``).
Standard library only."""

import os
import subprocess
import threading
import time


# -- shared storage, in threads never waited for ----------------------------------------------------

class Task:
    """Work on shared storage in a thread of its own: looked at, never waited for beyond a timeout
    (a frozen one holds that thread, never its asker)."""

    def __init__(self, fn, *args):
        self.at = time.monotonic()  # when it was asked
        self.result = None
        self._done = threading.Event()
        self._work = (fn, args)

    def start(self):
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def run(self):
        fn, args = self._work
        try:
            self.result = fn(*args)
        except Exception:  # (what it could not do is its answer: nothing)
            self.result = None
        finally:
            self._done.set()

    def answered(self, wait=0.0):
        return self._done.wait(wait) if wait else self._done.is_set()


class Worker:
    """One thread doing a watcher's work on shared storage in the order it was asked (a write
    asked after one that hangs waits for it, as the storage would make it)."""

    def __init__(self):
        self._queue = []
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def ask(self, fn, *args):
        task = Task(fn, *args)
        with self._cv:
            self._queue.append(task)
            self._cv.notify()
        return task

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                task = self._queue.pop(0)
            task.run()


def read_text(path, limit=65536):
    """A small file's text (one read: NFS revalidates on open), None when it cannot be read."""
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def write_whole(path, text):
    """Whole or not at all (a full disk leaves no 0-byte file), as node.sh's ftb_write."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def claim_once(path, text):
    """Whether this caller is the first to create ``path`` (O_EXCL: one winner among the hosts on
    the shared storage). A storage that refuses the file for another reason says yes: told twice
    is better than never. No path: yes."""
    if not path:
        return True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True
    try:
        os.write(fd, (text + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def write_plain(path, text):
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        pass


def append(path, line):
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


# -- the host ---------------------------------------------------------------------------------------

def which(name, path):
    for d in path.split(":"):
        if d and os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def command_path(path, found):
    """PATH for the node program's children: the folders of PATH that hold a command it runs
    (``found``), in PATH's own order, so a name resolves to what it did at the start (a host's
    stand-in or wrapper in /usr/local/bin before /usr/bin keeps winning); the rest (a folder on
    shared storage that may freeze) is left out."""
    holding = set(os.path.dirname(f) for f in found if f)
    dirs = []
    for d in path.split(":"):
        if d in holding and d not in dirs:
            dirs.append(d)
    return ":".join(dirs) or "/usr/bin:/bin"


class Host:
    """This host's side of the job: its processes (/proc, never shared storage), and the node
    program's own ``stop`` and ``xids``, run with the commands looked up at the start, while the
    storage answered (PATH may start with a folder on it: path_prepend, the host interpreter's
    bin/; a lookup there would wait on a frozen one like any other read)."""

    COMMANDS = ("bash", "grep", "cut", "sleep", "docker", "logger", "nvidia-smi", "dmesg", "journalctl",
                "tail", "timeout")

    def __init__(self, env, pid, program):
        self.env = env
        self.pid = pid
        self.name = os.uname()[1]
        found = [which(c, env.get("PATH", "")) for c in self.COMMANDS]
        self.bash = found[0] or "/bin/bash"
        self.logger = found[5]
        self.child_env = dict(env, PATH=command_path(env.get("PATH", ""), found))
        self.program = program

    def alive(self):
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def node(self, *args, **kwargs):
        """``bash -c <node program> ftb ARGS...``: its stdout."""
        try:
            return subprocess.run([self.bash, "-c", self.program, "ftb"] + list(args), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.child_env,
                                  **kwargs).stdout.decode("utf-8", "replace")
        except (OSError, subprocess.SubprocessError):
            return ""

    def stop(self):
        """Every process of the job (FTB_MARKER), its container too: SIGTERM, SIGKILL after the
        grace period (node.sh ftb_stop)."""
        self.node("stop", self.env.get("FTB_MARKER", ""), self.env.get("FTB_CONTAINER", ""))

    def xids(self, window_s, since):
        return self.node("xids", str(window_s), str(since), timeout=30)

    def log_to_system(self, text):
        if self.logger:
            try:
                subprocess.run([self.logger, "-t", "ftbundle", text], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.child_env, timeout=5)
            except (OSError, subprocess.SubprocessError):
                pass

    def job_pids(self):
        want = ("FTB_JOB=" + self.env.get("FTB_MARKER", "")).encode()
        found = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                entries = environ_of(p)
                if entries is not None and want in entries:
                    found.append(p)
        return found

    def has_ranks(self):
        """Whether any rank process (torchrun's children: LOCAL_RANK) of the job is left."""
        for p in self.job_pids():
            if any(e.startswith(b"LOCAL_RANK=") for e in environ_of(p) or ()):
                return True
        return False

    def uptime(self):
        try:
            with open("/proc/uptime") as f:
                return int(float(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            return 0


def environ_of(pid):
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def release_claims(directory, run):
    """The run's claims on this host (remote/claims.py: KEY@RUN), once its job is over here (as
    the node program's ftb_release does for an attached run). Local disk: no worker needed."""
    if not directory or not run or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if name.endswith("@" + run) or name == run + ".started":
            _unlink(os.path.join(directory, name))


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass
