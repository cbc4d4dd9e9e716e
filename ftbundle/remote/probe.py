"""ftbundle's probe: what `ftbundle check` (and `run`, before launching) asks every host.

Shipped as this file's text on stdin to the host's own interpreter: `python3 - SPEC_JSON`.
Standard library only (it runs under whatever python3 the host has, Ansible's managed-node
requirement). Every value arrives in the JSON spec, an argument, and every program it runs
gets its values as argv elements: nothing is ever pasted into shell text. It prints one
JSON object on stdout and exits 0; a fact it could not get is an error string inside it.

All facts are gathered at once, on threads, so the probe takes as long as its slowest
question, not their sum:

- system: hostname, kernel, network links, the route to rank 0;
- runtime: the job interpreter's package versions, or the image ID (docker runtime; the
  image named in the spec, else the one site.yml recorded in /etc/ftbundle/image.ref);
- GPUs: nvidia-smi's GPU list, their indices/UUIDs/memory in use and compute processes,
  each under a timeout (a hung driver is a fact, not a lost host); /dev/infiniband;
- GPU health (unless the job says `health: off`): one nvidia-smi query of every health field,
  `nvidia-smi -q -d TEMPERATURE` (the slowdown threshold), and the kernel log's NVRM Xid
  lines (dmesg, else `journalctl -k`), raw: ftbundle/gpu_health.py reads them;
- the environment the job will see (the host's NCCL env file sourced as the node
  program sources it): CUDA_VISIBLE_DEVICES, NCCL/GLOO socket interfaces;
- directories, and storage: for each path the spec names (shared_dir, output_dir), a
  sentinel written under it (or under its nearest existing parent) and the sentinels of
  every other host waited for: seeing all of them, not a path, proves the storage shared.
  All of it in a child process forked before any thread starts, which first stats a name
  never used under each path: a hung network filesystem holds whatever touches it in the
  kernel (D state, deaf to kill -9), so the probe itself never touches it; a path not
  answered within `storage_answer_s`, its child seen blocked in the kernel while this host
  runs (evidence.py: a busy host that has not run the child yet is given `storage_patience_s`
  more, and said to be starved), is reported as not answering, the child abandoned, and
  what lives under it (the workdir's files, the datasets) is not looked at;
- the master port: rank 0 binds it (the "is it free" test) and accepts the others, who
  connect to it, all within this one round;
- the dataset files' sha256 (LlamaFactory's dataset_info.json rules).
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time

if __package__:  # imported (tests); shipped, evidence.py's text comes before this one (probe_source)
    from .evidence import HUNG, WAITING, read_load, read_process, storage_verdict

# Package versions as the job's interpreter sees them, without importlib.metadata (40-60 ms
# in a large venv) or importing the packages (torch takes seconds): the .dist-info METADATA on
# its sys.path, and torch's own version.py (its __version__ carries the build, 2.14.1+cu130).
# First run with -S ("--no-site"): site.py's .pth files (setuptools' distutils hack, editable
# finders, ...) cost a large venv's interpreter 25 ms of its 33 ms start. The site-packages
# directories are then found as site.py finds them (a venv's pyvenv.cfg, its system site
# packages, the user site). Only if a package is absent that way does the plain run (with
# every .pth file) decide: a directory only a .pth file adds is still seen.
# Its answer also names its basis ("_basis"): every directory it listed, every .pth file in
# them and every file it read, which the probe's cache (:func:`versions`) stamps.
VERSIONS_PY = r"""
import json, os, re, sys
basis = []
if sys.argv[1:2] == ["--no-site"]:
    del sys.argv[1]
    import site
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    cfg = next((c for c in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg"))
                if os.path.isfile(c)), None)
    basis.append(cfg or os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg"))
    dirs, system_site = [], True
    if cfg:
        with open(cfg, errors="replace") as f:
            conf = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition("=") for line in f) if _)
        system_site = conf.get("include-system-site-packages", "false").lower() == "true"
        dirs += site.getsitepackages([os.path.dirname(exe_dir)])
    if system_site:
        if site.check_enableusersite():
            dirs.append(site.getusersitepackages())
        dirs += site.getsitepackages()
    sys.path += [d for d in dirs if d not in sys.path]
