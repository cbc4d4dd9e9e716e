"""`ftbundle plot`: loss and learning rate of one or more runs, from their metrics.jsonl, and
the GPUs' utilization beside them where the run read its GPUs (ftbundle.gpu_metrics).

A PNG through matplotlib's Agg backend (no display needed), or, on a terminal without
``-o``, a plot in the terminal (plotext). Both libraries are in the ``plot`` extra; a
missing one is a clear error, not a traceback.
"""

from __future__ import annotations

from .errors import UserError


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` ("loss" or "lr"), skipping records without it. Pure."""
    xs, ys = [], []
    for i, record in enumerate(records):
        value = record.get(key)
        if isinstance(value, (int, float)):
            step = record.get("current_steps")
            xs.append(float(step) if isinstance(step, (int, float)) else float(i + 1))
            ys.append(float(value))
    return xs, ys


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"`ftbundle plot` needs {module.split('.')[0]}: pip install 'ftbundle[plot]' "
                        f"(or pip install {module.split('.')[0]})", key="plot") from None


def has_gpus(metrics: dict[str, list[dict]]) -> bool:
    """Whether any run's records hold the GPUs' utilization (a GPU job's: ftbundle.gpu_metrics)."""
    return any(series(records, "gpu_util")[0] for records in metrics.values())


def plot_png(metrics: dict[str, list[dict]], path: str, *, title: str = "") -> None:
    """Loss (top), learning rate and, for GPU runs, the GPUs' mean utilization against step,
    one line per run."""
    matplotlib = _need("matplotlib")
    matplotlib.use("Agg")
    plt = _need("matplotlib.pyplot")
    gpus = has_gpus(metrics)
    fig, axes = plt.subplots(3 if gpus else 2, 1, figsize=(9, 8.5 if gpus else 6.5), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1, 1] if gpus else [2, 1]})
    ax_loss, ax_lr = axes[0], axes[1]

    def lines(ax, key: str, width: float) -> None:  # (one line per run that has ``key``)
        for run_id, records in metrics.items():
            xs, ys = series(records, key)
            if xs:
                ax.plot(xs, ys, label=run_id, linewidth=width)

    if gpus:
        lines(axes[2], "gpu_util", 1.2)
        axes[2].set_ylabel("GPU utilization %")
        axes[2].set_ylim(0, 105)
        axes[2].grid(True, alpha=0.3)
    lines(ax_loss, "loss", 1.4)
    lines(ax_lr, "lr", 1.2)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{title}: training loss" if title else "training loss")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_lr.set_ylabel("learning rate")
    axes[-1].set_xlabel("step")
    ax_lr.grid(True, alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_terminal(metrics: dict[str, list[dict]], *, title: str = "") -> None:
    """The loss curve(s) drawn in the terminal."""
    plt = _need("plotext")
    plt.clear_figure()
    gpus = has_gpus(metrics)
    plt.subplots(3 if gpus else 2, 1)
    panels = [("loss", f"{title}: loss" if title else "loss"), ("lr", "learning rate")]
    for row, (key, heading) in enumerate(panels + ([("gpu_util", "GPU utilization %")] if gpus else []), start=1):
        plt.subplot(row, 1)
        for run_id, records in metrics.items():
            xs, ys = series(records, key)
            if xs:
                plt.plot(xs, ys, label=run_id)
        plt.title(heading)
    plt.xlabel("step")
    plt.show()
