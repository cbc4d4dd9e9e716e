"""A real distributed job for failure tests: ranks exchange tensors with gloo until told to stop.

Each step all-reduces a tensor and checks the sum, so every rank depends on every other;
rank 0 prints the step. Runs `--steps` steps (0: until killed).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--sleep", type=float, default=0.2)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# what the rank sees of the network settings (from the NCCL env file site.yml writes)
seen = " ".join(f"{k}={os.environ.get(k, '')}" for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_TIMEOUT"))
print(f"rank {rank} of world size {world} on {os.uname().nodename} {seen}", flush=True)
step = 0
while args.steps == 0 or step < args.steps:
    t = torch.ones(1024) * (rank + 1)
    dist.all_reduce(t)
    assert t[0].item() == world * (world + 1) / 2
    if rank == 0:
        print(f"step {step} allreduce ok", flush=True)
    step += 1
    time.sleep(args.sleep)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