try:  # (absent now, it would be on sys.path the moment it exists)
    import site
    basis.append(site.getusersitepackages())
except Exception:
    pass
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
want = {norm(n): n for n in sys.argv[1:]}
found = {}
for entry in sys.path:
    basis.append(os.path.abspath(entry or "."))
    try:
        names = os.listdir(entry or ".")
    except OSError:
        continue
    basis += [os.path.join(entry, d) for d in names if d.endswith(".pth")]
    for d in names:
        key = norm(d[:-10].rsplit("-", 1)[0]) if d.endswith(".dist-info") else None
        if key not in want or want[key] in found:
            continue
        name = want[key]
        basis += [os.path.join(entry, d, "METADATA"), os.path.join(entry, name, "version.py")]
        try:
            with open(os.path.join(entry, d, "METADATA"), errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        found[name] = line.split(":", 1)[1].strip()
                        break
            with open(os.path.join(entry, name, "version.py")) as f:
                found[name] = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M).group(1)
        except (OSError, AttributeError):
            pass
print(json.dumps({"python": sys.version.split()[0], **{n: found.get(n, "absent") for n in sys.argv[1:]},
                  "_basis": basis}))
"""

# the variables whose values the job will see, read after the env file is sourced
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
ENV_VIEW_SH = 'set -a; [ -r "$1" ] && . "$1" >/dev/null 2>&1; set +a; shift; for v; do printf "%s=%s\\0" "$v" "${!v-}"; done'
# How often a host looks again for what its peers' probes do at the same moment (their
# sentinels, rank 0's master port): the probes start within milliseconds of each other, and
# every look that comes too early costs the whole round this long. After POLL_FAST looks
# (0.1 s: a small cluster's probes have all started by then) each look waits 1.25x longer, up
# to POLL_MAX_S: on a large cluster the probes start over seconds, and n hosts each looking for
# n sentinels every 10 ms would be O(n^2) opens per second (256 hosts: about 3 million a
# second, on storage that every host shares).
POLL_S = 0.01
POLL_FAST = 10
POLL_MAX_S = 0.25


def pauses():
    """The waits between one host's looks at the same thing: 10 ms ten times, then 1.25x
    longer each time, to 0.25 s."""
    for _ in range(POLL_FAST):
        yield POLL_S
    wait = POLL_S
    while True:
        wait = min(POLL_MAX_S, wait * 1.25)
        yield wait


GPU_QUERY = "name,driver_version,memory.total"
GPU_IDS_QUERY = "index,uuid,memory.used"
APPS_QUERY = "pid,process_name,gpu_uuid,used_memory"


def run(argv, timeout, env=None):
    """(returncode, stdout, stderr, timed_out); returncode None when not runnable or timed
    out. A command that times out is killed and not waited for: a process stuck in the
    kernel (a hung GPU driver) cannot be reaped, and must not hang the probe with it."""
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return None, "", exc.strerror or str(exc), False
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, 9)
        except OSError:
            pass
        return None, "", "", True


def last_line(text, default):
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1].strip()[:300] if lines else default


# -- the facts -------------------------------------------------------------------------

def system(spec, out):
    out["hostname"] = socket.gethostname()
    uname = os.uname()  # (what platform.system()/release() return, without importing platform)
    out["kernel"] = f"{uname.sysname} {uname.release}"
    try:
        out["links"] = sorted(os.listdir("/sys/class/net"))
    except OSError:
        out["links"] = []
    out["infiniband"] = sorted(os.listdir("/dev/infiniband")) if os.path.isdir("/dev/infiniband") else []
    out["cpus"] = len(os.sched_getaffinity(0))  # the cores this login may use (a cgroup's cpuset included)
    addr = spec.get("master_addr")
    if not addr:
        return
    try:
        resolved = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
    except OSError:
        out["route"] = {"error": f"cannot resolve {addr}"}
        return
    limit = spec.get("command_s", 5)
    code, text, err, timed_out = run(["ip", "-o", "route", "get", resolved], limit)
    words = (text or "").split()
    if timed_out:  # a loaded host, not a missing route: said as what it is
        out["route"] = {"error": f"`ip route get {resolved}` timed out after {limit:g} s"}
        return
    if code != 0 or "dev" not in words:
        out["route"] = {"error": last_line(err or text, "no route")}
        return
    route = {"dev": words[words.index("dev") + 1], "local": text.lstrip().startswith("local ")}
    if "src" in words:
        route["src"] = words[words.index("src") + 1]
    out["route"] = route


def versions(spec, out):
    """The job interpreter's version and its packages'. Starting that interpreter is most of
    a probe's CPU (20-30 ms of its 50 in a large venv): what it said last time is kept (in a
    private directory, :func:`cache_dir`) with a stamp of every file and directory it was
    based on, and reused while none of them has changed. Installing, removing or upgrading a
    package adds, removes or renames entries of its site-packages directory, which changes
    that directory's stamp."""
    python, packages = spec["python"], spec.get("packages", [])
    exe = python if os.sep in python else which(python) or python
    key = {"python": python, "exe": exe, "packages": packages,
           "env": sorted((k, v) for k, v in os.environ.items() if k.startswith("PYTHON") or k == "HOME")}
    cached = cache_read("versions", key)
    if cached is not None:
        out["versions"] = cached
        return
    began = time.time_ns()

    def answer(code, text):  # VERSIONS_PY's JSON line, or None
        try:
            return json.loads(text.strip().splitlines()[-1]) if code == 0 else None
        except (ValueError, IndexError):
            return None

    found = answer(*run([python, "-S", "-c", VERSIONS_PY, "--no-site", *packages], 60)[:2])
    if found is None or "absent" in found.values():
        code, text, err, timed_out = run([python, "-c", VERSIONS_PY, *packages], 60)
        found = answer(code, text)
    if found is not None:
        basis = found.pop("_basis", None)
        out["versions"] = found
        if isinstance(basis, list):
            cache_write("versions", key, found, [exe] + basis, since=began)
    elif timed_out:
        out["runtime_error"] = f"{python} did not answer within 60s"
    elif code is None:
        out["runtime_error"] = f"{python}: {err or 'not found'}"
    else:
        out["runtime_error"] = f"{python}: {last_line(err or text, f'exit {code}')}"


