"""ftbundle's detached watcher: what watches a detached run's job on every host, with no launcher.

Shipped as one text: ftbundle/remote/stallclock.py's (the stall rule, the launcher's own
StallClock), watch_rules.py's (the decisions, pure), watch_host.py's (storage in threads, this
host's processes), then this file's (launch/stall.py ``WATCH_PARTS``, ``watcher_source``); staged in the run directory
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
import json
import os
import subprocess
import sys
import threading
import time

if __package__:  # imported (tests); shipped, the parts' texts come before this one (launch/stall.py WATCH_PARTS)
    from .gpu_tally import GpuTally
    from .stallclock import StallClock
    from .watch_host import (Host, Task, Worker, append, claim_once, read_text, release_claims,
                             which, write_plain, write_whole)
    from .watch_rules import (MOVED, Follower, Referee, culprit, diverged_said, first_line,  # noqa: F401 (tests)
                              observe_progress, progress_value, waiting_for_step, wildcard)
    from .notifier import send
    from .trainer_end import log_mark, read_ends, told_figures

STALL_LOOK_S = 2  # the stall watchdog reads the progress this often
GPUS_EVERY_S = 30  # a detached GPU node's figures are kept this often (and at the job's end)
STEPS_EVERY_S = 10  # the kept step times are written at most this often (and at the job's end)
COLLECT_PEERS_S = 60  # rank 0 waits this long at most for the other nodes' stacks before the stop


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
        self.started_wall = time.time()
        self.up0 = self.host.uptime()
        self.decided = threading.Event()  # the watching decided to stop the job
        self.steps_kept = ""
        self.steps_at = None
        self.smi = None  # a GPU job's nvidia-smi loop (sampling)
        self.gpus = GpuTally()  # (the launcher's NodeGpus keeps the same: remote/gpu_tally.py)
        self.gpus_latest = ""
        self.gpus_lock = threading.Lock()
        self.trainer_mark = None  # the trainer log's mark as the job started (trainer_end.log_mark)

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

    # -- the GPUs (a GPU job's: one nvidia-smi loop, as the attached node program's) ------------
    def sampling(self):
        """Read the job's GPUs (FTB_GPU_EVERY_MS, FTB_GPU_FIELDS, FTB_GPU_IDS: ftbundle/gpu_metrics.py)
        from one `nvidia-smi -lms` for the job's life; keep the node's mean utilization (its GPUs'
        mean, over the readings), each GPU's peak memory and the latest reading in FTB_KEPT_GPUS_FILE
        every GPUS_EVERY_S (its own thread: a write that waits on the storage holds only this)."""
        argv = ["nvidia-smi", "--query-gpu=" + self.path("FTB_GPU_FIELDS"), "--format=csv,noheader,nounits",
                "-lms", self.path("FTB_GPU_EVERY_MS")]
        if self.path("FTB_GPU_IDS"):
            argv += ["-i", self.path("FTB_GPU_IDS")]
        try:
            self.smi = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        kept, reading = None, {}
        for line in self.smi.stdout:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) < 4 or not cells[0].isdigit():
                continue
            if cells[0] in reading:  # (the first GPU again: the reading before is whole)
                self.gpus_reading(reading)
                reading = {}
            reading[cells[0]] = cells
            if kept is None or time.monotonic() - kept >= GPUS_EVERY_S:
                kept = time.monotonic()
                self.keep_gpus()

    def gpus_reading(self, reading):
        with self.gpus_lock:
            self._gpus_reading(reading)

    def _gpus_reading(self, reading):
        gpus = []
        for index, cells in reading.items():
            try:
                gpus.append((index, float(cells[1]), float(cells[2]), float(cells[3])))
            except ValueError:  # ([N/A] and the like: this GPU is not counted in this reading)
                continue
        self.gpus.add(gpus)
        self.gpus_latest = ";".join(", ".join(cells) for cells in reading.values())

    def keep_gpus(self):
        with self.gpus_lock:
            g = self.gpus
            if not g.readings or not g.peak_mib or not g.total_mib:
                return
            text = json.dumps({**g.record(), "latest": self.gpus_latest})
        write_whole(self.path("FTB_KEPT_GPUS_FILE"), text)

    # -- the watching (its own thread: the one that may wait on the storage) ---------------------
    def beat(self, n):
        write_whole(self.path("FTB_HBFILE"), str(n))
        self.keep_steps()

    def watching(self):
        beat = 0
        if self.path("FTB_TRAINER_LOG"):  # (what the trainer's log was before this run: end's figures)
            self.trainer_mark = log_mark(self.path("FTB_TRAINER_LOG"))
        try:
            if self.referee:
                beat = self.refereeing()
                self.end()
            else:
                self.following()
        finally:
            self.keep_steps(last=True)
            if self.smi is not None:  # (the job is over: its GPUs' last figures)
                self.smi.kill()
                self.keep_gpus()
            self.decided.set()
            self.steps_away()
            # the GPU faults the kernel logged while the job ran, for `ftbundle status` (no launcher to read them)
            report = self.host.xids(int(time.monotonic() - self.started) + 60, self.up0).rstrip("\n")
            if report:
                write_whole(self.path("FTB_XIDS_FILE"), report)
            release_claims(self.path("FTB_CLAIM_DIR"), os.path.basename(self.path("FTB_RUN_DIR")))
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
                line = "rank 0's watcher silent for %ds (%s unchanged)" % (self.stale, verdict)
                append(self.path("FTB_LOG"), "ftbundle: %s: stopping" % line)
                self.end(lost=line)  # (no referee is left to judge the run's end)
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

    def end(self, lost=None):
        """The run decided: its end, as this watcher knows it (an attached run's summary.json as far as
        a host knows it), written into the run directory (FTB_ENDED_FILE: what `ftbundle runs` reads
        of a run no launcher saw end) and told to the job's ``notify:`` (FTB_NOTIFY_WEBHOOK,
        FTB_NOTIFY_COMMAND: given to the watchers alone, never to the job) as the launcher tells an
        attached run's end (remote/notifier.py). Rank 0's watcher does; with ``lost`` (another node's
        word that rank 0's watcher went silent: its host lost, no referee left) that node does. Once:
        the watcher that creates FTB_ENDED_FILE first (O_EXCL, its host's name), which then writes the
        record over it whole."""
        ended = self.path("FTB_ENDED_FILE")
        if not claim_once(ended, self.host.name):
            return
        summary = {"run_id": self.path("FTB_RUN_ID"), "detached": True, "started": round(self.started_wall, 3),
                   "duration_s": round(time.monotonic() - self.started, 1), "nnodes": self.nnodes, **self.figures(),
                   "told_by": self.host.name}
        if lost is not None:
            rank0 = (self.path("FTB_NODE_HOSTS").split() or [None])[0]
            summary.update(state="failed", exit_code=None, failed_host=rank0,
                           failure={"host": rank0, "line": lost + ": rank 0's host lost? every node stops"})
        else:
            verdict = (read_text(self.path("FTB_VERDICT_FILE")) or "").split(" ", 1)[-1].strip()
            code = first_line(read_text(self.path("FTB_EXIT")) or "")
            stalled = bool(read_text(self.path("FTB_STALLED_FILE")))
            state = ("finished" if verdict == "done" else "stalled" if stalled else
                     "stopped" if verdict == "stop stop requested" else "failed")
            line = verdict[len("stop "):] or verdict
            host, failed_code = culprit(line, self.path("FTB_NODE_HOSTS").split())
            if state == "failed" and (said := diverged_said(read_text(self.path("FTB_DIVERGED_FILE")))):
                line = "its ranks stopped the run: " + said  # (every rank raised: the node that exited first is any)
            own = int(code) if code.lstrip("-").isdigit() else None  # (rank 0's job may still be stopping)
            # the run's exit code, as an attached run's: the failed node's, where the verdict names it
            summary.update(state=state, exit_code=failed_code if state == "failed" and failed_code is not None else own,
                           failed_host=None if state == "finished" else host,
                           failure=None if state == "finished" else {"host": host, "code": failed_code, "line": line})
        if ended:
            write_whole(ended, json.dumps(summary))
        webhook, command = self.path("FTB_NOTIFY_WEBHOOK"), self.path("FTB_NOTIFY_COMMAND")
        if webhook or command:
            send(webhook, command, summary, lambda line: append(self.path("FTB_LOG"), "ftbundle: " + line))

    def figures(self):
        """The told summary's hosts, and its loss, tokens/s (per rank) and MFU as `runs` counts them
        from the trainer's log (trainer_end.py), where this run's trainer wrote one this host reads
        (rank 0's output_dir; another host's if it is shared): else None, as a command job's."""
        records = read_ends(self.path("FTB_TRAINER_LOG"), self.trainer_mark) if self.path("FTB_TRAINER_LOG") else []
        return told_figures(records, self.path("FTB_SPEED"), self.path("FTB_NODE_HOSTS"))

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
        if self.path("FTB_GPU_EVERY_MS") not in ("", "0") and which("nvidia-smi", os.environ.get("PATH", "")):
            threading.Thread(target=self.sampling, name="gpus", daemon=True).start()
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
