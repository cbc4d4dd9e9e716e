"""A gloo all-reduce loop that can hang on purpose, for the stall watchdog's tests.

Every step all-reduces a tensor (so every rank waits for every other); rank 0 prints the
step. At step ``--hang-at``, rank ``--hang-rank`` either deadlocks on a lock in a Python
function of its own (``--how lock``: the other ranks then wait in all_reduce) or stops
itself with SIGSTOP (``--how stop``: a frozen process).
"""

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=0)
parser.add_argument("--sleep", type=float, default=0.5)
parser.add_argument("--hang-rank", type=int, default=-1)
parser.add_argument("--hang-at", type=int, default=3)
parser.add_argument("--how", choices=["lock", "stop"], default="lock")
args = parser.parse_args()


def wait_for_lock():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: a deadlock outside any collective


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
step = 0
while args.steps == 0 or step < args.steps:
    if step:
        time.sleep(args.sleep)  # (between steps: after the last one the program ends at once)
    if rank == args.hang_rank and step == args.hang_at:
        if args.how == "lock":
            wait_for_lock()
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
    t = torch.ones(16) * (rank + 1)
    dist.all_reduce(t)
    if rank == 0:
        print(f"step {step} allreduce ok", flush=True)
    step += 1
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
os._exit(0)  # as ftbundle's LlamaFactory entry does: no slow interpreter shutdown after the last word