def image(spec, out):
    ref = spec.get("image")
    ref_file = spec.get("image_ref_file")
    if ref_file:
        try:
            with open(ref_file) as f:
                out["image_ref"] = f.read().strip() or None
        except OSError:
            out["image_ref"] = None
    if not spec.get("docker"):
        return
    ref = ref or out.get("image_ref")
    if not ref:
        out["runtime_error"] = f"no image given and none recorded in {ref_file}"
        return
    out["image"] = ref
    code, text, err, timed_out = run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], 30)
    if code == 0 and text.strip().startswith("sha256:"):
        out["image_id"] = text.strip().splitlines()[0]
        image_versions(spec, out)
    elif timed_out:
        out["runtime_error"] = "docker did not answer within 30s"
    else:
        out["runtime_error"] = f"image {ref} not on host ({last_line(err or text, 'docker failed')})"


def image_versions(spec, out):
    """The packages' versions inside the image, as the ranks' interpreter there sees them. An
    image ID names fixed bytes: the answer is kept for good (no stamps), so only the first
    check of a new image starts a container for it (about a second)."""
    python, packages = spec.get("image_python") or "python3", spec.get("packages", [])
    key = {"image_id": out["image_id"], "python": python, "packages": packages}
    cached = cache_read("image-versions", key)
    if cached is not None:
        out["versions"] = cached
        return
    argv = ["docker", "run", "--rm", "--pull=never", "--network", "none", "--entrypoint", python,
            out["image_id"], "-c", VERSIONS_PY, *packages]
    code, text, err, timed_out = run(argv, 60)
    try:
        found = json.loads(text.strip().splitlines()[-1]) if code == 0 else None
    except (ValueError, IndexError):
        found = None
    if isinstance(found, dict):
        found.pop("_basis", None)
        out["versions"] = found
        cache_write("image-versions", key, found, [], since=time.time_ns())
    elif timed_out:
        out["runtime_error"] = f"{python} in image {out['image']} did not answer within 60s"
    else:
        out["runtime_error"] = (f"{python} in image {out['image']}: "
                                f"{last_line(err or text, f'exit {code}')}")


