"""ftbundle's probe: what `ftbundle check` (and `run`, before launching) asks every host.

Shipped as this file's text on stdin to the host's own interpreter, run by remote/probe_loader.py
(`python3 -S -c LOADER SPEC_JSON DIGEST`: the compiled code kept on the host while the source is the same),
after its parts' (ftbundle/check/__init__.py, ``probe_source``: evidence.py, probe_common.py,
probe_gpus.py, probe_storage.py, and versions.py as the string VERSIONS_PY): one program.
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
  program sources it): CUDA_VISIBLE_DEVICES, NCCL/GLOO socket interfaces; on rank 0, what its
  trackers read (W&B's key sources, MLflow's URI) and whether their servers answer a TCP connect;
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
- the dataset files' sha256 (LlamaFactory's dataset_info.json rules) and the fingerprint of a
  node-local model (probe_files.py: each file's digest remembered while it is unchanged);
- on rank 0 of a GPU job, the bf16 GEMM the last burn-in of each GPU measured (:func:`gemm`).
"""

import os
import sys
import time

if __package__:  # imported (tests); shipped, the parts' texts come before this one (probe_source)
    from .probe_common import (PORT_OFF, TIMED_OUT, Latch, Lines, Task, accepted, connected, guarded, have, hostname,
                               ipv4_of, json, last_line, listening, pauses, run, which)
    from .probe_gpus import APPS_QUERY, GPU_IDS_QUERY, GPU_QUERY, gpus, health  # noqa: F401 (tests)
    from .probe_storage import StorageReport, cleanup, storage_apart
    from .probe_files import cache_read, cache_write, fingerprint, fingerprints, model_size
    from .probe_tokenized import tokenized
    from .probe_trackers import TRACKER_NAMES, masked, mlruns, servers, wandb_login, wandb_workspace
    from .claims import claim

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "versions.py")) as f:
        VERSIONS_PY = f.read()  # (shipped: a line of its own, probe_source)

# the variables whose values the job will see, read after the env file is sourced
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
ENV_VIEW_SH = 'set -a; [ -r "$1" ] && . "$1" >/dev/null 2>&1; set +a; shift; for v; do printf "%s=%s\\0" "$v" "${!v-}"; done'
# -- the facts -------------------------------------------------------------------------

def system(spec, out):
    out["hostname"] = hostname()
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
        resolved = ipv4_of(addr)
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


def env_view(spec, out):
    """What the job will see: the login environment, then the env file as the node
    program sources it (`set -a; . FILE`)."""
    env_file = spec.get("env_file") or "/dev/null"
    names = ENV_NAMES + (TRACKER_NAMES if spec.get("trackers") else ())
    if not os.access(env_file, os.R_OK):  # (no file to source: the login environment, no bash to ask)
        view = {name: os.environ[name] for name in names if os.environ.get(name)}
    else:
        code, text, _, _ = run(["bash", "-c", ENV_VIEW_SH, "ftb", env_file, *names], 10)
        view = {}
        for pair in (text or "").split("\0"):
            name, sep, value = pair.partition("=")
            if sep and value:
                view[name] = value
    out["env"] = {name: masked(name, value) for name, value in view.items()}
    asked = spec.get("servers") or {}
    workspace = wandb_workspace(spec.get("workdir")) if spec.get("wandb_login") or "wandb" in asked else {}
    if spec.get("wandb_login"):
        out["wandb_login"] = wandb_login(view, workspace)
    if asked:
        out["servers"] = servers(asked, view, (out.get("wandb_login") or {}).get("settings_base_url"), workspace)
        out["mlruns"] = mlruns(asked, view, spec.get("workdir"))


def dirs(spec, out):
    workdir = spec.get("workdir")
    out["workdir_ok"] = bool(workdir) and os.path.isdir(workdir)


def port(spec, out):
    heard = spec.get("heard")
    if heard is not None:  # (who takes part is said after the start: told)
        heard.wait()
    p = spec.get("port")
    if not p:
        return
    if p["role"] == "listen":
        out["port"] = listen(p["port"], p["peers"], p.get("listen_s", 8), p.get("token"), spec.get("gone"))
        if out["port"].get("busy"):
            port_off(f"master port {p['port']} in use on rank 0")
    else:
        out["port"] = connect(p["addr"], p["port"], p.get("connect_s", 6), p.get("token"), spec.get("port_off"),
                              spec.get("rank"))


def claim_then_port(spec, out):
    """Rank 0's host when the run claims its hosts: the claim first, and the master port tried
    only by the run that holds it. Two runs started at once each listened on the port while the
    other tried to bind it, and both were refused (one for the port, one for the claim)."""
    claim(spec, out)
    # (claims.py's words: "held" are the keys this run now holds, "taken" what other runs hold)
    if not (out.get("claim") or {}).get("taken"):
        port(spec, out)
    else:
        port_off("rank 0's host is held by another run")


