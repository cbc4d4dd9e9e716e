"""Each rank's step times, for ftbundle's straggler detection (ftbundle/ui/stragglers.py).

Staged into the run directory as ``ftb_steptimes.py``. The LlamaFactory entry adds
:class:`StepTimes` to the trainer by itself; a script using the HF Trainer adds it with

    sys.path.insert(0, os.environ["FTB_RUN_DIR"]); from ftb_steptimes import StepTimes
    trainer.add_callback(StepTimes())

(with ``include_num_input_tokens_seen`` on in its TrainingArguments, the trainer's token count
gives the run its tokens/s and, on GPUs, MFU: :func:`StepTimes`), and a script with a training loop of its own calls ``clock = StepClock(); clock.watch(model)``
once (the model itself, not its DDP wrapper), ``clock.step_done()`` after each optimizer step
and ``clock.finish()`` once training ends. ``clock.step_done(tokens=N)``, N the tokens this rank
computed in that step (its batch's, padding left out if you want it left out), also gives the
run its tokens/s: every rank's count over its own clock from its first counted step on, summed
(the live line, the summary, summary.json and ``runs``; ftbundle/ui/progress.py); on a GPU that
clock is the GPU's (an event at each counted step's end, read once passed: the host queues
kernels well ahead of them, and its own clock would count the queue). On GPUs it gives
MFU too: the model's parameters are counted when ``clock.watch(model)`` hooks it (ZeRO-3's
``ds_numel``, a 4-bit weight's unpacked shape; not a sharded FSDP1 flat parameter, which holds a
slice: pass ``StepClock(params=N)`` there), and 6 x them a token over the GPUs' peak is the MFU
(ftbundle/speed.py). A LlamaFactory job's parameters are counted from its model's files instead.
``clock.step_done(loss=L, grad_norm=G)`` has the step's loss (and gradient norm, if it has one)
judged as the callback judges the trainer's (:class:`LossWatch`, below).

What is timed: the rank's own compute of each optimizer step, from its model's forward pass to
the last gradient its backward pass computes (every micro-batch of the step, summed). In
synchronous data-parallel training the whole step takes as long on every rank (each waits for
the slowest at the gradients' all-reduce), so only this part tells a slow node from the others:
DDP's buffer broadcast comes before the model's own forward, and its gradient all-reduce runs
beside the backward (asynchronously) and is waited for after the last gradient. On a GPU the
same two moments are CUDA events, read once the GPU has passed them (no wait added). Under ZeRO-3
or FSDP the forward and backward gather parameters: a slow network then shows in it too.

Every second at most, the rank writes "LOCAL_RANK STEPS MEDIAN_S P90_S [TOKENS SECONDS [PARAMS]]" to
``$FTB_STEPS_FILE.<LOCAL_RANK>`` (a local file the node program reads with each heartbeat and
forwards on its control channel); without FTB_STEPS_FILE (outside ftbundle) nothing is written.
The same callback watches the trainer's logged loss and gradient norm (:class:`LossWatch`): a
run whose weights are no longer numbers (the loss nan, or logged as 0.0 beside a nan gradient
norm: the HF Trainer's ``logging_nan_inf_filter`` stands in for a nan loss), or that stopped
learning (a gradient norm of exactly 0 and the same loss for every batch: a collapsed model),
in DIVERGED_RECORDS logged steps in a row, is stopped (``divergence: stop``, the default: every
rank raises :class:`TrainingDiverged` at the same logged step, as they all log the same reduced
figures) or named once on rank 0's stderr (``divergence: warn``, as FTB_DIVERGENCE says).
Global rank 0 writes the verdict to ``$FTB_DIVERGED_FILE`` (the run directory's diverged.aN,
JSON) first: the launcher reads it to say so and not to restart a run that would only diverge again.

No import of ftbundle: the ranks' interpreter may not have it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

WRITE_EVERY_S = 1.0
KEEP = 2000  # the latest steps' times kept (the median and p90 are over these)
# logged steps in a row that must show it before a run is called diverged or collapsed: one such
# record can be a single bad batch; a model whose weights are nan, or whose gradient is 0 for
# every batch, logs it at every step from then on
DIVERGED_RECORDS = 3
# ... and for a finite loss beside a gradient norm that is not: an fp16 loss scaler halves its
# scale at each overflowing step and skips it (a dozen in a row at a healthy start); after 50 in a
# row its scale is 2^16 x 2^-50 and no step since has moved the weights (HF's GradScaler: it never
# stops by itself; DeepSpeed's stops at its minimum scale)
SKIPPED_RECORDS = 50
FLAT_LOSS = 1e-4  # relative: "the same loss" of a collapsed model (every batch alike, to float noise)


class TrainingDiverged(RuntimeError):
    """Raised on every rank when the run diverged and ``divergence: stop`` (the default)."""


def _number(value) -> float | None:
    """A logged figure as a float (transformers 5 may log strings: '0.2333', 'nan'); None if none."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class LossWatch:
    """The trainer's logged (step, loss, grad norm), judged. Pure.

    * "nan": the loss is not finite, or it is exactly 0.0 while the gradient norm is not finite
      (the HF Trainer's logging_nan_inf_filter logs a window of nan losses as 0.0).
    * "skipped": a finite loss beside a gradient norm that is not finite. An fp16 loss scaler's
      overflowing steps (skipped, and the scale lowered) log just that while training is healthy,
      a dozen in a row at its start: named only after SKIPPED_RECORDS in a row.
    * "flat": the gradient norm is exactly 0 and the loss the same as the record before it: no
      batch moves the weights and every batch gets the same loss (a collapsed model: the loss of
      predicting every token alike). A gradient norm logged as 0 beside a loss that moves (a
      ZeRO stage that does not report it) is not this, nor a loss of exactly 0 with no gradient
      (nothing to learn from those batches: a GRPO group whose completions all scored alike).
    A verdict comes once, after DIVERGED_RECORDS such records in a row (SKIPPED_RECORDS for "skipped")."""

    def __init__(self):
        self.kind: str | None = None
        self.since: int | None = None
        self.count = 0
        self.loss: float | None = None  # the record before this one's
        self.grad: float | None = None
        self.step: int | None = None
        self.good: int | None = None  # the step of the last record before this kind began
        self.said = False

    def feed(self, step: int, logs: dict, vocab: int | None = None) -> str | None:
        """One logged record (the Trainer's ``logs``); what to say once it has diverged, else None."""
        if "loss" not in logs or self.said:
            return None
        loss, grad = _number(logs.get("loss")), _number(logs.get("grad_norm"))
        if loss is None:
            return None
        kind = None
        if not math.isfinite(loss) or (loss == 0.0 and grad is not None and not math.isfinite(grad)):
            kind = "nan"
        elif grad is not None and not math.isfinite(grad):
            kind = "skipped"
        elif (grad == 0.0 and loss != 0.0 and self.loss is not None and math.isfinite(self.loss)
              and abs(loss - self.loss) <= FLAT_LOSS * max(1.0, abs(loss))):
            kind = "flat"
        if kind is None or kind != self.kind:
            self.kind, self.since, self.count = kind, (step if kind else None), (1 if kind else 0)
            self.good = self.step  # (the last record that was not this: its step)
            if kind == "flat" and self.grad == 0.0:  # (the record before had no gradient and this loss: it began there)
                self.since, self.count, self.good = self.step, 2, None
        else:
            self.count += 1
        self.loss, self.grad, self.step = loss, grad, step
        if self.kind is None or self.count < (SKIPPED_RECORDS if self.kind == "skipped" else DIVERGED_RECORDS):
            return None
        self.said = True
        return self.verdict(step, loss, grad, logs.get("learning_rate"), vocab)

    def verdict(self, step: int, loss: float, grad: float | None, lr, vocab: int | None) -> str:
        lr = _number(lr)
        rate = f" (learning rate {lr:.3g})" if lr is not None else ""
        if self.kind == "nan":
            shown = "nan" if math.isnan(loss) else f"{loss}" if not math.isfinite(loss) else \
                "logged as 0.0 (the trainer's stand-in for a nan loss: logging_nan_inf_filter)"
            norm = f" and the gradient norm {grad}" if grad is not None else ""
            good = (f"; its last good checkpoint is one saved at or before step {self.good} (the last step logged "
                    "before it)") if self.good is not None else ""
            return (f"training diverged at step {step}: in {self.count} logged steps in a row since step {self.since} "
                    f"the loss is {shown}{norm}: the weights are no longer numbers{rate}{good}")
        if self.kind == "skipped":
            return (f"training skips every step at step {step}: in {self.count} logged steps in a row since step "
                    f"{self.since} the gradient norm is {grad} beside a loss of {loss:.4f}: each step's gradients "
                    f"overflow, an fp16 loss scaler skips the step and lowers its scale, and no step since has moved "
                    f"the weights{rate}; bf16, or a lower learning rate")
        uniform = ""
        if vocab and abs(loss - math.log(vocab)) <= 1e-3 * math.log(vocab):
            uniform = f" = ln {vocab}, the same odds for every token of its vocabulary"
        return (f"training stopped learning at step {step}: in {self.count} logged steps in a row since step "
                f"{self.since} the gradient norm is 0 and the loss stays at {loss:.4f}{uniform}: no batch moves "
                f"the weights (the model collapsed){rate}")


