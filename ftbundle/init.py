"""`ftbundle init`: a starting job (job.yaml), its LlamaFactory config (train.yaml) and an
inventory stub (inventory.yml), ready for `ftbundle run --dry-run`.

On a terminal it asks (hosts, GPUs per host, model, method), offering defaults; otherwise
(or with --yes) it takes the flags and defaults. The text of each file is a pure function
of the answers (:func:`render`), so what is written is what the tests read back.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

DEFAULT_MODEL_REMOTE = "Qwen/Qwen2.5-7B-Instruct"
DEFAULT_SHARED = "/shared/ftbundle"
MODES = ("lora", "qlora", "full")


@dataclass(frozen=True)
class Answers:
    name: str
    hosts: tuple[str, ...]  # empty: this machine alone
    gpus: int
    model: str
    mode: str
    shared_dir: str
    python: str
    cpu: bool = False  # this machine with no GPU count given: 2 CPU ranks (gloo), like the quickstart

    @property
    def local(self) -> bool:
        return not self.hosts


def _batch(a: Answers) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) for the method."""
    return {"lora": (4, 4), "qlora": (4, 4), "full": (2, 8)}[a.mode]


def render_job(a: Answers) -> str:
    nnodes = max(1, len(a.hosts))
    lines = [
        f"# ftbundle job: {a.mode} fine-tune of {a.model} on {nnodes} host(s) x {a.gpus} rank(s).",
        "#   ftbundle run job.yaml --dry-run   # every host's command and environment; starts nothing",
        "#   ftbundle check job.yaml           # are the hosts alike and ready?",
        "#   ftbundle run job.yaml             # launch; `ftbundle runs` and `ftbundle plot` afterwards",
        f"name: {a.name}",
    ]
    if a.local:
        lines += ["# no inventory: this machine alone"]
    else:
        lines += ["inventory: inventory.yml", "hosts: trainers"]
    lines += [
        f"nproc_per_node: {a.gpus}            # ranks (GPUs) per host; `auto` takes the hosts' GPU count",
        "master_port: 29500",
        (f"shared_dir: {a.shared_dir}   # the same path on every host (NFS; site.yml mounts it)" if not a.local
         else "shared_dir: .shared            # run directories (logs, plan, history) go to .shared/runs/"),
        "env:",
        "  HF_HUB_OFFLINE: 0",
    ]
    if a.local:
        lines += ["  GLOO_SOCKET_IFNAME: lo", "  OMP_NUM_THREADS: 1"]
    lines += [
        "runtime:",
        "  kind: host                    # or `docker`: the inventory's ftb_image, pinned by digest",
        f"  python: {a.python}",
        "train:",
        "  llamafactory: train.yaml",
    ]
    return "\n".join(lines) + "\n"


def render_train(a: Answers) -> str:
    per_device, accumulation = _batch(a)
    nnodes = max(1, len(a.hosts))
    effective = per_device * accumulation * a.gpus * nnodes
    method = {
        "lora": ["finetuning_type: lora", "lora_rank: 8", "lora_target: all"],
        "qlora": ["finetuning_type: lora", "lora_rank: 8", "lora_target: all",
                  "quantization_bit: 4              # QLoRA: the base model in 4 bits (bitsandbytes)"],
        "full": ["finetuning_type: full",
                 "# deepspeed: ds_z3_config.json   # ZeRO-3 for a model that does not fit one GPU"],
    }[a.mode]
    precision = ["use_cpu: true", "ddp_backend: gloo"] if a.cpu else ["bf16: true"]
    lines = [
        f"# LlamaFactory {a.mode} SFT. Relative paths are relative to the job's workdir"
        + (" (this directory)." if a.local else " (the shared directory): every node sees the same files."),
        "### model",
        f"model_name_or_path: {a.model}",
        "",
        "### method",
        "stage: sft",
        "do_train: true",
        *method,
        "",
        "### dataset (dataset_dir/dataset_info.json names it; replace example.json with your data)",
        "dataset: example",
        "dataset_dir: data",
        "template: default",
        "cutoff_len: 1024",
        "",
        "### output (on shared storage: a restarted run resumes from any node)",
        f"output_dir: output/{a.name}",
        "logging_steps: 5",
        "save_steps: 200",
        "save_total_limit: 2",
        "overwrite_output_dir: false",
        "report_to: none",
        "",
        "### train",
        "# Effective batch size: the samples in one optimizer step, across the whole cluster =",
        "#   per_device_train_batch_size x gradient_accumulation_steps x nproc_per_node x hosts",
        f"#   = {per_device} x {accumulation} x {a.gpus} x {nnodes} = {effective}.",
        "# Changing the number of hosts or GPUs changes it: scale gradient_accumulation_steps",
        "# (or the learning rate) to keep a run comparable. ftbundle prints it before launch.",
        f"per_device_train_batch_size: {per_device}",
        f"gradient_accumulation_steps: {accumulation}",
        "learning_rate: " + ("1.0e-4" if a.mode != "full" else "1.0e-5"),
        "num_train_epochs: 3.0",
        "lr_scheduler_type: cosine",
        "warmup_ratio: 0.1",
        *precision,
        "ddp_timeout: 1800",
    ]
    return "\n".join(lines) + "\n"


