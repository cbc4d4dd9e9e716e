"""Benchmark: what ftbundle costs the training itself.

The quickstart (a real LoRA SFT of the tiny local model, 2 ranks on this machine) through
`ftbundle run`, against the very same staged config and entry run by plain torchrun
(`python -m torch.distributed.run --nproc_per_node 2 ...`). Compared: LlamaFactory's own
train_samples_per_second; the target ratio is at least 0.98. Runs alternate; median of
--runs each, and the median of the paired ratios. The output directory is cleared before every run (a fresh fine-tune, never a
resume).

    make model && .venv/bin/python bench/overhead.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

from common import REPO, Measured, measure, median, table, write_section

import tempfile
from pathlib import Path

import yaml

EXAMPLE = REPO / "examples" / "quickstart"
QUICKSTART = Path(tempfile.mkdtemp(prefix="ftb-bench-overhead-")) / "quickstart"
OUTPUT = QUICKSTART / ".shared" / "output" / "quickstart-lora"


def prepare() -> None:
    """A copy of the quickstart that trains longer, on the model `make model` made."""
    shutil.copytree(EXAMPLE, QUICKSTART, ignore=shutil.ignore_patterns(".shared"))
    train = yaml.safe_load((QUICKSTART / "train.yaml").read_text())
    train.update(model_name_or_path=str(EXAMPLE / ".shared" / "tiny-llama"), max_steps=STEPS, save_steps=STEPS)
    (QUICKSTART / "train.yaml").write_text(yaml.safe_dump(train))
    job = yaml.safe_load((QUICKSTART / "job.yaml").read_text())
    job["runtime"]["python"] = sys.executable
    (QUICKSTART / "job.yaml").write_text(yaml.safe_dump(job))
SPS = re.compile(r"train_samples_per_second'?\s*[:=]\s*([0-9.]+)")
STEPS = 400  # about 15 s of training per run: long enough for a 2 % comparison


def samples_per_second(text: str) -> float:
    found = SPS.findall(text)
    if not found:
        raise RuntimeError("no train_samples_per_second in:\n" + text[-3000:])
    return float(found[-1])


def via_ftbundle() -> tuple[float, str, Measured]:
    shutil.rmtree(OUTPUT, ignore_errors=True)
    m = measure([sys.executable, "-m", "ftbundle", "run", "-v", str(QUICKSTART / "job.yaml"), "--no-check"])
    if m.code != 0:
        raise RuntimeError(m.stderr.decode()[-3000:])
    run_dir = re.search(r"logs in (\S+)", m.stderr.decode()).group(1)
    log = next(p for p in os.scandir(run_dir) if p.name.startswith("node-0-")).path
    return samples_per_second(open(log).read()), run_dir, m


def via_torchrun(run_dir: str, unbuffered: bool = False) -> float:
    """The staged run by hand. ``unbuffered``: with PYTHONUNBUFFERED=1, as ftbundle sets it for
    every node (so the log on shared storage is live), to tell its cost from ftbundle's own."""
    shutil.rmtree(OUTPUT, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = os.path.dirname(sys.executable) + ":" + env["PATH"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", "29512",
            f"{run_dir}/ftb_llamafactory.py", f"{run_dir}/llamafactory.yaml"]
    m = measure(argv, env=env, cwd=QUICKSTART)  # where ftbundle's node runs it: the job's workdir
    if m.code != 0:
        raise RuntimeError(m.stderr.decode()[-3000:])
    return samples_per_second(m.stdout.decode() + m.stderr.decode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--unbuffered", action="store_true",
                        help="also plain torchrun with PYTHONUNBUFFERED=1 (ftbundle sets it on every node)")
    args = parser.parse_args()
    if not (EXAMPLE / ".shared" / "tiny-llama").exists():
        raise SystemExit("no tiny model: run `make model` first")
    prepare()
    ours, plain, unbuf, own, walls = [], [], [], [], []
    for i in range(args.runs):
        sps, run_dir, m = via_ftbundle()
        ours.append(sps)
        own.append(m.self_cpu_s)
        walls.append(m.wall_s)
        plain.append(via_torchrun(run_dir))
        if args.unbuffered:
            unbuf.append(via_torchrun(run_dir, unbuffered=True))
        print(f"run {i}: ftbundle {ours[-1]:.2f}  torchrun {plain[-1]:.2f}"
              + (f"  torchrun+PYTHONUNBUFFERED {unbuf[-1]:.2f}" if unbuf else "") + " samples/s", flush=True)
    shutil.rmtree(QUICKSTART.parent, ignore_errors=True)
    ratio = median(ours) / median(plain)
    # each ftbundle run next to the torchrun run just after it: drift on this shared machine
    # (other jobs, thermal, page cache) hits both sides of a pair alike
    pairs = sorted(o / p for o, p in zip(ours, plain))
    md = ["## Overhead on training (issue 9)", "",
          f"The quickstart LoRA SFT, {STEPS} steps (2 ranks, CPU, gloo), {args.runs} alternating runs each; LlamaFactory's "
          "train_samples_per_second. Target: ratio at least 0.98.", "",
          table(["launcher", "median samples/s", "runs"],
                [["ftbundle run", f"{median(ours):.2f}", ", ".join(f"{x:.2f}" for x in ours)],
                 ["plain torchrun", f"{median(plain):.2f}", ", ".join(f"{x:.2f}" for x in plain)]]
                + ([["plain torchrun, PYTHONUNBUFFERED=1", f"{median(unbuf):.2f}", ", ".join(f"{x:.2f}" for x in unbuf)]]
                   if unbuf else [])), "",
          f"ratio of the medians, ftbundle / torchrun: **{ratio:.3f}**; median of the {len(pairs)} paired ratios "
          f"(each ftbundle run / the torchrun run right after it): **{median(pairs):.3f}** "
          f"(range {pairs[0]:.3f}-{pairs[-1]:.3f}).", "",
          f"ftbundle's own process (children excluded, sampled from /proc) used a median {median(own):.2f} s of "
          f"CPU per run, whose median wall time was {median(walls):.1f} s: what the launcher itself takes from the "
          "training on this 2-core machine."]
    write_section("overhead", "\n".join(md))


if __name__ == "__main__":
    main()
