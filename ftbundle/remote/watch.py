"""ftbundle's detached watcher: what watches a detached run's job on every host, with no launcher.

Shipped as one text: ftbundle/remote/stallclock.py's (the stall rule, the launcher's own
StallClock), then this file's (launch/stall.py ``watcher_source``); staged in the run directory
with the other staged files, and started by the node program (node.sh, mode ``node``, detached)
right after the job: ``python3 -I -S WATCHER PID BASE NODE_PROGRAM``, PID the job's, BASE the
ranks' progress read before the job started, NODE_PROGRAM the node program's own text, which stops
the job (``ftb stop``) and reads the kernel log (``ftb xids``). Standard library only. Every path
arrives in the environment (the run directory's names: ftbundle/rundir.py, given by
launch/node.py's ``node_env``), nothing is pasted into the text and no file name is made here.

Two watchers in one process:

* **The watching** (heartbeats, a referee). Every node beats into its own FTB_HBFILE. Rank 0
  (FTB_REFEREE=1) is the referee: it alone reads every node's heartbeat and exit file and writes
  one verdict file (FTB_VERDICT_FILE: "BEAT ok|stop REASON|done") that every other node reads:
  O(n) reads of shared storage per second across the cluster, not O(n^2). A node stops its job
  when the verdict says stop, when the referee's verdict stops changing for FTB_STALE s (rank 0
  gone: the job cannot go on without its master anyway), or on a stop request. Each node keeps
  its ranks' step times in FTB_KEPT_STEPS_FILE, and the GPU faults its kernel logged while the
  job ran in FTB_XIDS_FILE (``ftbundle status`` reads both).
* **The stall watchdog** (with FTB_STALL_TIMEOUT): every node writes its ranks' progress to
  FTB_PROGRESS_FILE, marked "moved" once it differs from BASE (a job that printed its banner
  before anyone looked has moved all the same); rank 0 referees with the StallClock: no change in
  any node's file for FTB_STALL_TIMEOUT seconds (after the first change, or the first "moved") and
  it writes FTB_STALLED_FILE; every node then collects its ranks' state and stacks
  (FTB_STACKS_PROGRAM) into FTB_STACKS_OUT, and rank 0 asks every node to stop
  (FTB_STOP_REQUEST, which each node's watching obeys).

Shared storage that stops answering: a process that touches a frozen NFS or sshfs waits in the
kernel for as long as the freeze lasts (a signal only turns it to D state). So the threads that
decide (the main thread, the stall watchdog's) never touch shared storage: every read and write of
it is a worker thread's, looked at and never waited for beyond a timeout. The watching's worker
may wait there (its own decisions wait with it, as every node's do); the stall watchdog's work is
asked of a worker and a storage that does not answer for FTB_STALL_TIMEOUT seconds stops the job
by itself ("shared storage ... not answering"), the nodes' one way to tell a frozen network
filesystem. (docs/launcher.md, "Detached runs".)
"""

import glob
import os
import subprocess
import sys
import threading
import time

try:
    StallClock  # shipped: stallclock.py's text comes first (launch/stall.py watcher_source)
except NameError:  # imported in the package (tests)
    from ftbundle.remote.stallclock import StallClock

STALL_LOOK_S = 2  # the stall watchdog reads the progress this often
STEPS_EVERY_S = 10  # the kept step times are written at most this often (and at the job's end)
COLLECT_PEERS_S = 60  # rank 0 waits this long at most for the other nodes' stacks before the stop
MOVED = " moved"  # a progress line's mark: the node's ranks wrote something since its job started
_BASELINE = "\0baseline"  # what a node that had moved at its first look is taken to have started from


# -- the rules (pure: contents and times are given) -----------------------------------------------