class StepClock:
    """The timing and the file, without the HF Trainer."""

    def __init__(self, path: str | None = None, local_rank: str | None = None, params: int | None = None):
        base = path if path is not None else os.environ.get("FTB_STEPS_FILE")
        self.local_rank = local_rank if local_rank is not None else os.environ.get("LOCAL_RANK", "0")
        self.path = f"{base}.{self.local_rank}" if base else None
        self.times: list[float] = []
        self._step = 0.0  # this step's compute so far (seconds)
        self._began = None  # the micro-batch's start: perf_counter(), or CUDA (start, end) events
        self._marked = None  # its last gradient's moment (CUDA: True, the end event holds it)
        self._events: list = []  # CUDA (start, end) event pairs of this step, read later
        self._waiting: list[list] = []  # CUDA: steps' event pairs the GPU has not passed yet
        self._written = 0.0
        self.tokens = 0  # counted since its first counted step (whose own tokens came before the clock)
        self._tokens_from = None  # when its first counted step ended: monotonic(), or its CUDA event
        self._tokens_s = 0.0  # from then to the latest counted step's end
        self._cuda = False  # the watched model is on a GPU: the tokens' clock is the GPU's (events)
        self._token_events: list = []  # CUDA: (tokens, end event) of counted steps the GPU has not passed
        self.losses = LossWatch()  # (step_done(loss=...): a nan or collapsed run, as the callback judges it)
        self.steps = 0
        self.params = params  # the model's parameters (MFU): given, or counted by watch()

    # -- a micro-batch: its forward begins, its gradients come -------------------------------
    def begin(self, cuda: bool = False) -> None:
        """The model's forward pass begins (the previous micro-batch, if any, is over)."""
        self._close()
        if cuda:
            import torch

            self._cuda = True  # (a script timing its own micro-batches on the GPU: the tokens' clock too)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._began = (start, stop)
        else:
            self._began = time.perf_counter()
        self._marked = None

    def mark(self, cuda: bool = False) -> None:
        """A gradient was computed: the micro-batch's compute lasts at least until now."""
        if self._began is None:
            return
        if cuda:
            self._began[1].record()  # (re-recorded: the last gradient's moment wins)
            self._marked = True
        else:
            self._marked = time.perf_counter()

    def _close(self) -> None:
        if self._began is not None and self._marked is not None:
            if isinstance(self._began, tuple):
                self._events.append(self._began)
            else:
                self._step += self._marked - self._began
        self._began = self._marked = None  # (a forward without gradients, an evaluation's: not counted)

    def watch(self, model) -> None:
        """Time ``model``'s micro-batches: a hook on its forward, one on each trained parameter."""
        cuda = next((p.is_cuda for p in model.parameters()), False)
        self._cuda = bool(cuda)
        if self.params is None:
            self.params = count_params(model)
        model.register_forward_pre_hook(lambda *_: self.begin(cuda))
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _p: self.mark(cuda))

    # -- a step ----------------------------------------------------------------------------
    def step_begins(self) -> None:
        """A step begins: forward passes since the last one (an evaluation's) do not count."""
        self._step, self._began, self._marked = 0.0, None, None
        self._events.clear()

    def step_done(self, tokens: int | None = None, loss: float | None = None,
                  grad_norm: float | None = None) -> None:
        """The optimizer step ended: this step's compute joins the others (``tokens``: how many
        this rank computed in it, for the run's tokens/s; ``loss`` and ``grad_norm``: the step's,
        as every rank has them after the all-reduce, for :class:`LossWatch`: a nan or collapsed
        run raises :class:`TrainingDiverged` here, as the HF callback does)."""
        self.steps += 1
        if loss is not None:
            said = self.losses.feed(self.steps, {"loss": float(loss),
                                                 **({"grad_norm": float(grad_norm)} if grad_norm is not None else {})})
            if said is not None:
                diverged(said, self.steps, self.losses)
        if tokens is not None and self._cuda:  # (the host runs ahead of the GPU: its clock would
            import torch  # count the kernels queued, not those run; an event marks the step's end)

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._token_events.append((int(tokens), event))
        elif tokens is not None:
            self._count_tokens(int(tokens), time.monotonic())
        self._read_tokens()
        self._close()
        if self._events:  # CUDA: read once the GPU has passed them, a step or two later (no wait)
            self._waiting.append(self._events)
            self._events = []
        self._read_passed()
        if self._step > 0:
            self.times.append(self._step)
        del self.times[:-KEEP]
        self._step = 0.0
        now = time.monotonic()
        if now - self._written >= WRITE_EVERY_S:
            self.write()
            self._written = now

    def _count_tokens(self, tokens: int, end) -> None:
        """A counted step ended at ``end`` (monotonic seconds, or its CUDA event): the first one
        starts the clock (its tokens came before it), the others are counted."""
        if self._tokens_from is None:
            self._tokens_from = end
            return
        self.tokens += tokens
        if isinstance(end, float):
            self._tokens_s = end - self._tokens_from
        else:
            self._tokens_s = self._tokens_from.elapsed_time(end) / 1000

    def _read_tokens(self, wait: bool = False) -> None:
        """CUDA: the counted steps the GPU has passed (``wait``: all, waiting for them)."""
        while self._token_events and (wait or self._token_events[0][1].query()):
            tokens, event = self._token_events.pop(0)
            if wait:
                event.synchronize()
            self._count_tokens(tokens, event)

    def _read_passed(self, wait: bool = False) -> None:
        """CUDA: the waiting steps' times, those the GPU has passed (``wait``: all, waiting for them)."""
        while self._waiting and (wait or all(stop.query() for _, stop in self._waiting[0])):
            pairs = self._waiting.pop(0)
            if wait:
                pairs[-1][1].synchronize()
            self.times.append(sum(start.elapsed_time(stop) for start, stop in pairs) / 1000)

    def finish(self) -> None:
        """Training ended: the steps still on the GPU are waited for (once, at the end), then written."""
        self._read_passed(wait=True)
        self._read_tokens(wait=True)
        del self.times[:-KEEP]
        self.write()

    def line(self) -> str | None:
        if not self.times:
            return None
        ordered = sorted(self.times)
        n = len(ordered)
        mid = n // 2
        median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        p90 = ordered[max(0, -(-9 * n // 10) - 1)]
        counted = "" if self._tokens_from is None else f" {self.tokens} {self._tokens_s:.6f}"
        if counted and self.params:
            counted += f" {int(self.params)}"
        return f"{self.local_rank} {n} {median:.6f} {p90:.6f}{counted}"

    def write(self) -> None:
        line = self.line()
        if self.path is None or line is None:
            return
        try:  # whole or not at all: the node program may read it at any moment
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path + ".tmp", "w") as f:
                f.write(line + "\n")
            os.replace(self.path + ".tmp", self.path)
        except OSError:
            pass


def count_params(model) -> int | None:
    """The model's parameters, each counted whole: ZeRO-3's partitioned ones by ``ds_numel``, a
    bitsandbytes 4-bit one by the shape it was quantized from (its data is packed), FSDP2's
    DTensors by their global shape (``numel``). None where a parameter holds only this rank's
    slice of others (FSDP1's flat parameters): MFU is then unknown rather than wrong."""
    total = 0
    for param in model.parameters():
        if getattr(param, "_is_flat_param", False) or type(param).__name__ == "FlatParameter":
            return None
        whole = getattr(param, "ds_numel", None)
        shape = getattr(getattr(param, "quant_state", None), "shape", None)
        if whole is None and shape is not None:
            whole = math.prod(int(d) for d in shape)
        total += int(whole) if whole is not None else param.numel()
    return total or None


def StepTimes(clock: StepClock | None = None, tokens: bool = True):  # (a class to its users: named like one)
    """The HF Trainer callback (made here: transformers is imported only when it is used). With
    ``include_num_input_tokens_seen`` on in the script's TrainingArguments, the trainer's own count
    (every rank's, gathered) gives the run its tokens/s and, on GPUs, MFU: each rank reports its
    share of each step's tokens. ``tokens=False``: not (LlamaFactory's entry: the launcher reads
    that count from the trainer's log instead)."""
    from transformers import TrainerCallback

    class _StepTimes(TrainerCallback):
        def __init__(self):
            self.clock = clock or StepClock()
            self.losses = LossWatch()
            self._hooked = False
            self._seen = 0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None or self._hooked or self.clock.path is None:
                return
            self.clock.watch(model)  # (the trainer's own model, inside DDP's wrapper)
            self._hooked = True

        def on_step_begin(self, args, state, control, **kwargs):
            self.clock.step_begins()

        def on_step_end(self, args, state, control, **kwargs):
            seen = getattr(state, "num_input_tokens_seen", 0) if tokens else 0
            if not isinstance(seen, (int, float)) or isinstance(seen, bool) or seen <= 0:
                self.clock.step_done()
                return
            # (the trainer's count is the whole run's, every rank's gathered: this rank's share of
            # the step's; the launcher sums the ranks' rates)
            share = (seen - self._seen) / max(1, int(getattr(args, "world_size", 1) or 1))
            self._seen = seen
            self.clock.step_done(tokens=round(share))

        def on_train_end(self, args, state, control, **kwargs):
            self.clock.finish()

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            said = self.losses.feed(state.global_step, logs or {}, _vocab(model))
            if said is not None:
                diverged(said, state.global_step, self.losses)

    return _StepTimes()


def _vocab(model) -> int | None:
    try:
        vocab = model.config.vocab_size
    except AttributeError:
        return None
    return vocab if isinstance(vocab, int) and vocab > 1 else None


def diverged(said: str, step: int, watch: LossWatch, mode: str | None = None) -> None:
    """A verdict of :class:`LossWatch`: kept in the run directory by global rank 0, then the
    run stopped (every rank raises) or, ``warn``, said once on rank 0's stderr."""
    path = os.environ.get("FTB_DIVERGED_FILE")  # (the run directory's diverged.aN: ftbundle/rundir.py)
    mode = mode or os.environ.get("FTB_DIVERGENCE") or ("stop" if os.environ.get("FTB_RUN_DIR") else "warn")
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0 and path:
        record = {"step": step, "since": watch.since, "kind": watch.kind, "action": mode, "said": said}
        try:  # whole or not at all (the launcher may read it at any moment)
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass
    if mode == "stop":
        if rank0:
            print(f"ftbundle: {said}: stopping the run (divergence: stop)", file=sys.stderr, flush=True)
        raise TrainingDiverged(said)
    if rank0:
        print(f"ftbundle: warning: {said} (divergence: warn: the run goes on)", file=sys.stderr, flush=True)