def port_off(why):
    """Rank 0 will not listen: said at once on stderr, for the launcher to tell the other hosts,
    whose probes would otherwise knock for their whole connect_s (38 s at 256 hosts) before a
    refusal that is known now is reported."""
    sys.stderr.write(f"{PORT_OFF} {why}\n")
    sys.stderr.flush()


def heard_later(spec, end):
    """What the launcher may still say on stdin after the ranks taking part, until ``end``:
    ``{"port_off": WHY}`` (rank 0 will not listen: a host that knocks on its port stops) and
    ``{"gone": [RANK]}`` (a host whose probe ended without its facts: neither its knock on rank
    0's port nor its sentinel is waited for; the ranks go to the storage child on its pipe,
    which this closes at the end)."""
    try:
        while True:
            line = spec["stdin"].next(end)
            if not line:
                return
            try:
                said = json.loads(line)
                why, gone = said.get("port_off"), [int(r) for r in said.get("gone") or []]
            except (ValueError, AttributeError, TypeError):
                continue
            if why and spec.get("port_off") is not None:
                spec["port_off"].why = str(why)
                spec["port_off"].set()
            spec["gone"].update(gone)
            if gone and spec.get("told_fd") is not None:
                try:
                    os.write(spec["told_fd"][1], json.dumps({"gone": gone}).encode() + b"\n")
                except OSError:  # (the child is gone: its report says what it could)
                    pass
    finally:
        if spec.get("told_fd") is not None:
            os.close(spec["told_fd"][1])


def listen(port_number, want, wait, token=None, gone=None):
    """Wait on rank 0's port for ``want``: the ranks whose knock to wait for (their count, where
    no ranks are known), until ``wait`` is over. ``gone``: the ranks since known gone (a set that
    grows, :func:`heard_later`), not waited for; their knocks, come before, still count. A
    knock says the check's token and its rank."""
    waiting = set(want) if isinstance(want, list) else None
    try:
        s = listening(port_number, len(want) if waiting is not None else want)
    except OSError as exc:
        code, text, _, _ = run(["ss", "-Htlnp", f"( sport = :{port_number} )"], 5)
        return {"role": "listen", "busy": exc.strerror, "holders": (text or "").strip().splitlines()[:3]}
    peers, end = [], time.monotonic() + wait

    def left():
        return len(waiting - (gone or set())) if waiting is not None else want - len(peers)
    while left() > 0 and time.monotonic() < end:
        # (looked at again every 1/4 s where ranks may yet be said gone)
        knock = accepted(s, max(0.05, min(end - time.monotonic(), 0.25 if gone is not None else wait)))
        if knock is None:
            continue
        conn, addr = knock
        said = -1 if token is None else _said(conn, token, end)  # (another check's host knocking is not ours)
        if said is not None:
            peers.append(addr)
            if waiting is not None:
                waiting.discard(said)
        conn.close()
    s.close()
    return {"role": "listen", "accepted": peers}


def _said(conn, token, end):
    """What the peer on ``conn`` says before ``end``: None unless it is ``token`` (its check's),
    else the rank said after it (-1 when none is)."""
    got = b""
    try:
        while b"\n" not in got and len(got) < 256:
            conn.settimeout(max(0.05, min(2.0, end - time.monotonic())))
            chunk = conn.recv(256)
            if not chunk:
                break
            got += chunk
    except OSError:
        return None
    said, _, rank = got.split(b"\n")[0].decode(errors="replace").partition(" ")
    if said != token:
        return None
    try:
        return int(rank)
    except ValueError:
        return -1


def connect(addr, port_number, wait, token=None, off=None, rank=None):
    """Knock on rank 0's port until it answers or ``wait`` is over, saying ``token`` and
    ``rank``; ``off`` (a Latch with a ``why``): set when rank 0 is known not to listen, which
    ends the knocking."""
    end, last, waits = time.monotonic() + wait, "no answer", pauses()
    while True:
        if off is not None and off.wait(0):
            return {"role": "connect", "skipped": off.why}
        try:
            conn = connected(addr, port_number, 2)
            try:
                if token is not None:
                    conn.sendall(f"{token} {rank}".encode() + b"\n" if rank is not None else token.encode() + b"\n")
            finally:
                conn.close()
            return {"role": "connect", "reachable": True}
        except OSError as exc:
            last = "timed out" if isinstance(exc, TIMED_OUT) else exc.strerror or str(exc)
        if time.monotonic() >= end:  # the last try's error, and how long it kept trying
            return {"role": "connect", "reachable": False, "error": f"{last}; kept trying for {wait:g} s"}
        pause = min(next(waits), max(0.0, end - time.monotonic()))  # (refused: rank 0 has not bound it yet)
        if off is not None:
            off.wait(pause)
        else:
            time.sleep(pause)


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
            found.append({"dataset": name, "file": path, "sha256": fingerprint(path)["sha256"]})
        except OSError as exc:
            found.append({"dataset": name, "file": path, "error": f"unreadable: {exc.strerror}"})
    out["datasets"] = found
    tokenized(spec, out)  # (its key holds the digests just taken)