class Referee:
    """Rank 0's watching: the verdict from every node's exit file and heartbeat."""

    def __init__(self, stale):
        self.stale = stale
        self.seen = {}  # heartbeat file -> (its text, when it last changed)

    def verdict(self, exits, beats, requested, now):
        """``exits``: (name, text) of every node's exit file found, in order; ``beats``: (name,
        text) of every other node's heartbeat whose node has no exit file; ``requested``: a stop
        request is there. -> ``ok`` or ``stop REASON``."""
        state = "ok"
        for name, text in exits:
            text = first_line(text)
            if text and text != "0":
                state = "stop %s says exit %s" % (name, text)
                break
        if requested:
            state = "stop stop requested"
        if state != "ok":
            return state
        for name, text in beats:
            before = self.seen.get(name)
            if before is None or before[0] != text:
                self.seen[name] = (text, now)
            elif now - before[1] >= self.stale:
                return "stop %s unchanged for %ss: that node is gone" % (name, self.stale)
        return state

    @staticmethod
    def final(own_exit):
        """Rank 0's own job ended (its exit file's text, None when unread): a failure stops the
        others, a success frees them."""
        code = first_line(own_exit or "")
        return "done" if code == "0" else "stop rank 0 exited %s" % (code or "without a code")


class Follower:
    """Another node's watching: what rank 0's verdict says, and whether it still beats."""

    def __init__(self, stale):
        self.stale = stale
        self.seen = ""
        self.since = None
        self.done = False  # rank 0 finished with 0: nothing left to referee

    def look(self, line, now):
        """The verdict's first line (empty when unread) -> None, ``("stop", REASON)`` or
        ``("silent", None)``."""
        if self.done:
            return None
        words = line.split(" ", 2)  # "BEAT STATE REASON..."
        state = words[1] if len(words) > 1 else ""
        if state == "stop":
            return "stop", (words[2] if len(words) > 2 else "stop")
        if state == "done":
            self.done = True
            return None
        if self.since is None or line != self.seen:
            self.seen, self.since = line, now
        elif now - self.since >= self.stale:
            return "silent", None
        return None


def first_line(text):
    return text.split("\n", 1)[0].strip()


def progress_value(total, steps, counted, with_steps):
    """A reading as the node program writes it (node.sh ftb_progress): `` BYTES[ STEPS_BYTES]``;
    empty when no progress is counted (FTB_PROGRESS_FILES empty)."""
    if not counted:
        return ""
    return " %d%s" % (total, " %d" % steps if with_steps else "")


def waiting_for_step(value):
    """Rank 0 of a LlamaFactory job whose trainer has not logged its first step yet."""
    parts = value.split(" ")
    return len(parts) > 2 and parts[2] in ("", "0")


def observe_progress(clock, lines, at):
    """Every node's progress line (key, ``VALUE[ moved]``) into the StallClock: a node's first line
    is its baseline, unless it has moved already (the clock then starts at once)."""
    for key, line in lines:
        value = line[:-len(MOVED)] if line.endswith(MOVED) else line
        if line.endswith(MOVED) and key not in clock.last:
            clock.observe(key, _BASELINE, at)
        clock.observe(key, value, at)


def wildcard(pattern, path):
    """What the one ``*`` of a glob stood for in a path it matched (a node's rank)."""
    head, _, tail = pattern.partition("*")
    return path[len(head):len(path) - len(tail)]


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
        dirs = []
        for path in found:
            if path and os.path.dirname(path) not in dirs:
                dirs.append(os.path.dirname(path))
        self.child_env = dict(env, PATH=":".join(dirs) or "/usr/bin:/bin")
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


# -- the watcher ------------------------------------------------------------------------------------

class Ended(Exception):
    """The stall watchdog is done (the job ended, or it was stopped)."""


