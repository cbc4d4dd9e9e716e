"""The probe's GPU facts (ftbundle/remote/probe.py, ``gpus`` and ``health``): nvidia-smi's GPU list,
ids, memory and compute processes, and the health query, temperature thresholds and kernel log's
Xid lines, raw (ftbundle/gpu_health.py reads them), each under a time limit: a hung driver is a
fact, not a lost host. Shipped within the probe (``probe_source``); standard library only."""

if __package__:  # imported (tests); shipped, probe_common.py's text comes before this one
    from .probe_common import have, last_line, run

GPU_QUERY = "name,driver_version,memory.total"
GPU_IDS_QUERY = "index,uuid,memory.used"
APPS_QUERY = "pid,process_name,gpu_uuid,used_memory"


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
    h = spec.get("health")
    if not h or not have("nvidia-smi"):
        return
    import re
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
