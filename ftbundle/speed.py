"""Is it fast? Tokens per second, per GPU (per rank on CPUs), and MFU, in the units users
compare (issue 47 item 1). Pure.

- **Tokens**: the trainer's own count (transformers' ``include_num_input_tokens_seen``, which
  ftbundle turns on in the staged LlamaFactory config unless the job set it: ``non_padding``
  where the hosts' transformers has it, 4.57 and later, else every token, padding included,
  and said so). LlamaFactory's trainer_log.jsonl carries it as ``total_tokens``.
- **MFU**: model FLOPs per token x tokens/s / the GPUs' dense bf16 peak. Model FLOPs per
  token: 6 x the parameters (forward 2, backward 4: the PaLM paper's count, which torchtitan
  and LLM Foundry print), the parameters counted from the model's safetensors headers by the
  check (rank 0's probe); attention's own FLOPs (12 x layers x hidden x sequence) are left
  out, and with LoRA the frozen weights' gradients are not computed, so the count is the
  usual convention, not the work done: said in the basis. The peak of the GPU the job uses,
  from :data:`PEAK_BF16_TFLOPS`; a GPU not there: the median bf16 GEMM measured on the run's
  GPUs, each by its last burn-in (``ftbundle check --burn-in``, kept in ``<shared_dir>/checks/gemm.json``
  and read by rank 0's probe), said as such; with neither, MFU unknown, said. A fleet of mixed
  GPUs: the sum of the peaks of the GPUs its ranks run on (a rank a GPU), said GPU by GPU.
"""

from __future__ import annotations

import collections
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace

from .units import release

# Dense bf16 tensor-core peak, TFLOP/s per GPU (the vendors' data sheets; "with sparsity"
# figures are twice these). Matched against nvidia-smi's name, first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"GB200", "GB200", 2500.0),
    (r"B200", "B200", 2250.0),
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H800.*PCIe", "H800 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H200.*NVL", "H200 NVL", 835.0),
    (r"H100|H800|GH200", "H100 SXM", 989.0),
    (r"H200", "H200", 989.0),
    (r"\bH20\b", "H20", 148.0),
    (r"A100|A800", "A100", 312.0),
    (r"L40S", "L40S", 362.0),
    (r"L40\b", "L40", 181.0),
    (r"\bL20\b", "L20", 119.5),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA40\b", "A40", 149.7),
    (r"\bA10\b", "A10", 125.0),
    (r"RTX 6000 Ada", "RTX 6000 Ada", 364.2),
    (r"RTX A6000", "RTX A6000", 154.8),
    (r"RTX 4090", "RTX 4090", 165.0),
    (r"RTX 3090", "RTX 3090", 71.0),
)
NON_PADDING_SINCE = (4, 57)  # transformers: include_num_input_tokens_seen "non_padding" (PR 40416)


def gpu_peak(name: str) -> tuple[str, float] | None:
    """(the GPU as the table names it, its dense bf16 TFLOP/s), or None when not in the table."""
    for pattern, label, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return label, tflops
    return None


def token_setting(asked: object, transformers: str | None) -> tuple[object, bool | None]:
    """(the value of include_num_input_tokens_seen to stage, whether the count includes padding;
    None: no count). ``asked``: the job's own value (None: not set), kept as it is."""
    if asked is not None:
        value = str(asked).lower()
        if value in ("no", "false", "0"):
            return asked, None
        return asked, value != "non_padding"
    if release(transformers)[:2] >= NON_PADDING_SINCE:
        return "non_padding", False
    return True, True


