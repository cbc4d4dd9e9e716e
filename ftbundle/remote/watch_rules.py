"""The detached watcher's rules (ftbundle/remote/watch.py): pure, every content and time is
given. Rank 0's referee, the other nodes' follower, the progress lines fed to the StallClock.
Shipped before watch.py's text, one program (launch/stall.py ``WATCH_PARTS``). Standard library
only."""

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


def culprit(reason, hosts):
    """The node a detached run's verdict stops on (``reason``: the verdict after "stop ") ->
    (its host's name or None, its exit code or None), ``hosts`` every node's host by node rank:
    what an attached run's summary says of its failure."""
    import re

    match = re.match(r"node-(\d+)\.a\d+\.(exit says exit (-?\d+)|hb unchanged)", reason)
    rank, code = (int(match.group(1)), match.group(3)) if match else (None, None)
    if match is None and reason.startswith("rank 0 exited "):
        rank, code = 0, reason.rsplit(" ", 1)[-1]
    host = hosts[rank] if rank is not None and rank < len(hosts) else None
    return host, int(code) if code is not None and code.lstrip("-").isdigit() else None


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


def diverged_record(text):
    """A diverged.aN record (global rank 0's callback, shims/steptimes.py: step, since, kind, action,
    said) with its "said"; None for no record or one not whole."""
    import json

    try:
        record = json.loads(text or "")
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("said"), str) else None


def diverged_said(text):
    """What the ranks said when they stopped the run because its loss went nan or its model
    collapsed; None for no record, one not whole, or a warning (the run went on)."""
    record = diverged_record(text)
    return record["said"] if record is not None and record.get("action") == "stop" else None


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