def paths(spec, out):
    """Files the job names on the hosts (its script, a model given as a path): there or not."""
    found = {}
    for name, path in (spec.get("paths") or {}).items():
        try:
            os.stat(path)
            found[name] = None
        except OSError as exc:
            found[name] = exc.strerror or "missing"
    if found:
        out["paths"] = found


def gpus(spec, out):
    limit = spec.get("nvidia_smi_timeout_s", 10)
    if not have("nvidia-smi"):
        out["gpus"] = None  # no driver tools: no GPUs
        return
    base = ["nvidia-smi", "--format=csv,noheader,nounits"]
    code, text, err, timed_out = run(base + [f"--query-gpu={GPU_QUERY},compute_cap"], limit)
    if code not in (0, None) and not timed_out:  # drivers before 510 lack compute_cap
        code, text, err, timed_out = run(base + [f"--query-gpu={GPU_QUERY}"], limit)
    if timed_out:
        out["gpu_error"] = f"nvidia-smi did not answer within {limit}s (hung driver or GPU?)"
        out["gpu_hung"] = True
        return
    if code != 0:
        out["gpu_error"] = last_line(text or err, f"nvidia-smi exit {code}")
        return
    out["gpus"] = text
    code, text, _, timed_out = run(base + [f"--query-gpu={GPU_IDS_QUERY}"], limit)
    if code == 0:
        out["gpu_ids"] = text
    code, text, _, timed_out = run(base + [f"--query-compute-apps={APPS_QUERY}"], limit)
    if code == 0:
        out["compute_apps"] = text


def health(spec, out):
    """GPU health, raw: the query of every field in the spec (a field this driver does not know
    is asked under its newer name, else left out), the temperature thresholds, and the kernel
    log's Xid lines with the uptime they are stamped against. Read first, the kernel log: a
    wedged driver that hangs nvidia-smi has usually said why there."""
    import re

    h = spec.get("health")
    if not h or not have("nvidia-smi"):
        return
    limit = spec.get("nvidia_smi_timeout_s", 10)
    result = {"kernel_log": kernel_log(h.get("window_s", 86400), limit)}
    fields, aliases = list(h["fields"]), h.get("aliases", {})
    for _ in range(len(fields)):
        code, text, err, timed_out = run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,nounits"],
                                         limit)
        bad = re.search(r'Field "([^"]+)" is not a valid field', (text or "") + (err or ""))
        if code in (0, None) or not bad or bad.group(1) not in fields or bad.group(1) == "index":
            break
        name = bad.group(1)
        if aliases.get(name) and aliases[name] not in fields:
            fields[fields.index(name)] = aliases[name]
        else:
            fields.remove(name)
    if timed_out:
        result["error"] = f"nvidia-smi did not answer within {limit}s (hung driver or GPU?)"
    elif code != 0:
        result["error"] = last_line(text or err, f"nvidia-smi exit {code}")
    if text and "index" in text.split("\n", 1)[0]:  # (a GPU lost mid-list still leaves the others' rows)
        result["query"] = text
    if not timed_out:
        code, text, _, _ = run(["nvidia-smi", "-q", "-d", "TEMPERATURE"], limit)
        if code == 0:
            result["temperature"] = text
    out["health"] = result