@dataclass(frozen=True)
class SpeedBasis:
    """What the run's figures are counted against: its ranks, its GPUs' peak, the model."""

    ranks: int
    gpus: int = 0  # GPUs the job's ranks use (0: a CPU job)
    gpu: str | None = None  # the table's name for them
    peak_tflops: float | None = None  # per GPU
    params: int | None = None  # the model's parameters
    padding: bool | None = None  # whether the token count includes padding (None: no count)
    peak_from: str | None = None  # the peak is a burn-in's measured bf16 GEMM: which, on how many GPUs
    no_peak: str | None = None  # why no measured peak could be read either (the burn-in's record unreadable)
    mix: str | None = None  # a fleet of mixed GPUs: how many of each at which peak (peak_tflops: their mean)
    # a script's parameters, counted by its ranks' StepClock while it runs: said so; or, with no
    # params, why they are not known (its ranks counted different figures: a model split across them)
    params_from: str | None = None

    @property
    def flops_per_token(self) -> float | None:
        return 6.0 * self.params if self.params else None

    @property
    def mfu_per_token_s(self) -> float | None:
        """MFU per token a second: the model's FLOPs a token over the GPUs' peak (None: not known)."""
        if not self.gpus or not self.peak_tflops or not self.flops_per_token:
            return None
        return self.flops_per_token / (self.gpus * self.peak_tflops * 1e12)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        per = self.mfu_per_token_s
        return per * tokens_per_s if tokens_per_s and per else None

    @classmethod
    def from_record(cls, record) -> SpeedBasis | None:
        """The basis plan.json keeps (``record``), None when it holds none or not one."""
        if not isinstance(record, dict):
            return None
        def of(name, kind):
            value = record.get(name)
            if kind is bool:
                return value if isinstance(value, bool) else None
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        ranks, gpus = of("ranks", int), of("gpus", int) or 0
        if not ranks:
            return None
        return cls(ranks=ranks, gpus=gpus, gpu=of("gpu", str), peak_tflops=of("peak_tflops", (int, float)),
                   params=of("params", int), padding=of("padding", bool), peak_from=of("peak_from", str),
                   no_peak=of("no_peak", str), mix=of("mix", str), params_from=of("params_from", str))

    def record(self) -> dict:
        """plan.json's "speed": what a run without summary.json is counted against (`runs`), and
        its detached watchers' told figures (remote/trainer_end.py speed_figures)."""
        return {**asdict(self), "mfu_per_token_s": self.mfu_per_token_s}

    def per_unit(self) -> str:
        return "per GPU" if self.gpus else "per rank"

    def mfu_basis(self) -> str:
        if not self.gpus:
            return "no GPUs: no MFU"
        if not self.params:
            if self.params_from:
                return f"MFU unknown: {self.params_from}"
            return ("MFU unknown: the model's parameters were not counted (a hub id, not safetensors, or a script's "
                    "model its StepClock did not watch)")
        if not self.peak_tflops:
            return (f"MFU unknown: no dense bf16 peak known for {self.gpu or 'these GPUs'} and no burn-in measured "
                    "them (`ftbundle check --burn-in JOB` does: runs after it count MFU against its bf16 GEMM)"
                    + (f"; {self.no_peak}" if self.no_peak else ""))
        over = (f"{self.mix} dense bf16 (their sum; a GPU's mean {self.peak_tflops:g})" if self.mix
                else f"{self.gpus} x {self.gpu} at {self.peak_tflops:g} TFLOP/s")
        if self.peak_from:
            over += f", {self.peak_from}"
        elif not self.mix:
            over += " dense bf16"
        counted = f", {self.params_from}" if self.params_from else ""
        return (f"6 x {_count(self.params)} parameters per token{counted} (attention's own FLOPs not counted; with "
                f"LoRA the frozen weights' gradients are not computed either) over {over}")


def basis_of(facts, ranks: int, padding: bool | None, uses_gpus: bool, nprocs: dict[str, int] | None = None,
             env: dict[str, str] | None = None) -> SpeedBasis:
    """The run's SpeedBasis from the hosts' facts (ftbundle.facts.ClusterFacts, or None):
    ``nprocs``, each host's ranks (default: ``ranks`` spread evenly over the hosts with GPUs),
    each on one of the GPUs the job's ``env`` lets it see there. On a fleet of mixed GPUs
    the peak is their mean, each rank's GPU counted: MFU against the sum of their peaks."""
    params = None
    if facts is not None:
        model = next((f.model for f in facts.hosts if getattr(f, "model", None)), None)
        params = int(model["params"]) if model and model.get("params") else None
    used = _used_gpus(facts, ranks, nprocs, env or {}) if facts is not None and uses_gpus else []
    if not used:
        return SpeedBasis(ranks=ranks, params=params, padding=padding)
    record = next((f.gemm for f in facts.hosts if getattr(f, "gemm", None)), None)
    peaks: dict[str, tuple[str, float | None]] = {}  # a GPU's name -> (the table's name for it, its peak)
    measured_from: list[str] = []
    no_peak = None
    for name in dict.fromkeys(g.name for g in used):
        found = gpu_peak(name)
        if found is None:
            measured = measured_peak(record, [g.uuid for g in used if g.name == name])
            if isinstance(measured, tuple):
                found = (name, measured[0])
                measured_from.append(f"{measured[1]} ({name} has no data-sheet peak in ftbundle's table)")
            else:
                no_peak = no_peak or measured
        peaks[name] = found or (name, None)
    missing = [label for label, peak in peaks.values() if peak is None]
    labels = list(dict.fromkeys(label for label, _ in peaks.values()))
    if missing:  # (one GPU of unknown peak: the whole fleet's MFU is unknown, that GPU named)
        return SpeedBasis(ranks=ranks, gpus=ranks, gpu=", ".join(missing), params=params, padding=padding,
                          no_peak=no_peak)
    total = sum(peaks[g.name][1] for g in used)
    mix = None
    if len(labels) > 1:
        at = dict(peaks.values())  # the table's name -> its peak
        counted = collections.Counter(peaks[g.name][0] for g in used)
        mix = " + ".join(f"{n} x {label} at {at[label]:g}" for label, n in counted.items()) + " TFLOP/s"
    return SpeedBasis(ranks=ranks, gpus=ranks, gpu=", ".join(labels), peak_tflops=total / len(used),
                      params=params, padding=padding, peak_from="; ".join(measured_from) or None, mix=mix)


