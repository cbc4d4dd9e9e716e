"""`ftbundle init`: a starting job (job.yaml), its LlamaFactory config (train.yaml) and an
inventory stub (inventory.yml), ready for `ftbundle run --dry-run`.

On a terminal it asks (hosts, GPUs per host, model, method), offering defaults; otherwise
(or with --yes) it takes the flags and defaults. The text of each file is a pure function
of the answers (:func:`render`), so what is written is what the tests read back.
"""

from __future__ import annotations

import os
import shlex
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
    """(per_device_train_batch_size, gradient_accumulation_steps) for the method. A CPU job's
    example trains its 3 example samples for real (the newcomer walk: a batch of 32 over 3
    samples made one step an epoch, and no step was ever logged): one sample per rank and step."""
    if a.cpu:
        return 1, 1
    return {"lora": (4, 4), "qlora": (4, 4), "full": (2, 8)}[a.mode]


def _offline(a: Answers) -> bool:
    """A model given as a path needs no hub: the ranks are told not to ask it."""
    return a.model.startswith(("/", "./", "../", "~"))


def render_job(a: Answers) -> str:
    nnodes = max(1, len(a.hosts))
    ranks = _ranks(a)
    kind = "CPU rank(s) (gloo, no GPU)" if a.cpu else "rank(s)"
    lines = [
        f"# ftbundle job: {a.mode} fine-tune of {a.model} on {nnodes} host(s) x {ranks} {kind}.",
        "#   ftbundle run job.yaml --dry-run   # every host's command and environment; starts nothing",
        "#   ftbundle check job.yaml           # are the hosts alike and ready?",
        "#   ftbundle run job.yaml             # launch; `ftbundle runs` and `ftbundle plot` afterwards",
        f"name: {a.name}",
    ]
    if a.local:
        lines += ["# no inventory: this machine alone"]
    else:
        lines += ["inventory: inventory.yml         # the inventory site.yml provisions", "hosts: trainers"]
    lines += [f"nproc_per_node: {ranks}            # ranks per host"
              + ("" if a.cpu else " (one per GPU); `auto` takes each host's GPU count")]
    if a.cpu:
        lines += ["gpus_per_node: 0                 # a CPU job: gloo, no GPU asked for anywhere"]
    lines += [
        "master_port: 29500" + ("" if a.local else "                # = the inventory's ftb_master_port (the firewall opens it)"),
        (f"shared_dir: {a.shared_dir}   # = the inventory's ftb_shared_dir: the same storage on every host"
         if not a.local else "shared_dir: .shared            # run directories (logs, plan, history) go to .shared/runs/"),
        "env:",
    ]
    if _offline(a):
        lines += ["  HF_HUB_OFFLINE: 1              # the model is a path: nothing is fetched from a hub",
                  "  HF_DATASETS_OFFLINE: 1"]
    else:
        lines += ["  HF_HUB_OFFLINE: 0              # the model is fetched from the hub by every host"]
    if a.local:
        lines += ["  GLOO_SOCKET_IFNAME: lo", "  OMP_NUM_THREADS: 1"]
        lines += ["runtime:", "  kind: host                    # this interpreter (it has torch and LlamaFactory)",
                  f"  python: {a.python}"]
    else:
        lines += [
            "runtime:",
            "  kind: docker                  # the training image site.yml pinned on every host (the inventory's",
            "                                # ftb_image, recorded in /etc/ftbundle/image.ref); it must hold torch",
            "                                # and LlamaFactory (docs/quickstart-servers.md#the-training-image)",
        ]
        if not a.cpu:
            lines += ["  gpus: all"]
    lines += ["train:", "  llamafactory: train.yaml"]
    return "\n".join(lines) + "\n"


def _ranks(a: Answers) -> int:
    """Ranks per host: one per GPU; a CPU job runs 2 on this machine, 1 on each server."""
    if not a.cpu:
        return a.gpus
    return 2 if a.local else 1