class Watcher:
    def __init__(self, env, pid, base, program):
        self.env = env
        self.host = Host(env, pid, program)
        self.base = base
        self.heartbeat = float(env.get("FTB_HEARTBEAT") or 1)
        self.stale = int(env.get("FTB_STALE") or 20)
        self.stall_timeout = int(env.get("FTB_STALL_TIMEOUT") or 0)
        self.nnodes = int(env.get("NNODES") or 1)
        self.referee = env.get("FTB_REFEREE") == "1"
        self.started = time.monotonic()
        self.up0 = self.host.uptime()
        self.decided = threading.Event()  # the watching decided to stop the job
        self.steps_kept = ""
        self.steps_at = None

    def path(self, name):
        return self.env.get(name, "")

    # -- the ranks' step times (local files) ----------------------------------------------------
    def steps(self):
        """The local ranks' step times, "LOCAL_RANK STEPS MEDIAN P90" joined by ';' (node.sh
        ftb_steps: files on this host's own disk)."""
        base = self.path("FTB_STEPS_FILE")
        if not base:
            return ""
        lines = []
        for f in sorted(glob.glob(glob.escape(base) + ".[0-9]*")):
            if f.endswith(".tmp"):
                continue
            text = read_text(f)
            line = (text or "").split("\n", 1)[0]
            if line:
                lines.append(line)
        return ";".join(lines)

    def keep_steps(self, last=False):
        """The ranks' step times into FTB_KEPT_STEPS_FILE when they changed, at most every
        STEPS_EVERY_S, and with ``last`` whatever changed since (the watching's worker)."""
        now = self.steps()
        if not now or now == self.steps_kept:
            return
        every = float(self.env.get("FTB_STEPS_EVERY") or STEPS_EVERY_S)
        if not last and self.steps_at is not None and time.monotonic() - self.steps_at < every:
            return
        if write_whole(self.path("FTB_KEPT_STEPS_FILE"), now):
            self.steps_kept, self.steps_at = now, time.monotonic()

    def steps_away(self):
        """The ranks' step-time files and their folder on this host, once the job is over."""
        base = self.path("FTB_STEPS_FILE")
        if not base:
            return
        for f in glob.glob(glob.escape(base) + ".[0-9]*"):
            try:
                os.unlink(f)
            except OSError:
                pass
        folder = os.path.dirname(base)
        if folder.startswith("/tmp/ftb-steps-") and len(folder) > len("/tmp/ftb-steps-"):
            try:
                os.rmdir(folder)
            except OSError:
                pass

    # -- the watching (its own thread: the one that may wait on the storage) ---------------------
    def beat(self, n):
        write_whole(self.path("FTB_HBFILE"), str(n))
        self.keep_steps()

    def watching(self):
        beat = 0
        try:
            if self.referee:
                beat = self.refereeing()
            else:
                self.following()
        finally:
            self.keep_steps(last=True)
            self.decided.set()
            self.steps_away()
            # the GPU faults the kernel logged while the job ran, for `ftbundle status` (no launcher to read them)
            report = self.host.xids(int(time.monotonic() - self.started) + 60, self.up0).rstrip("\n")
            if report:
                write_whole(self.path("FTB_XIDS_FILE"), report)
        return beat

    def following(self):
        follower = Follower(self.stale)
        verdict = self.path("FTB_VERDICT_FILE")
        beat = 0
        while self.host.alive():
            beat += 1
            self.beat(beat)
            if os.path.exists(self.path("FTB_STOP_REQUEST")):
                return
            said = follower.look(first_line(read_text(verdict) or ""), time.monotonic())
            if said is not None and said[0] == "stop":
                append(self.path("FTB_LOG"), "ftbundle: rank 0's watcher says stop: %s" % said[1])
                return
            if said is not None:
                append(self.path("FTB_LOG"), "ftbundle: rank 0's watcher silent for %ds (%s unchanged): stopping"
                       % (self.stale, verdict))
                return
            time.sleep(self.heartbeat)

    def refereeing(self):
        referee = Referee(self.stale)
        own = self.path("FTB_HBFILE")
        exit_glob, hb_glob = self.path("FTB_PEER_EXIT_GLOB"), self.path("FTB_PEER_HB_GLOB")
        verdict = self.path("FTB_VERDICT_FILE")
        beat, state = 0, "ok"
        while self.host.alive():
            beat += 1
            self.beat(beat)
            exits = [(f, read_text(f)) for f in sorted(glob.glob(exit_glob))]
            exited = set(wildcard(exit_glob, f) for f, _ in exits)
            requested = os.path.exists(self.path("FTB_STOP_REQUEST"))
            beats = []
            if not requested:
                for f in sorted(glob.glob(hb_glob)):
                    if f != own and wildcard(hb_glob, f) not in exited:  # (a node that is done is not silent)
                        beats.append((os.path.basename(f), read_text(f) or ""))
            state = referee.verdict([(os.path.basename(f), text or "") for f, text in exits], beats, requested,
                                    time.monotonic())
            write_whole(verdict, "%d %s" % (beat, state))
            if state != "ok":
                append(self.path("FTB_LOG"), "ftbundle: %s; stopping every node" % state[len("stop "):])
                return beat
            time.sleep(self.heartbeat)
        # our own job ended: a failure stops the others, a success frees them
        write_whole(verdict, "%d %s" % (beat + 1, Referee.final(read_text(self.path("FTB_EXIT")))))
        return beat

    # -- the stall watchdog (its own thread, which never touches the storage) ---------------------
    def reading(self):
        """A reading of the ranks' progress, with a probe of shared storage (a name never used
        before: no cache can answer it) -> the value, as the node program's (node.sh ftb_ask)."""
        shared = self.path("FTB_SHARED_DIR") or self.path("FTB_RUN_DIR")
        try:
            os.stat(os.path.join(shared, ".ftb-probe-%s-%d-%s" % (self.host.name, os.getpid(), os.urandom(6).hex())))
        except OSError:
            pass
        files, steps_file = self.path("FTB_PROGRESS_FILES"), self.path("FTB_PROGRESS_STEPS")
        total = 0
        for pattern in files.split():
            for f in glob.glob(pattern):
                try:
                    total += os.stat(f).st_size
                except OSError:
                    pass
        steps = 0
        if steps_file:
            try:
                steps = os.stat(steps_file).st_size
            except OSError:
                pass
        return progress_value(total, steps, bool(files), bool(steps_file))

    def look(self, new, last, peers):
        """A reading's work on shared storage: FTB_PROGRESS_FILE written when NEW differs from LAST;
        whether FTB_STALLED_FILE is there; with ``peers`` (rank 0), once every node has written its
        progress file, each one's (key, line) -> (wrote, requested, lines or None)."""
        wrote = new != last and write_whole(self.path("FTB_PROGRESS_FILE"), new)
        if os.path.exists(self.path("FTB_STALLED_FILE")):
            return wrote, True, None
        lines = None
        if peers:
            pattern = self.path("FTB_PEER_PROGRESS_GLOB")
            files = sorted(glob.glob(pattern))
            if files and len(files) >= self.nnodes:
                lines = [(wildcard(pattern, f), first_line(read_text(f) or "")) for f in files]
        return wrote, False, lines

    def collect(self, stalled_for=None):
        """This node's ranks' stacks into FTB_STACKS_OUT. With ``stalled_for`` (rank 0: no progress
        for that long) the stall is said in the log and in FTB_STALLED_FILE first, and every node
        asked to stop once all have collected (at most COLLECT_PEERS_S)."""
        out = self.path("FTB_STACKS_OUT")
        if stalled_for is not None:
            append(self.path("FTB_LOG"), "ftbundle: no progress from any rank for %ds: stalled; every rank's stack "
                   "into %s, then every node stops" % (self.stall_timeout, out))
            write_plain(self.path("FTB_STALLED_FILE"), str(stalled_for))
        try:
            with open(self.path("FTB_STACKS_PROGRAM"), "rb") as program:
                subprocess.run([sys.executable or "python3", "-S", "-", "--env", out], stdin=program,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            pass
        write_plain(self.path("FTB_STACKED_FILE"), "done")
        if stalled_for is None:
            return
        for _ in range(COLLECT_PEERS_S):  # the other nodes' collections
            if len(glob.glob(self.path("FTB_PEER_STACKED_GLOB"))) >= self.nnodes:
                break
            time.sleep(1)
        write_plain(self.path("FTB_STOP_REQUEST"), "stalled")

    def hold(self, task):
        """Wait for ``task`` until it has answered; not answered for FTB_STALL_TIMEOUT seconds: the
        job is stopped (storage_stopped), and so is the watchdog, as it is when the job ends."""
        while not task.answered(2):
            waited = time.monotonic() - task.at
            if waited >= self.stall_timeout:
                self.storage_stopped(waited)
                raise Ended()
            if not self.host.alive():
                raise Ended()
        return task.result

    def hold_collecting(self, task):
        """Wait for the collection however long it takes (py-spy, the other nodes'), while the
        storage answers: a reading asked beside it every 2 s, one not answered for
        FTB_STALL_TIMEOUT seconds stops the job as hold does."""
        asked = None
        while not task.answered(2):
            if asked is None:
                asked = Task(self.reading).start()
            elif asked.answered():
                asked = None  # (another one next time)
            elif time.monotonic() - asked.at >= self.stall_timeout:
                if self.host.alive():
                    self.storage_stopped(time.monotonic() - asked.at)
                raise Ended()
        raise Ended()

    def storage_stopped(self, waited):
        """This node's shared storage has not answered for stall_timeout: its job is stopped (no rank
        can move), and why is written beside its exit file (`ftbundle status`: "stopped: shared
        storage ...") and into its log, once the storage answers."""
        why = "shared storage %s on %s not answering for %ds" % (
            self.path("FTB_SHARED_DIR") or self.path("FTB_RUN_DIR"), self.host.name, waited)
        self.host.log_to_system("%s: stopping the job %s" % (why, self.path("FTB_MARKER")))
        self.host.stop()
        told = "%s (stall_timeout %ds)" % (why, self.stall_timeout)

        def say():
            write_whole(self.path("FTB_STOPPED_FILE"), told)
            append(self.path("FTB_LOG"), "ftbundle: %s: stopped the job on %s" % (told, self.host.name))
        told_task = self.worker.ask(say)
        while not told_task.answered(60):  # (after whatever waits there already: once it answers)
            pass

    def stall_watch(self):
        self.worker = Worker()
        clock = StallClock(self.stall_timeout)
        with_steps = bool(self.path("FTB_PROGRESS_STEPS"))
        last = ""
        try:
            while self.host.alive():
                value = self.hold(Task(self.reading).start()) or ""
                moved = value != self.base and not (with_steps and waiting_for_step(value))
                peers = self.referee and not (with_steps and waiting_for_step(value))
                new = value + (MOVED if moved else "")
                looked = self.hold(self.worker.ask(self.look, new, last, peers))
                wrote, requested, lines = looked or (False, False, None)
                if wrote:
                    last = new
                if requested:
                    self.hold_collecting(self.worker.ask(self.collect))
                if lines is not None:  # (only once every node has written one)
                    now = time.monotonic()
                    observe_progress(clock, lines, now)
                    if clock.stalled(now):
                        if not self.path("FTB_CONTAINER") and self.env.get("FTB_PER_NODE", "0") != "1" \
                                and not self.host.has_ranks():
                            # ranks done, torchrun ending: not a stall (a `command:` job's processes need
                            # not carry LOCAL_RANK: no such shortcut for them)
                            clock.last_progress = now
                            time.sleep(2)
                            continue
                        self.hold_collecting(self.worker.ask(self.collect, int(clock.silent_for(now))))
                time.sleep(STALL_LOOK_S)
        except Ended:
            pass

    # -- the whole --------------------------------------------------------------------------------
    def run(self):
        watching = threading.Thread(target=self.watching, name="watching")
        watching.start()
        if self.stall_timeout:
            threading.Thread(target=self.stall_watch, name="stall-watch").start()
        # the main thread: the watching decided to stop the job, or the job ended by itself
        while self.host.alive():
            if self.decided.wait(1):
                if self.host.alive():
                    self.host.stop()
                    # (the watching removed the ranks' step-time files after its last write of them; a
                    # job stopped here may leave new ones as it ends)
                    self.steps_away()
                break


def main(argv):
    pid = int(argv[1])
    base = argv[2] if len(argv) > 2 else ""
    Watcher(dict(os.environ), pid, base, argv[3] if len(argv) > 3 else "").run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