def _used_gpus(facts, ranks: int, nprocs: dict[str, int] | None, env: dict[str, str]) -> list:
    """The GPUs the ranks run on, a rank each: on each host the first of those the job sees."""
    hosts = [f for f in facts.reached if f.gpus]
    if not hosts or ranks <= 0:
        return []
    if nprocs is None:
        share, extra = divmod(ranks, len(hosts))
        nprocs = {f.host: share + (1 if i < extra else 0) for i, f in enumerate(hosts)}
    used = []
    for f in hosts:
        seen = f.visible_gpus(env) or f.gpus
        used += seen[:nprocs.get(f.host, 0)]
    return used


def measured_peak(record: dict | None, uuids: list[str | None]) -> tuple[float, str] | str | None:
    """The median bf16 GEMM the burn-ins measured on these GPUs (``uuids``: the run's GPUs of
    one kind), from their record (check/burnin.py ``gemm_record``, read by rank 0's probe: each
    GPU with the burn-in that measured it last), and the words that say so; a string: why it
    could not be read; None: no record, or none of them in it."""
    if not record:
        return None
    if record.get("error"):
        return f"the burn-in's record could not be read: {record['error']}"
    gpus = record.get("gpus") if isinstance(record.get("gpus"), dict) else {}
    found = [gpus[u] for u in uuids if u and isinstance(gpus.get(u), dict)
             and isinstance(gpus[u].get("tflops"), (int, float)) and gpus[u]["tflops"] > 0]
    if not found:
        return None
    by = collections.Counter((g.get("check", record.get("check")), g.get("at", record.get("at"))) for g in found)
    if len(by) == 1:
        ((check, at),) = by
        said = f"the burn-in {check or '?'} measured{_on_day(at)}"
    else:  # (burn-ins of parts of the fleet: each named, newest first, with how many GPUs it measured)
        newest = sorted(by, key=lambda k: k[1] if isinstance(k[1], (int, float)) else 0, reverse=True)
        said = "the burn-ins " + ", ".join(f"{check or '?'}{_on_day(at)} ({by[check, at]})"
                                           for check, at in newest) + " measured"
    return (round(statistics.median(g["tflops"] for g in found), 1),
            f"the median bf16 GEMM {said} on {len(found)} of these {len(uuids)} GPUs")


def _on_day(at) -> str:
    return time.strftime(" on %Y-%m-%d", time.gmtime(at)) if isinstance(at, (int, float)) else ""


def _count(params: int) -> str:
    """8030261248 -> 8.03B, 124439808 -> 124.4M, 2344 -> 2,344."""
    if params >= 10**9:
        return f"{params / 1e9:.2f}B"
    return f"{params / 1e6:.1f}M" if params >= 10**6 else f"{params:,}"


SCRIPT_COUNTED = "counted by the script's StepClock on its model"


def script_params(basis: SpeedBasis | None, counted: dict) -> SpeedBasis | None:
    """``basis`` with the parameters a script's ranks counted (``counted``: {(host, local rank):
    parameters}, StepClock.watch), where the plan counted none (a LlamaFactory job's come from its
    model's files and stay). Ranks that counted different figures hold different parts of the
    model (tensor or pipeline parallel, by hand): MFU unknown, said, rather than a slice's."""
    if basis is None or not basis.gpus or not counted or (basis.params and basis.params_from != SCRIPT_COUNTED):
        return basis
    figures = sorted(set(counted.values()))
    if len(figures) == 1:
        return replace(basis, params=figures[0], params_from=SCRIPT_COUNTED)
    said = ", ".join(f"{n:,}" for n in figures[:3]) + (" ..." if len(figures) > 3 else "")
    return replace(basis, params=None, params_from=(
        f"the script's ranks counted different parameters ({said}): a model split across them; give "
        "StepClock(params=N), the whole model's, on every rank"))


def tokens_text(tokens_per_s: float, basis: SpeedBasis) -> str:
    """`1,234 tokens/s (617 per rank, padding not counted)`."""
    per = tokens_per_s / basis.ranks if basis.ranks else None
    pad = ("padding not counted" if basis.padding is False else "padding counted" if basis.padding else "")
    inner = ", ".join(x for x in ((f"{per:,.0f} {basis.per_unit()}" if per is not None else ""), pad) if x)
    return f"{tokens_per_s:,.0f} tokens/s" + (f" ({inner})" if inner else "")
