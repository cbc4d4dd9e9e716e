"""Each rank's step times, for ftbundle's straggler detection (ftbundle/ui/stragglers.py).

Staged into the run directory as ``ftb_steptimes.py``. The LlamaFactory entry adds
:class:`StepTimes` to the trainer by itself; a script using the HF Trainer adds it with

    sys.path.insert(0, os.environ["FTB_RUN_DIR"]); from ftb_steptimes import StepTimes
    trainer.add_callback(StepTimes())

and a script with a training loop of its own calls ``clock = StepClock(); clock.watch(model)``
once (the model itself, not its DDP wrapper), ``clock.step_done()`` after each optimizer step
and ``clock.finish()`` once training ends. ``clock.step_done(tokens=N)``, N the tokens this rank
computed in that step (its batch's, padding left out if you want it left out), also gives the
run its tokens/s: every rank's count over its own clock from its first counted step on, summed
(the live line, the summary, summary.json and ``runs``; ftbundle/ui/progress.py).

What is timed: the rank's own compute of each optimizer step, from its model's forward pass to
the last gradient its backward pass computes (every micro-batch of the step, summed). In
synchronous data-parallel training the whole step takes as long on every rank (each waits for
the slowest at the gradients' all-reduce), so only this part tells a slow node from the others:
DDP's buffer broadcast comes before the model's own forward, and its gradient all-reduce runs
beside the backward (asynchronously) and is waited for after the last gradient. On a GPU the
same two moments are CUDA events, read once the GPU has passed them (no wait added). Under ZeRO-3
or FSDP the forward and backward gather parameters: a slow network then shows in it too.

Every second at most, the rank writes "LOCAL_RANK STEPS MEDIAN_S P90_S [TOKENS SECONDS]" to
``$FTB_STEPS_FILE.<LOCAL_RANK>`` (a local file the node program reads with each heartbeat and
forwards on its control channel); without FTB_STEPS_FILE (outside ftbundle) nothing is written.
No import of ftbundle: the ranks' interpreter may not have it.
"""

from __future__ import annotations

import os
import time

WRITE_EVERY_S = 1.0
KEEP = 2000  # the latest steps' times kept (the median and p90 are over these)


class StepClock:
    """The timing and the file, without the HF Trainer."""

    def __init__(self, path: str | None = None, local_rank: str | None = None):
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
        self._tokens_from: float | None = None  # when its first counted step ended
        self._tokens_at = 0.0  # when its latest one did

    # -- a micro-batch: its forward begins, its gradients come -------------------------------
    def begin(self, cuda: bool = False) -> None:
        """The model's forward pass begins (the previous micro-batch, if any, is over)."""
        self._close()
        if cuda:
            import torch

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
        model.register_forward_pre_hook(lambda *_: self.begin(cuda))
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _p: self.mark(cuda))

    # -- a step ----------------------------------------------------------------------------
    def step_begins(self) -> None:
        """A step begins: forward passes since the last one (an evaluation's) do not count."""
        self._step, self._began, self._marked = 0.0, None, None
        self._events.clear()

    def step_done(self, tokens: int | None = None) -> None:
        """The optimizer step ended: this step's compute joins the others (``tokens``: how many
        this rank computed in it, for the run's tokens/s)."""
        if tokens is not None:
            now = time.monotonic()
            if self._tokens_from is None:
                self._tokens_from = now
            else:
                self.tokens += int(tokens)
            self._tokens_at = now
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
        counted = "" if self._tokens_from is None else f" {self.tokens} {self._tokens_at - self._tokens_from:.6f}"
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


def StepTimes(clock: StepClock | None = None):  # (a class to its users: named like one)
    """The HF Trainer callback (made here: transformers is imported only when it is used)."""
    from transformers import TrainerCallback

    class _StepTimes(TrainerCallback):
        def __init__(self):
            self.clock = clock or StepClock()
            self._hooked = False

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None or self._hooked or self.clock.path is None:
                return
            self.clock.watch(model)  # (the trainer's own model, inside DDP's wrapper)
            self._hooked = True

        def on_step_begin(self, args, state, control, **kwargs):
            self.clock.step_begins()

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.step_done()

        def on_train_end(self, args, state, control, **kwargs):
            self.clock.finish()

    return _StepTimes()