def kernel_log(window_s, limit):
    """The NVRM Xid lines of the kernel log (the last 200), and /proc/uptime, which their
    stamps count from. dmesg is refused to users where kernel.dmesg_restrict is 1 (and in
    containers without CAP_SYSLOG): then the journal's kernel messages of the window."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        uptime = None
    code, text, err, timed_out = run(["dmesg"], limit)
    why = []
    if code != 0:
        said = "timed out" if timed_out else last_line(err or text, f"exit {code}")
        why.append(said if said.startswith("dmesg:") else f"dmesg: {said}")
        if not have("journalctl"):
            why.append("journalctl: not installed")
        else:
            code, text, err, timed_out = run(["journalctl", "-k", "-o", "short-monotonic", "--no-pager",
                                              f"--since=-{int(window_s)}s"], limit)
            # (exit 0 all the same: no journal at all, or not the system's to this user)
            unseen = any(w in (err or "") for w in ("No journal files", "insufficient permissions",
                                                    "not seeing messages"))
            if code != 0 or unseen:
                why.append(f"journalctl -k: {'timed out' if timed_out else last_line(err or text, f'exit {code}')}")
                code = code or 1
    if code != 0:
        return {"error": "; ".join(why), "uptime_s": uptime}
    lines = [line for line in text.splitlines() if "NVRM: Xid" in line]
    return {"lines": lines[-200:], "uptime_s": uptime, "source": "journalctl -k" if why else "dmesg"}


def env_view(spec, out):
    """What the job will see: the login environment, then the env file as the node
    program sources it (`set -a; . FILE`)."""
    env_file = spec.get("env_file") or "/dev/null"
    code, text, _, _ = run(["bash", "-c", ENV_VIEW_SH, "ftb", env_file, *ENV_NAMES], 10)
    view = {}
    for pair in (text or "").split("\0"):
        name, sep, value = pair.partition("=")
        if sep and value:
            view[name] = value
    out["env"] = view


def dirs(spec, out):
    workdir = spec.get("workdir")
    out["workdir_ok"] = bool(workdir) and os.path.isdir(workdir)


def storage_apart(spec, started):
    """Fork the child that asks the storage (before any thread starts: a fork is safe then);
    (its pid, the read end of its report pipe). The child's lines are JSON: ``{"answered":
    NAME}`` once a name never used under that path has been stat'ed (no cache answers that: the
    server did), then ``{"storage": ...}``, :func:`storage`'s result. First of all ``{"control":
    true}``, once it has stat'ed a name never used under /tmp: the host runs it, and its own disk
    answers (the control of :func:`storage_verdict`)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    try:  # the child: nothing of the SSH session's streams, so a child stuck for good holds none
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        report = os.fdopen(w, "w")
        try:  # the control: this host's own disk, asked just before the storage (evidence.py)
            os.stat(f"/tmp/.ftb-control-{os.getpid()}-{time.time_ns()}")
        except OSError:
            pass
        report.write('{"control": true}\n')
        report.flush()
        for item in spec.get("storage", []):
            path = item["path"]
            try:
                os.stat(os.path.join(nearest_existing(path) or path, f".ftb-probe-{os.getpid()}-{time.time_ns()}"))
            except OSError:
                pass
            report.write(json.dumps({"answered": item["name"]}) + "\n")
            report.flush()
        out = {}
        guarded(storage, spec, out, started)
        report.write(json.dumps({"storage": out.get("storage"), "errors": out.get("errors")}) + "\n")
        report.flush()
    finally:
        os._exit(0)


class StorageReport:
    """The storage child's report, read with time limits: it is never waited for."""

    def __init__(self, spec, pid, fd):
        self.spec, self.pid, self.buf, self.lines = spec, pid, b"", []
        self.fd = fd
        self.began = time.monotonic()
        self.last = self.began  # its last word
        self.seen = {}  # path name -> how its reading was seen when it was slow (evidence.py)

    def _read(self, until):
        """Its next lines, waiting for them until ``until`` at most (not at all when it has
        passed); how many lines there are then."""
        import select
        ready, _, _ = select.select([self.fd], [], [], max(0.0, until - time.monotonic()))
        chunk = os.read(self.fd, 65536) if ready else b""
        if chunk:
            self.last = time.monotonic()
            self.buf += chunk
            *done, self.buf = self.buf.split(b"\n")
            self.lines += [json.loads(line) for line in done if line.strip()]
        return len(self.lines)

    def answered(self, limit, patience):
        """Every path answered: None; else the first that did not. Past ``limit`` seconds from the
        fork it is given up on the evidence that the storage holds the reading (its process
        blocked in the kernel while the control answered: :func:`storage_verdict`); while the
        evidence is that this host has not run it (starved), only after ``patience`` more. How
        a slow reading was seen is kept in ``seen`` (the words of the check)."""
        want = [item["name"] for item in self.spec.get("storage", [])]
        until = self.began + limit
        while True:
            now = time.monotonic()
            if now >= until:  # (what it has said already first: it goes on once it has answered)
                while len(self.lines) < self._read(now):
                    pass
            said = {line.get("answered") for line in self.lines}
            pending = [n for n in want if n not in said]
            if not pending:
                return None
            if now >= until:
                state, wchan, _ = read_process(self.pid)
                control = any(line.get("control") for line in self.lines)
                verdict = storage_verdict(state, wchan, control, now - self.began, limit)
                if verdict != WAITING:
                    self.seen[pending[0]] = {"verdict": verdict, "waited_s": round(now - self.began, 1),
                                             "state": state if control else None, "wchan": wchan,
                                             "load": read_load()}
                if verdict == HUNG or now >= self.began + limit + patience:
                    return pending[0]
                until = min(now + 0.25, self.began + limit + patience)  # (looked at again)
            self._read(until)

    def result(self, out, until):
        """:func:`storage`'s result into ``out``; a child that falls silent before ``until`` has
        met storage that stopped answering meanwhile (named by what it had not finished)."""
        while not any("storage" in line for line in self.lines) and time.monotonic() < until:
            self._read(until)
        final = next((line for line in self.lines if "storage" in line), None)
        if final is not None:
            out["storage"] = final["storage"] or {}
            for name, seen in self.seen.items():  # (slow, not hung: the host was starved)
                if name in out["storage"]:
                    out["storage"][name]["slow"] = seen
            if final.get("errors"):
                out.setdefault("errors", []).extend(final["errors"])
            return
        silent = time.monotonic() - self.last
        out["storage"] = {item["name"]: {"path": item["path"], "not_answering_s": round(silent, 1)}
                          for item in self.spec.get("storage", [])}

    def not_answering(self, out, name):
        waited = round(time.monotonic() - self.began, 1)
        out["storage"] = {item["name"]: ({"path": item["path"], "not_answering_s": waited}
                                         if item["name"] == name else {"path": item["path"]})
                          for item in self.spec.get("storage", [])}
        if name in self.seen:  # the evidence: its reading's process, as last seen
            out["storage"][name]["slow"] = self.seen[name]


