"""A data-parallel job that checkpoints and resumes, on any world size (bench/node_loss.py).

A small model trained with DDP over gloo; rank 0 saves model, optimizer and step to
``--ckpt``/latest.pt every ``--save-every`` steps (written whole, then renamed), and every rank
loads it at start when it is there: a restart on fewer or other hosts goes on from that step.
Each step is timed by ftbundle's step clock (ftb_steptimes.py, staged in the run directory),
so the launcher sees each node's first step on its heartbeat channel.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sleep", type=float, default=0.2)
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--ckpt", required=True)
args = parser.parse_args()

sys.path.insert(0, os.environ["FTB_RUN_DIR"])
from ftb_steptimes import StepClock  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
path = os.path.join(args.ckpt, "latest.pt")
start = 0
if os.path.exists(path):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
    if rank == 0:
        print(f"resuming from step {start} on world size {world}", flush=True)
ddp = DistributedDataParallel(model)
clock = StepClock()
clock.watch(model)
for step in range(start, args.steps):
    clock.step_begins()
    loss = ddp(torch.randn(64, 256)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    clock.step_done()
    if rank == 0:
        print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} world {world}", flush=True)
        if (step + 1) % args.save_every == 0:
            os.makedirs(args.ckpt, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                       path + ".tmp")
            os.replace(path + ".tmp", path)
    time.sleep(args.sleep)
dist.destroy_process_group()