GEMM_MAX_BYTES = 4 << 20  # the burn-in's record of a few thousand GPUs is well under this


def gemm(spec, out):
    """``out["gemm"]``: the bf16 GEMM the last burn-in of each GPU measured (its record
    on shared storage: ftbundle/check/burnin.py ``gemm_record``), nothing where there is none,
    or {"error"}: what a run counts MFU against where ftbundle's table knows no peak."""
    path = spec.get("gemm")
    if not path:
        return
    try:
        with open(path, "rb") as f:
            data = f.read(GEMM_MAX_BYTES + 1)
    except FileNotFoundError:
        return
    except OSError as exc:
        out["gemm"] = {"error": f"{path}: {exc.strerror or exc}"}
        return
    if len(data) > GEMM_MAX_BYTES:
        out["gemm"] = {"error": f"{path}: over {GEMM_MAX_BYTES >> 20} MB, not read"}
        return
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        out["gemm"] = {"error": f"{path}: not JSON ({exc})"}
        return
    out["gemm"] = record if isinstance(record, dict) else {"error": f"{path}: not a JSON object"}


# -- check --net: iperf3 between rank 0 and one other host ------------------------------

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


def told(spec, end):
    """The ranks whose probes run (spec ``told``: every check's probe, which may start before
    every host's connection was made): one JSON line after the source on stdin,
    ``{"reachable": [RANK, ...]}``. They are what every host waits for: the others' sentinels
    (``expect``), and on the master port rank 0's peers (none when rank 0 is not among them).
    Read while the facts that need no one else are being gathered; handed to the storage child
    (its pipe, ``told_fd``) and to the port's task (``heard``). No line (the launcher gone): no
    one else is waited for. Then it reads on: rank 0 may yet be known not to listen, and a
    host known gone (:func:`heard_later`)."""
    spec["stdin"] = Lines(0)
    try:
        reachable = [int(r) for r in json.loads(spec["stdin"].next(end))["reachable"]]
    except (ValueError, KeyError, TypeError):
        reachable = [spec["rank"]]
    spec["expect"] = reachable if spec.get("token") else [spec["rank"]]
    if spec.get("port") and 0 not in reachable:
        del spec["port"]
    elif spec.get("port", {}).get("role") == "listen":
        spec["port"]["peers"] = [r for r in reachable if r != 0]
    if spec.get("told_fd") is not None:
        try:
            os.write(spec["told_fd"][1], json.dumps(spec["expect"]).encode() + b"\n")
        except OSError:  # (the child is gone: its report says what it could)
            pass
    if spec.get("port", {}).get("role") == "connect":  # (rank 0 may yet say it will not listen)
        spec["port_off"] = Latch()
    spec["gone"] = set()
    Task(heard_later, (spec, end), "heard_later").start()  # (and hosts may yet be gone)
    spec["heard"].set()


MODES = {"clean": cleanup, "iperf-server": iperf_server, "iperf-client": iperf_client}


def main():
    spec = json.loads(sys.argv[1])
    out = {}
    started = time.monotonic()
    if spec.get("mode") in MODES:
        MODES[spec["mode"]](spec, out)
        print(json.dumps(out))
        return
    if spec.get("told"):  # (the ranks taking part come on stdin: told)
        spec["heard"] = Latch()
        if spec.get("storage"):
            spec["told_fd"] = os.pipe()
    report = StorageReport(spec, *storage_apart(spec, started)) if spec.get("storage") else None
    spec["fingerprint_deadline"] = started + spec.get("deadline_s", 150) - 2  # (what it has by then)
    # the slowest first (it starts the job's interpreter): its head start is the round's
    ordered = spec.get("claim") and (spec.get("port") or {}).get("role") == "listen"
    tasks = (([versions] if spec.get("python") else []) + [system, env_view, gpus, health, image]
             + ([claim_then_port] if ordered else [port] + ([claim] if spec.get("claim") else [])))
    threads = [Task(guarded, (t, spec, out), t.__name__)
               for t in tasks]
    for t in threads:
        t.start()
    if spec.get("told"):
        told(spec, started + spec.get("deadline_s", 150))
    # what lives on the (often shared) workdir, only once the storage has answered
    stuck = report.answered(spec.get("storage_answer_s", 5), spec.get("storage_patience_s", 30)) if report else None
    if stuck is None:
        late = [Task(guarded, (t, spec, out), t.__name__)
                for t in (dirs, datasets, paths, fingerprints, model_size, gemm)]
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


if __name__ == "__main__":
    main()