def storage(spec, out, started):
    """For each path: write our sentinel, then wait (bounded) for everyone else's."""
    token, rank, expect = spec.get("token"), spec["rank"], spec.get("expect", [])
    wait_s = spec.get("sentinel_wait_s", 5)
    results = {}
    pending = []
    for item in spec.get("storage", []):
        path, res = item["path"], {"path": item["path"]}
        results[item["name"]] = res
        if item.get("create"):
            if not os.path.isdir(path):
                try:
                    os.makedirs(path)
                    res["created"] = True
                except OSError as exc:
                    res["create_error"] = ("it is a file, not a directory" if os.path.exists(path)
                                           and not os.path.isdir(path) else exc.strerror)
        else:  # another host may be creating it right now (rank 0, a fresh shared_dir)
            deadline = started + (wait_s if item.get("wait") else 0)
            waits = pauses()
            while not os.path.isdir(path) and time.monotonic() < deadline:
                time.sleep(min(next(waits), max(0.0, deadline - time.monotonic())))
        res["exists"] = os.path.isdir(path)
        parent = os.path.dirname(path.rstrip("/")) or "/"
        res["parent_exists"] = os.path.isdir(parent)
        where = path if res["exists"] else nearest_existing(path) if item.get("nearest") else None
        if where is None or not token:
            continue
        sdir = os.path.join(where, f".ftb-check-{token}")
        res["where"] = where
        try:
            os.makedirs(sdir, exist_ok=True)
            with open(os.path.join(sdir, f"rank-{rank}"), "w") as f:
                f.write(socket.gethostname() + "\n")
            res["written"] = True
            pending.append((res, sdir))
        except OSError as exc:
            res["written"] = False
            res["write_error"] = exc.strerror
    deadline = time.monotonic() + wait_s
    for res, sdir in pending:
        unseen, waits = list(expect), pauses()
        while True:  # (only the sentinels not seen yet are looked for again)
            unseen = [r for r in unseen if not sees(os.path.join(sdir, f"rank-{r}"))]
            if not unseen or time.monotonic() >= deadline:
                break
            time.sleep(min(next(waits), max(0.0, deadline - time.monotonic())))
        res["seen"] = [r for r in expect if r not in unseen]
    out["storage"] = results


def sees(path):
    """open(), not stat(): NFS revalidates a file on open (close-to-open consistency)."""
    try:
        with open(path):
            return True
    except OSError:
        return False


def nearest_existing(path):
    path = os.path.normpath(path)
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def port(spec, out):
    p = spec.get("port")
    if not p:
        return
    if p["role"] == "listen":
        out["port"] = listen(p["port"], p["peers"], p.get("listen_s", 8))
    else:
        out["port"] = connect(p["addr"], p["port"], p.get("connect_s", 6))


