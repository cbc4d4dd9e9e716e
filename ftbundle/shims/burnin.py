"""A short measured load on one host, run by `ftbundle check --burn-in` on every host at once.

Staged into the check's directory as ftb_burnin.py and run once per node (no torchrun) with
the job's own interpreter or image. It writes one JSON object to OUT_DIR/node-$NODE_RANK.json:

* a host with GPUs: every GPU it sees, each in a process of its own, all at once (the load a
  training puts on the host's power and cooling): a bf16 GEMM (8192^3, TFLOP/s) for half the
  time, then a device-to-device copy of 1 GiB (GB/s, read + write) for the other half;
* a host without: a float32 GEMM on the CPU (GFLOP/s) on ``--threads`` threads (1 by default:
  what one core does, so hosts with other loads or a different core count still compare),
  with numpy where the interpreter has it, else torch. A host without NVIDIA device files
  (/dev/nvidiactl) never imports torch: 20 MB of private memory per host instead of about
  300 MB, so 128 containerized hosts on one machine can all be measured at once. The library
  is in the result (``lib``): figures are compared only among hosts that used the same one.

Every host starts measuring at the same moment: each, once its interpreter and its GPUs are
ready, writes ``ready/node-R`` into the check's directory (shared storage) with the time it
was ready, and waits until it can read every other host's (``--nodes``, at most
``--barrier-s``: then it measures anyway and says so). All then begin at one agreed moment,
the last host's ready time + ``--go-after`` (the same for every host, which each computes
from the same files), not each when it happens to see the last file: on a crowded machine a
host could see it seconds after another, and measure partly alone. Without it a host that
imports torch sooner would run alone for a while and look fast. Each figure is the work done over the whole measured time (after a short warm-up), never the
best iteration: a CPU quota (a cgroup's CFS period) or a GPU that throttles only part of the
time must show. Each figure is also read in ten slices of its time (``<figure>_slices``): a
host's CPU is shared with everything else running there, and a CPU GEMM that was slow on
average but ran at the fleet's speed in some slice was crowded out, not slow (see
ftbundle/check/burnin.py's ``compare``). The definitions are those of ../shared/gpu/check/health.sh (2 n^3 flops per
GEMM, 2 bytes moved per byte copied).
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=10.0, help="measured time per host (GPUs: split between tests)")
parser.add_argument("--out-dir", required=True, help="node-$NODE_RANK.json goes here")
parser.add_argument("--threads", type=int, default=1, help="CPU GEMM threads")
parser.add_argument("--cpu-size", type=int, default=512, help="CPU GEMM matrix size")
parser.add_argument("--gpu-size", type=int, default=8192, help="GPU GEMM matrix size")
parser.add_argument("--copy-mib", type=int, default=1024, help="GPU copy size, MiB")
parser.add_argument("--nodes", type=int, default=1, help="hosts measuring at once: wait for all their ready files")
parser.add_argument("--barrier-s", type=float, default=60.0, help="wait at most this long for the other hosts")
parser.add_argument("--go-after", type=float, default=1.0,
                    help="every host begins this long after the last host was ready (its time in its ready file)")
parser.add_argument("--device", type=int, help="measure this GPU alone and print its JSON (a child process)")
args = parser.parse_args()

WARMUP_S = 0.5
SLICES = 10  # the measured time is also read in this many slices (each figure's "_slices")
NODE_RANK = int(os.environ.get("NODE_RANK", "0"))


def barrier() -> dict:
    """Say this host is ready (when, in its ready file: written whole, by a rename), wait for
    every other host's (opened by name, as NFS revalidates on open), then until the agreed
    start: the last ready time + --go-after. What it waited, for whom when it gave up, and how
    late it began when it saw the last file only after that start."""
    ready = os.path.join(args.out_dir, "ready")
    os.makedirs(ready, exist_ok=True)
    mine = os.path.join(ready, f"node-{NODE_RANK}")
    said = f"{time.time():.6f}"  # (as written: the others read this figure, so every host's max is the same)
    with open(mine + ".tmp", "w") as f:
        f.write(f"{said} {socket.gethostname()}")
    os.replace(mine + ".tmp", mine)
    started = time.monotonic()
    missing = set(range(args.nodes)) - {NODE_RANK}
    times = [float(said)]
    while missing and time.monotonic() - started < args.barrier_s:
        for rank in sorted(missing):
            try:
                with open(os.path.join(ready, f"node-{rank}")) as f:
                    times.append(float(f.read().split()[0]))
                missing.discard(rank)
            except (OSError, ValueError, IndexError):
                pass
        if missing:
            time.sleep(0.02)
    go = max(times) + args.go_after
    late = time.time() - go
    if late < 0 and not missing:
        time.sleep(-late)
    return {"waited_s": round(time.monotonic() - started, 3), "not_ready": sorted(missing),
            "late_s": round(max(late, 0.0), 3), "go": round(go, 3), "began": round(time.time(), 3)}


def timed(step, seconds: float, sync=lambda: None) -> tuple[int, float, list[float]]:
    """Run ``step`` for about ``seconds`` after a warm-up; (iterations, seconds taken, the
    rate in iterations/s of each slice of about ``seconds / SLICES``, in order)."""
    until = time.perf_counter() + WARMUP_S
    while time.perf_counter() < until:
        step()
    sync()
    started = time.perf_counter()
    iters = 0
    batch = 1
    slices, mark, mark_iters = [], started, 0  # (iterations, seconds) of each slice
    while True:
        for _ in range(batch):
            step()
        iters += batch
        sync()
        now = time.perf_counter()
        elapsed = now - started
        if now - mark >= seconds / SLICES or elapsed >= seconds:
            # (a last piece shorter than half a slice joins the one before: an iteration or two
            # timed alone says nothing of a quota that holds the host back 90 ms in every 100)
            if slices and now - mark < seconds / SLICES / 2:
                n, dt = slices.pop()
                slices.append((n + iters - mark_iters, dt + now - mark))
            else:
                slices.append((iters - mark_iters, now - mark))
            mark, mark_iters = now, iters
        if elapsed >= seconds:
            return iters, elapsed, [n / dt for n, dt in slices]
        if elapsed < seconds / 20:  # few checks of the clock: a sync per check costs the GPU
            batch *= 2


def sliced(rates: list[float], per_iter: float) -> list[float]:
    """Each slice's rate (iterations/s) in the figure's unit (``per_iter`` of it an iteration)."""
    return [round(r * per_iter, 4) for r in rates]


def gpu_host() -> bool:
    """Could torch see a GPU here? Not without the driver's device files, nor with every GPU
    hidden: then torch is not imported at all."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")


