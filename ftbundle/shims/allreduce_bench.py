"""A short all-reduce benchmark across every rank, run by `ftbundle check --net` under torchrun.

Staged into the run directory as ftb_allreduce_bench.py. NCCL when the ranks have GPUs,
gloo on the CPU otherwise. Rank 0 prints one line that the controller reads:

    ftb-allreduce backend=gloo world=4 size_mib=16 iters=10 time_ms=... algbw_gbps=... busbw_gbps=...

Bus bandwidth is nccl-tests' definition for all-reduce: algbw * 2 * (n - 1) / n, the
rate each link must carry, comparable to the links' own speed whatever the world size.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--size-mib", type=float, default=16)
parser.add_argument("--iters", type=int, default=10)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
parser.add_argument("--timeout", type=float, default=60, help="process group timeout, seconds")
parser.add_argument("--out", help="rank 0 also writes its result here, as JSON (for the controller)")
args = parser.parse_args()

backend = args.backend
if backend == "auto":
    backend = "nccl" if torch.cuda.is_available() else "gloo"
if backend == "nccl":
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
else:
    device = torch.device("cpu")

dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
rank, world = dist.get_rank(), dist.get_world_size()
numel = int(args.size_mib * 1024 * 1024) // 4
data = torch.ones(numel, dtype=torch.float32, device=device)


def sync() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the first exchange doubles as a correctness check: every rank contributed its ones
dist.all_reduce(data)
sync()
if data[0].item() != world:
    raise SystemExit(f"all-reduce gave {data[0].item()}, expected {world}")
for _ in range(max(0, args.warmup - 1)):
    dist.all_reduce(data)
data.fill_(1.0)
sync()
dist.barrier()
started = time.perf_counter()
for _ in range(args.iters):
    dist.all_reduce(data)
sync()
elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
per_iter = elapsed.item() / max(1, args.iters)
algbw = numel * 4 / per_iter  # bytes per second
busbw = algbw * 2 * (world - 1) / world
if rank == 0 and args.out:
    import json
    with open(args.out + ".tmp", "w") as f:
        json.dump({"backend": backend, "world": world, "size_mib": args.size_mib, "iters": args.iters,
                   "time_ms": per_iter * 1e3, "algbw_gbps": algbw * 8 / 1e9, "busbw_gbps": busbw * 8 / 1e9}, f)
    import os
    os.replace(args.out + ".tmp", args.out)
if rank == 0:
    print(f"ftb-allreduce backend={backend} world={world} size_mib={args.size_mib:g} iters={args.iters} "
          f"time_ms={per_iter * 1e3:.3f} algbw_gbps={algbw * 8 / 1e9:.3f} busbw_gbps={busbw * 8 / 1e9:.3f}",
          flush=True)
dist.destroy_process_group()