def listen(port_number, want, wait):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
    try:
        s.bind(("", port_number))
    except OSError as exc:
        s.close()
        code, text, _, _ = run(["ss", "-Htlnp", f"( sport = :{port_number} )"], 5)
        return {"role": "listen", "busy": exc.strerror, "holders": (text or "").strip().splitlines()[:3]}
    s.listen(64)
    peers, end = [], time.monotonic() + wait
    while len(peers) < want and time.monotonic() < end:
        s.settimeout(max(0.05, end - time.monotonic()))
        try:
            conn, addr = s.accept()
        except socket.timeout:
            break
        peers.append(addr[0])
        conn.close()
    s.close()
    return {"role": "listen", "accepted": peers}


def connect(addr, port_number, wait):
    end, last, waits = time.monotonic() + wait, "no answer", pauses()
    while True:
        try:
            with socket.create_connection((addr, port_number), timeout=2):
                return {"role": "connect", "reachable": True}
        except OSError as exc:
            last = "timed out" if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
        if time.monotonic() >= end:  # the last try's error, and how long it kept trying
            return {"role": "connect", "reachable": False, "error": f"{last}; kept trying for {wait:g} s"}
        time.sleep(min(next(waits), max(0.0, end - time.monotonic())))  # (refused: rank 0 has not bound it yet)


def datasets(spec, out):
    """LlamaFactory's own rules (data/parser.py): dataset_info.json in dataset_dir maps each
    name to a file_name (a file, or a directory of files) relative to dataset_dir."""
    d = spec.get("datasets")
    if not d:
        return
    dataset_dir, names = d["dir"], d["names"]
    info_path = os.path.join(dataset_dir, "dataset_info.json")
    found = []
    try:
        with open(info_path) as f:
            info = json.load(f)
    except FileNotFoundError:
        out["datasets"] = [{"file": info_path, "error": "missing"}]
        return
    except (OSError, ValueError) as exc:
        out["datasets"] = [{"file": info_path, "error": f"unreadable: {exc}"}]
        return
    for name in names:
        entry = info.get(name)
        if not isinstance(entry, dict):
            found.append({"dataset": name, "file": info_path, "error": "not defined"})
            continue
        if "file_name" not in entry:
            remote = [k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
                      if k in entry]
            found.append({"dataset": name, "remote": remote[0] if remote else "no file_name"})
            continue
        path = os.path.join(dataset_dir, entry["file_name"])
        if not os.path.exists(path):
            found.append({"dataset": name, "file": path, "error": "missing"})
            continue
        try:
            found.append({"dataset": name, "file": path, "sha256": digest(path)})
        except OSError as exc:
            found.append({"dataset": name, "file": path, "error": f"unreadable: {exc.strerror}"})
    out["datasets"] = found


def sha256(path):
    import hashlib  # (only the datasets fact needs it)

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(path):
    if os.path.isfile(path):
        return sha256(path)
    import hashlib  # (only the datasets fact needs it)

    h = hashlib.sha256()
    for root, subdirs, files in os.walk(path):
        subdirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(f"{os.path.relpath(full, path)}\0{sha256(full)}\n".encode())
    return h.hexdigest()


# -- cleanup ---------------------------------------------------------------------------

def cleanup(spec, out):
    """Remove this check's sentinel directories (mode `clean`): under each path, or its
    nearest existing parent, where :func:`storage` wrote them."""
    import shutil
    removed = []
    for path in spec.get("paths", []):
        where = nearest_existing(path)
        if where is None:
            continue
        sdir = os.path.join(where, f".ftb-check-{spec['token']}")
        if os.path.isdir(sdir):
            shutil.rmtree(sdir, ignore_errors=True)
            removed.append(sdir)
    out["removed"] = removed


# -- check --net: iperf3 between rank 0 and one other host ------------------------------

def have(program):
    return which(program) is not None


def which(program):
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and os.access(os.path.join(d, program), os.X_OK):
            return os.path.join(d, program)
    return None


# -- what a probe keeps on its host between checks ---------------------------------------

CACHE_ROOT = "/tmp"