def cpu_gemm() -> dict:
    n = args.cpu_size
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.threads)  # read by the BLAS when it loads, below
    try:
        import numpy

        lib = f"numpy {numpy.__version__}"
        rng = numpy.random.default_rng(0)
        a, b = (rng.standard_normal((n, n), dtype=numpy.float32) for _ in range(2))
        c = numpy.empty((n, n), dtype=numpy.float32)
        step = lambda: numpy.matmul(a, b, out=c)  # noqa: E731
    except ImportError:
        import torch

        lib = f"torch {torch.__version__}"
        torch.set_num_threads(args.threads)
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        step = lambda: torch.matmul(a, b, out=c)  # noqa: E731
    step()
    waited = barrier()
    iters, elapsed, slices = timed(step, args.seconds)
    return {"device": "cpu", "lib": lib, "threads": args.threads, "size": n, "iters": iters,
            "seconds": round(elapsed, 3), "cpu_gemm_gflops": 2 * n ** 3 * iters / elapsed / 1e9,
            "cpu_gemm_gflops_slices": sliced(slices, 2 * n ** 3 / 1e9), "barrier": waited}


def one_gpu(index: int) -> dict:
    import torch

    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    half = args.seconds / 2
    n = args.gpu_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)
    sync()
    print("ready", flush=True)  # to the parent, which answers once every host is ready
    sys.stdin.readline()
    gemm_iters, gemm_s, gemm_slices = timed(lambda: torch.matmul(a, b, out=c), half, sync)
    a = b = c = None  # the GEMM operands freed before the copy buffers (the lambda above holds the names)
    nbytes = args.copy_mib * 2 ** 20
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_iters, copy_s, copy_slices = timed(lambda: y.copy_(x), half, sync)
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    # the index nvidia-smi gives it, where CUDA_VISIBLE_DEVICES names indices (not UUIDs)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    shown = visible[index] if index < len(visible) and visible[index].isdigit() else index
    return {"device": f"GPU {shown}", "local_index": index,
            "name": props.name, "uuid": f"GPU-{uuid}" if uuid is not None else None,
            "gemm_bf16_tflops": 2 * n ** 3 * gemm_iters / gemm_s / 1e12,
            "hbm_copy_gbps": 2 * nbytes * copy_iters / copy_s / 1e9,
            "gemm_bf16_tflops_slices": sliced(gemm_slices, 2 * n ** 3 / 1e12),
            "hbm_copy_gbps_slices": sliced(copy_slices, 2 * nbytes / 1e9),
            "gemm_size": n, "copy_mib": args.copy_mib, "seconds": round(gemm_s + copy_s, 3)}


def all_gpus(count: int) -> list[dict]:
    """One process per GPU, all at once; a GPU whose process fails is reported with its error."""
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--device", str(i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(count)]
    for proc in procs:
        proc.stdout.readline()  # "ready" (or nothing: it failed, and says why below)
    waited = barrier()
    for proc in procs:
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        except OSError:
            pass
    results = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate()
        try:
            results.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            lines = (err or out).strip().splitlines()
            results.append({"device": f"GPU {i}", "local_index": i,
                            "error": lines[-1] if lines else f"exit {proc.returncode}"})
        results[-1]["barrier"] = waited
    return results


if args.device is not None:
    print(json.dumps(one_gpu(args.device)), flush=True)
    sys.exit(0)

started = time.time()
gpus, torch_version = 0, None
if gpu_host():
    import torch

    gpus, torch_version = (torch.cuda.device_count() if torch.cuda.is_available() else 0), torch.__version__
result = {"hostname": socket.gethostname(), "node_rank": NODE_RANK, "kind": "gpu" if gpus else "cpu",
          **({"torch": torch_version} if torch_version else {}),
          "devices": all_gpus(gpus) if gpus else [cpu_gemm()], "started": started}
result["maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # this process's peak
path = os.path.join(args.out_dir, f"node-{result['node_rank']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(result, f)
os.replace(path + ".tmp", path)
print("ftb-burnin " + " ".join(f"{d['device']}: " + ", ".join(f"{k}={v:.4g}" for k, v in d.items()
                                                           if k.endswith(("flops", "gbps")))
                               for d in result["devices"]), flush=True)