def render_train(a: Answers) -> str:
    per_device, accumulation = _batch(a)
    nnodes = max(1, len(a.hosts))
    effective = per_device * accumulation * _ranks(a) * nnodes
    method = {
        "lora": ["finetuning_type: lora", "lora_rank: 8", "lora_target: all"],
        "qlora": ["finetuning_type: lora", "lora_rank: 8", "lora_target: all",
                  "quantization_bit: 4              # QLoRA: the base model in 4 bits (bitsandbytes)"],
        "full": ["finetuning_type: full",
                 "# deepspeed: ds_z3_config.json   # ZeRO-3 for a model that does not fit one GPU"],
    }[a.mode]
    precision = (["use_cpu: true                     # a CPU job: no bf16 (no GPU to run it)", "ddp_backend: gloo"]
                 if a.cpu else ["bf16: true                        # Ampere (A100) or newer; fp16 on older GPUs"])
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
        "logging_steps: " + ("1" if a.cpu else "5"),
        "save_steps: 200",
        "save_total_limit: 2",
        "overwrite_output_dir: false",
        "report_to: none",
        "",
        "### train",
        "# Effective batch size: the samples in one optimizer step, across the whole cluster =",
        "#   per_device_train_batch_size x gradient_accumulation_steps x nproc_per_node x hosts",
        f"#   = {per_device} x {accumulation} x {_ranks(a)} x {nnodes} = {effective}.",
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
    first = a.hosts[0]
    lines = [
        "# Ansible inventory: `ansible-playbook site.yml -i inventory.yml` makes these hosts ready and",
        "# `ftbundle run job.yaml` launches on them. Fill in each line marked FILL IN (uncomment it and",
        "# put your value); docs/quickstart-servers.md walks through it. Then:",
        "#   ansible-playbook site.yml -i inventory.yml && ftbundle check job.yaml && ftbundle run job.yaml",
        "# (site.yml and ansible.cfg are in the ftbundle checkout: `ftbundle init` printed the command in full)",
        "all:",
        "  vars:",
        f"    ftb_shared_dir: {a.shared_dir}     # the shared storage, at this path on every host (job's shared_dir)",
        "    ftb_master_port: 29500                # torchrun's rendezvous port (job's master_port)",
        "    # FILL IN: the account Ansible and ftbundle log in as over SSH (docs/provisioning.md#the-inventory)",
        "    # ansible_user: ubuntu",
        "    # FILL IN: the user that runs training: owns the shared storage, gets the SSH mesh",
        "    # (docs/provisioning.md#the-inventory)",
        "    # ftb_training_user: ubuntu",
        "    # FILL IN: the training image, pinned by digest, with torch and LlamaFactory in it",
        "    # (docs/quickstart-servers.md#the-training-image)",
        "    # ftb_image: registry.example.com/ml/train@sha256:<the 64 hex digits of its digest>",
        "    # FILL IN if the image's registry is served over plain HTTP (no TLS): its host:port",
        "    # (docs/provisioning.md#registry-credentials)",
        "    # container_runtime_insecure_registries: [\"registry.example.com:5000\"]",
        "  children:",
        "    trainers:                             # rank order is this order (or ftb_node_rank)",
        "      hosts:",
    ]
    for host in a.hosts:
        lines += [f"        {host}:", f"          ansible_host: {host}   # the address ftbundle and Ansible reach it by (SSH)"]
    lines += [
        "    nfs_server:",
        "      hosts:",
        "        # FILL IN: the host that exports the shared storage (a trainer will do), or leave this group",
        "        # empty and set nfs_client_server and nfs_client_export in vars for an NFS server you",
        "        # already have (docs/provisioning.md#an-external-nfs-server)",
        f"        # {first}:",
    ]
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
        gpus = int(_ask("GPUs per host (0: a CPU job)", "8" if host_list else "0", lambda s: s.isdigit()))
    gpus = gpus if gpus is not None else (8 if host_list else 0)
    if gpus < 0:
        raise UserError(f"must be 0 (a CPU job: gloo, no bf16) or a number of GPUs per host, got {gpus}",
                        key="--gpus")
    cpu = cpu or gpus == 0
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
    python = sys.executable  # this machine's interpreter (local jobs); servers run the image
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
    if a.local:
        print(f"next: ftbundle run {job} --dry-run")
    else:
        inventory = os.path.relpath(directory / "inventory.yml")
        print(f"next: fill in the lines marked FILL IN in {inventory} (docs/quickstart-servers.md), then\n"
              f"  {provision_command(inventory)}\n  ftbundle check {job}\n  ftbundle run {job}")
    return 0


def provision_command(inventory: str, cwd: Path | None = None) -> str:
    """The site.yml command for this inventory, as it runs from where the user is: the
    checkout's site.yml and its ansible.cfg (Ansible reads ansible.cfg from the working
    directory only: from elsewhere, every run warned of discovered interpreters and ran
    5 forks); relative paths when the user stands in the checkout."""
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "site.yml").is_file():  # not a checkout (a wheel): the docs' form
        return f"ansible-playbook site.yml -i {inventory}"
    here = (cwd or Path.cwd()).resolve()
    if here == checkout:
        return f"ansible-playbook site.yml -i {inventory}"
    cfg, site = checkout / "ansible.cfg", checkout / "site.yml"
    return f"ANSIBLE_CONFIG={shlex.quote(str(cfg))} ansible-playbook {shlex.quote(str(site))} -i {inventory}"