def cache_dir():
    """/tmp/ftbundle-UID, made by and readable only by this user; None (no cache) when it is
    anything else: another user's, open to others, a symlink."""
    import stat
    path = os.path.join(CACHE_ROOT, f"ftbundle-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def stamp(path):
    """What changes when a file or directory is written, replaced, or gains or loses an entry."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cache_file(name, key):
    import zlib
    where = cache_dir()
    text = json.dumps(key, sort_keys=True)
    return where and os.path.join(where, f"{name}-{zlib.crc32(text.encode()):08x}.json"), text


def cache_read(name, key):
    """The value kept under ``key`` while every path it was based on has its stamp still."""
    path, text = cache_file(name, key)
    if not path:
        return None
    try:
        with open(path) as f:
            kept = json.load(f)
        if kept["key"] != text or any(stamp(p) != s for p, s in kept["stamps"]):
            return None
        return kept["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_write(name, key, value, basis, since):
    """Keep ``value`` under ``key`` with the stamps of its ``basis``; not when any of them
    changed after ``since`` (ns, taken before the value was read, less the 1 s some
    filesystems' timestamps are coarse to): the value may predate that change."""
    path, text = cache_file(name, key)
    if not path:
        return
    stamps = [[p, stamp(p)] for p in dict.fromkeys(basis)]
    if any(s is not None and s[4] >= since - 10**9 for _, s in stamps):
        return
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": text, "stamps": stamps, "value": value}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def iperf_server(spec, out):
    """One client, then exit; the timeout ends it if the client never comes."""
    if not have("iperf3"):
        out["missing"] = True
        return
    run(["iperf3", "-s", "-1", "-p", str(spec["port"])], spec["server_s"])
    out["done"] = True


def iperf_client(spec, out):
    """Retry until the one-shot server on rank 0 is up, then one JSON result. (With -J,
    iperf3 3.12 exits 0 even when it could not connect: the JSON's "error" says so.)"""
    if not have("iperf3"):
        out["missing"] = True
        return
    end = time.monotonic() + spec["connect_s"]
    argv = ["iperf3", "-c", spec["addr"], "-p", str(spec["port"]), "-t", str(spec["seconds"]), "-J"]
    while True:
        code, text, err, _ = run(argv, spec["seconds"] + 10)
        if "sum_received" in (text or "") or time.monotonic() >= end:
            out["json"] = text or err
            return
        time.sleep(0.3)


MODES = {"clean": cleanup, "iperf-server": iperf_server, "iperf-client": iperf_client}


def main():
    spec = json.loads(sys.argv[1])
    out = {}
    started = time.monotonic()
    if spec.get("mode") in MODES:
        MODES[spec["mode"]](spec, out)
        print(json.dumps(out))
        return
    report = StorageReport(spec, *storage_apart(spec, started)) if spec.get("storage") else None
    # the slowest first (it starts the job's interpreter): its head start is the round's
    tasks = ([versions] if spec.get("python") else []) + [system, env_view, port, gpus, health, image]
    threads = [threading.Thread(target=guarded, args=(t, spec, out), daemon=True, name=t.__name__)
               for t in tasks]
    for t in threads:
        t.start()
    # what lives on the (often shared) workdir, only once the storage has answered
    stuck = report.answered(spec.get("storage_answer_s", 5), spec.get("storage_patience_s", 30)) if report else None
    if stuck is None:
        late = [threading.Thread(target=guarded, args=(t, spec, out), daemon=True, name=t.__name__)
                for t in (dirs, datasets, paths)]
        for t in late:
            t.start()
        threads += late
    deadline = started + spec.get("deadline_s", 150)
    if stuck is not None:
        report.not_answering(out, stuck)
    elif report is not None:
        report.result(out, min(deadline, time.monotonic() + 2 * spec.get("sentinel_wait_s", 5) + 5))
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [t.name for t in threads if t.is_alive()]
    if late:
        out.setdefault("errors", []).append(f"unfinished after {spec.get('deadline_s', 150)}s: {', '.join(late)}")
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # daemon threads stuck on a hung command do not hold the exit


def guarded(task, *args):
    out = args[1]
    try:
        task(*args)
    except Exception as exc:  # a fact that could not be had is reported, never a crash
        out.setdefault("errors", []).append(f"{task.__name__}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
