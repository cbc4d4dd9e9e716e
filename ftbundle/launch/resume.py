"""What a LlamaFactory run starts from: output_dir's newest complete checkpoint-N, read on
rank 0's host before launch (and before each restart).

LlamaFactory resumes from that checkpoint by itself (overwrite_output_dir false); ftbundle
says so first ("resuming from checkpoint-40 of 60 in DIR, written by run R"), counts this
attempt's progress from there, and refuses to start a training that is already finished
(exit 2: a fresh output_dir, or ``overwrite_output_dir: true``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..cluster import Cluster
from ..errors import UserError
from ..plan import Plan
from .node import node_argv

# The newest checkpoint's trainer_state.json and the final one (LlamaFactory saves it in
# output_dir at the end of training), separated by a line no JSON holds.
_SEPARATOR = "\x1eftbundle-final\x1e"
_READ_STATES = r'''dir=$1 last=$2
if [ -n "$last" ]; then cat -- "$dir/$last/trainer_state.json" 2>/dev/null; fi
printf '\n%s\n' "$3"
cat -- "$dir/trainer_state.json" 2>/dev/null
true'''


@dataclass(frozen=True)
class ResumeState:
    """Where training stands in output_dir."""

    output_dir: str
    checkpoint: str | None = None  # the newest complete checkpoint-N, None: starting afresh
    step: int = 0  # the step the next attempt starts from (the checkpoint's global_step)
    total: int | None = None  # max_steps, as the checkpoint recorded it
    finished: bool = False  # a final trainer_state.json at its max_steps: nothing left to train
    final_step: int | None = None
    written_by: str | None = None  # the run that wrote it (from the run directories), if known
    tracker_runs: dict | None = None  # the MLflow and W&B runs that run logged to (its trackers.json)
    cleaned: tuple[str, ...] = ()  # what was removed (an incomplete newest checkpoint)

    def announcement(self) -> str | None:
        if self.checkpoint is None:
            return None
        of = f" of {self.total}" if self.total else ""
        by = f" (written by run {self.written_by})" if self.written_by else ""
        return f"resuming from {self.checkpoint}{of} in {self.output_dir}{by}: step {self.step} onwards"


def _state(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_states(output_dir: str, last: str | None, text: str, cleaned: tuple[str, ...] = (),
                 written_by: str | None = None) -> ResumeState:
    """The state from the two trainer_state.json texts (newest checkpoint, final). Pure."""
    ckpt_text, _, final_text = text.partition(_SEPARATOR)
    ckpt, final = _state(ckpt_text.strip()), _state(final_text.strip())
    step = int(ckpt.get("global_step") or 0) if last else 0
    total = int(ckpt.get("max_steps") or 0) or None
    final_step = int(final.get("global_step") or 0) if final else None
    final_total = int(final.get("max_steps") or 0) or None if final else None
    finished = bool(final) and final_step is not None and final_total is not None and final_step >= final_total
    if last and total is not None and step >= total:
        finished = True  # the last checkpoint is the last step: the run stopped before saving its end
    return ResumeState(output_dir=output_dir, checkpoint=last, step=step, total=total or final_total,
                       finished=finished, final_step=final_step if final else (step if finished else None),
                       written_by=written_by, cleaned=cleaned)


def read_resume_state(plan: Plan, cluster: Cluster, *, writer: bool = True, look: bool = False) -> ResumeState | None:
    """Rank 0's host's view of output_dir (an incomplete newest checkpoint is removed first,
    as for restarts; with ``look``, the check's, nothing is removed and ``cleaned`` says what a
    run would remove); None when the job does not resume by itself (not LlamaFactory, or
    overwrite_output_dir / resume_from_checkpoint in its config)."""
    if not plan.resumes or not plan.checkpoint_dir:
        return None
    host = plan.nodes[0].host
    result = cluster.run(host, node_argv("resume-point", plan.checkpoint_dir, *(["look"] if look else [])),
                         timeout=30)
    last = (result.stdout.strip().splitlines()[-1:] or [None])[0]
    cleaned = tuple(line for line in result.stderr.splitlines() if line.strip())
    states = cluster.run(host, ["bash", "-c", _READ_STATES, "ftb", plan.checkpoint_dir, last or "", _SEPARATOR],
                         timeout=30)
    state = parse_states(plan.checkpoint_dir, last, states.stdout, cleaned)
    if writer and (state.checkpoint or state.finished):
        by = _writer(plan, cluster)
        state = ResumeState(**{**state.__dict__, "written_by": by and by.run_id,
                               "tracker_runs": by and by.tracker_runs})
    return state


def _writer(plan: Plan, cluster: Cluster):
    """The newest earlier run of this job that trained into the same output_dir (its row)."""
    from ..history import list_runs

    try:
        rows = list_runs(plan.job_name, plan.shared_dir, cluster, plan.nodes[0].host)
    except Exception:  # noqa: BLE001 - only a detail of a message: never stop a launch over it
        return None
    mine = [r for r in rows if r.output_dir == plan.checkpoint_dir and r.run_id != plan.run_id]
    return mine[-1] if mine else None


def finished_words(state: ResumeState) -> str:
    """`output_dir X holds a finished training (step N of T), written by run R`."""
    by = f", written by run {state.written_by}" if state.written_by else ""
    at = f" (step {state.final_step} of {state.total})" if state.final_step is not None and state.total else ""
    return f"output_dir {state.output_dir} holds a finished training{at}{by}"


FRESH_OR_OVERWRITE = ("give the LlamaFactory config a fresh output_dir, or set 'overwrite_output_dir: true' "
                      "in it to train again from the start over the old results")


def refuse_finished(state: ResumeState, job_path: str) -> None:
    """A finished training is not trained again silently: exit 2 with the ways forward."""
    raise UserError(f"{finished_words(state)}; nothing is left to train and nothing was started. Either "
                    f"{FRESH_OR_OVERWRITE}", file=job_path, key="train.llamafactory output_dir")


def checkpoint_status(output_dir: str, checkpoint: str | None, saved_ago_s: float | None, step: int | None,
                      *, running: bool, resumes: bool | None) -> str:
    """`ftbundle status`'s line on what the run has saved (pure): the newest complete checkpoint,
    how long ago it was written and how far the trainer has gone since; while the run goes, what a
    failure now would cost (a restart resumes there: the steps since are trained again)."""
    from ..ui.progress import clock

    now = f"; the trainer is at step {step}" if step is not None else ""
    if checkpoint is None:
        head = f"checkpoint: none yet in {output_dir}{now}"
        lose = "starts again from step 0"
    else:
        saved = step_of(checkpoint)
        ago = f", written {clock(saved_ago_s)} ago" if saved_ago_s is not None else ""
        head = f"checkpoint: {checkpoint} in {output_dir}{ago}{now}"
        since = step - saved if step is not None and saved is not None and step >= saved else None
        lose = f"resumes from step {saved}" + (f" ({since} step{'s' if since != 1 else ''} trained again)"
                                                if since else "")
    if not running or resumes is None:
        return head
    if not resumes:
        return f"{head}; a restart does not resume from it (the config sets overwrite_output_dir or resume_from_checkpoint)"
    return f"{head}; a failure now {lose}"


def step_of(checkpoint: str) -> int | None:
    """checkpoint-1200 -> 1200 (the Trainer's global_step at the save)."""
    number = checkpoint.rpartition("-")[2]
    return int(number) if number.isdigit() else None