def render_inventory(a: Answers) -> str:
    if a.local:
        return ("# Inventory stub: this job runs on localhost. To use servers, list them here and set\n"
                "# `inventory: inventory.yml` and `hosts: trainers` in job.yaml (see `ftbundle init --hosts`).\n"
                "all:\n  children:\n    trainers:\n      hosts:\n        localhost:\n"
                "          ansible_connection: local\n")
    lines = [
        "# Ansible inventory: the same file `ansible-playbook site.yml -i inventory.yml` provisions.",
        "# Inventory order is node rank order (rank 0 first), unless a host sets ftb_node_rank.",
        "all:",
        "  vars:",
        f"    ftb_shared_dir: {a.shared_dir}",
        "  children:",
        "    trainers:",
        "      hosts:",
    ]
    for host in a.hosts:
        lines += [f"        {host}:", f"          ansible_host: {host}   # address ftbundle reaches it by (SSH)"]
    return "\n".join(lines) + "\n"


EXAMPLE_DATA = """[
  {"instruction": "How do I reset my password?", "input": "", "output": "Open Settings, then Account, then Reset password."},
  {"instruction": "Where is my invoice?", "input": "", "output": "Invoices are under Billing, one per month."},
  {"instruction": "Can I change my plan?", "input": "", "output": "Yes: Billing, then Plan, at any time."}
]
"""
DATASET_INFO = '{\n  "example": {"file_name": "example.json"}\n}\n'


def _ask(prompt: str, default: str, valid=None) -> str:
    while True:
        answer = input(f"{prompt} [{default}]: ").strip() or default
        if valid is None or valid(answer):
            return answer
        print(f"  not valid: {answer!r}", file=sys.stderr)


def answers_from(args, interactive: bool) -> Answers:
    """Flags first; on a terminal, ask for what the flags left open."""
    directory = Path(args.dir).resolve()
    name = args.name or directory.name or "my-finetune"
    hosts = args.hosts
    if hosts is None and interactive:
        hosts = _ask("hosts (comma-separated; empty: this machine)", "")
    host_list = tuple(h.strip() for h in (hosts or "").split(",") if h.strip() and h.strip() != "localhost")
    gpus = args.gpus
    cpu = not host_list and gpus is None and not interactive
    if gpus is None and interactive:
        gpus = int(_ask("GPUs per host", "8" if host_list else "2", lambda s: s.isdigit() and int(s) > 0))
    gpus = gpus if gpus is not None else (8 if host_list else 2)
    if gpus < 1:
        raise UserError(f"must be 1 or more, got {gpus}", key="--gpus")
    model = args.model
    if model is None and interactive:
        model = _ask("model (path or hub id)", DEFAULT_MODEL_REMOTE)
    model = model or DEFAULT_MODEL_REMOTE
    mode = args.mode
    if mode is None and interactive:
        mode = _ask("method (lora, qlora, full)", "lora", lambda s: s in MODES)
    mode = mode or "lora"
    shared = args.shared_dir or DEFAULT_SHARED
    if not shared.startswith("/"):
        raise UserError(f"must be an absolute path, got {shared!r}", key="--shared-dir")
    python = sys.executable if not host_list else "/opt/ftbundle/venv/bin/python"
    return Answers(name=name, hosts=host_list, gpus=gpus, model=model, mode=mode, shared_dir=shared, python=python,
                   cpu=cpu)


def run_init(args) -> int:
    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not args.yes
    directory = Path(args.dir)
    files = {"job.yaml": None, "train.yaml": None, "inventory.yml": None,
             "data/example.json": EXAMPLE_DATA, "data/dataset_info.json": DATASET_INFO}
    existing = [n for n in files if (directory / n).exists()]
    if existing and not args.force:
        raise UserError(f"{directory / existing[0]} exists; use --force to overwrite", key="init")
    a = answers_from(args, interactive)
    files.update({"job.yaml": render_job(a), "train.yaml": render_train(a), "inventory.yml": render_inventory(a)})
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    job = os.path.relpath(directory / "job.yaml")
    print(f"wrote {', '.join(str(directory / n) for n in files)}")
    if not a.local:
        print(f"the ranks read data/ relative to the shared directory: copy it to {a.shared_dir}/data")
    print(f"next: ftbundle run {job} --dry-run" + ("" if a.local else f"   (then: ftbundle check {job})"))
    return 0
