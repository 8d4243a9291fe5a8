"""Pictures of a training run: curves, a confusion matrix, a resolution comparison.

Why these three: a researcher judges a whole-slide run by whether the loss
went down and the learning-rate schedule did what was asked (curves), which
classes are confused (confusion matrix), and — the point of training on whole
images — whether full resolution beats a downsampled image (comparison).

How they are drawn: on a :class:`matplotlib.figure.Figure` with an explicit
Agg canvas, not through ``pyplot``, so no global backend is switched and no
figure is left open in a long training process. Every picture is written to a
temporary file next to its target and moved over it with :func:`os.replace`,
so a run killed mid-write never leaves a truncated PNG behind.

The inputs are plain data (``RunLogger.history`` rows, an ``EvalResult``'s
confusion), so the same functions redraw a run from its ``metrics.csv``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hyfi_imaging.atomic import write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "VAL_METRICS",
    "plot_confusion_matrix",
    "plot_resolution_comparison",
    "plot_training_curves",
    "smooth",
    "validation_series",
]

Row = Mapping[str, "float | int | None"]

# Validation metrics in [0, 1] drawn on the left axis of the validation panel: those of
# classification, then segmentation's (Dice over all images and over those with lesions).
VAL_METRICS = (
    "val_accuracy",
    "val_auc",
    "val_macro_auc",
    "val_qwk",
    "val_dice",
    "val_dice_with_lesions",
    "val_iou",
    "val_lesion_sensitivity",
)
_COMPARE_METRICS = ("auc", "macro_auc", "accuracy", "qwk", "dice")


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


#: The PNG text key naming what wrote a picture (a heat map's, for instance).
PNG_KIND_KEY = "hyfi-kind"


def _save_atomic(fig: Figure, path: str | os.PathLike[str], kind: str | None = None) -> Path:
    """Write ``fig`` to ``path`` atomically, with the mode a plain ``open()`` would give;
    ``kind``: recorded in a PNG's text (``hyfi-kind``), so that a later run knows the file is
    one it may replace (:func:`~hyfi_imaging.train.outputs.check_replaceable`)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fmt = target.suffix.lstrip(".").lower() or "png"
    buf = io.BytesIO()
    marks = {PNG_KIND_KEY: kind} if kind is not None and fmt == "png" else None
    fig.savefig(buf, format=fmt, dpi=110, metadata=marks)
    return write_atomic(target, buf.getvalue())


def _finite(value: object) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _series(
    rows: Sequence[Row], x_keys: Sequence[str], y_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the rows that have a finite ``y_key`` and a finite first available x key."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        y = _finite(row.get(y_key))
        if y is None:
            continue
        x = next((v for k in x_keys if (v := _finite(row.get(k))) is not None), None)
        if x is None:
            continue
        xs.append(x)
        ys.append(y)
    return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)


def smooth(values: np.ndarray, *, window: int | None = None) -> np.ndarray:
    """Debiased exponential moving average, as TensorBoard's smoothing slider.

    ``window`` is the EMA span (``alpha = 2 / (window + 1)``); by default about
    a twentieth of the series, so short runs are barely smoothed.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return v
    span = max(1, window if window is not None else v.size // 20)
    beta = 1.0 - 2.0 / (span + 1.0)
    out = np.empty_like(v)
    acc = 0.0
    for i, x in enumerate(v):
        acc = beta * acc + (1.0 - beta) * x
        out[i] = acc / (1.0 - beta ** (i + 1)) if beta > 0 else x
    return out


def _empty(ax: Axes, what: str) -> None:
    ax.text(
        0.5,
        0.5,
        f"no {what} logged",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="grey",
    )
    ax.set_xticks([])
    ax.set_yticks([])


def validation_series(
    history: Sequence[Row],
) -> tuple[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The x axis (``"epoch"`` or ``"step"``) and the ``(x, y)`` of every :data:`VAL_METRICS`
    key and ``val_loss`` that ``history`` holds: what the validation panel draws."""
    has_epoch = any(_finite(r.get("epoch")) is not None for r in history if _has_val(r))
    x_keys = ("epoch", "step") if has_epoch else ("step",)
    drawn = {key: _series(history, x_keys, key) for key in (*VAL_METRICS, "val_loss")}
    return x_keys[0], {k: xy for k, xy in drawn.items() if xy[0].size}


def plot_training_curves(history: Sequence[Row], path: str | os.PathLike[str]) -> Path:
    """Draw training loss, learning rate, validation metrics and throughput; return ``path``.

    ``history`` rows are dicts as kept by :class:`~hyfi_imaging.train.logs.RunLogger`:
    training rows carry ``step`` and some of ``loss``, ``lr``, ``images_per_s``;
    evaluation rows carry ``epoch`` (or ``step``) and ``val_*`` metrics
    (:func:`validation_series`: accuracy, AUC, QWK; segmentation's Dice, Dice over
    the images with lesions, IoU and lesion sensitivity). Missing
    keys and ``None`` / NaN values are skipped; an empty history still gives a
    picture that says so.
    """
    from matplotlib.ticker import MaxNLocator

    fig = _new_figure(11, 7.5)
    (ax_loss, ax_lr), (ax_val, ax_speed) = fig.subplots(2, 2)

    x, y = _series(history, ("step",), "loss")
    if x.size:
        ax_loss.plot(x, y, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
        ax_loss.plot(x, smooth(y), color="tab:blue", lw=1.8, label="smoothed")
        ax_loss.set_xlabel("step")
        ax_loss.legend(loc="upper right", fontsize=8)
        ax_loss.grid(alpha=0.3)
    else:
        _empty(ax_loss, "training loss")
    ax_loss.set_title("training loss")

    x, y = _series(history, ("step",), "lr")
    if x.size:
        ax_lr.plot(x, y, color="tab:orange", lw=1.5)
        ax_lr.set_xlabel("step")
        if y.min() > 0 and y.max() / y.min() > 100:
            ax_lr.set_yscale("log")  # warm-up from ~0 or step decay: linear hides the tail
        else:
            ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax_lr.grid(alpha=0.3)
    else:
        _empty(ax_lr, "learning rate")
    ax_lr.set_title("learning rate")

    x_name, series = validation_series(history)
    for key in VAL_METRICS:
        if key in series:
            x, y = series[key]
            ax_val.plot(x, y, marker="o", ms=3.5, lw=1.5, label=key.removeprefix("val_"))
    if any(k in series for k in VAL_METRICS):
        ax_val.set_ylabel("Dice / score" if "val_dice" in series else "score")
    if "val_loss" in series:
        x, y = series["val_loss"]
        twin = ax_val.twinx()
        twin.plot(x, y, color="grey", ls="--", marker=".", lw=1.2, label="loss (right)")
        twin.set_ylabel("validation loss")
        twin.legend(loc="lower right", fontsize=8)
    if series:
        ax_val.set_xlabel(x_name)
        ax_val.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_val.set_ylim(min(0.0, ax_val.get_ylim()[0]), 1.02)
        if ax_val.get_legend_handles_labels()[0]:
            ax_val.legend(loc="lower left", fontsize=8)
        ax_val.grid(alpha=0.3)
    else:
        _empty(ax_val, "validation metric")
    ax_val.set_title("validation")

    x, y = _series(history, ("step",), "images_per_s")
    if x.size:
        ax_speed.plot(x, y, color="tab:green", alpha=0.35, lw=0.8)
        ax_speed.plot(x, smooth(y), color="tab:green", lw=1.8)
        ax_speed.set_xlabel("step")
        ax_speed.set_ylabel("images / s")
        ax_speed.set_ylim(bottom=0)
        ax_speed.grid(alpha=0.3)
    else:
        _empty(ax_speed, "throughput")
    ax_speed.set_title("throughput")
    return _save_atomic(fig, path)


def _has_val(row: Row) -> bool:
    return any(k.startswith("val_") for k in row)


def plot_confusion_matrix(
    confusion: np.ndarray | Sequence[Sequence[int]],
    class_names: Sequence[str] | None,
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Draw a ``K x K`` confusion matrix (rows = true class); return ``path``.

    Colours are row-normalised (the fraction of each true class predicted as
    each class, i.e. recall on the diagonal), so a rare class is as readable
    as a common one; each cell prints its count and that fraction.
    ``class_names=None`` labels the classes ``0 .. K-1``.
    """
    cm = np.asarray(confusion)
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(
            f"plot_confusion_matrix: confusion has shape {cm.shape}; pass a K x K matrix."
        )
    if class_names is None:
        class_names = [str(c) for c in range(cm.shape[0])]
    k = len(class_names)
    if cm.shape[0] != k:
        raise ValueError(
            f"plot_confusion_matrix: {k} class names for a {cm.shape[0]} x {cm.shape[1]} matrix; "
            "pass one name per class."
        )
    totals = cm.sum(axis=1, keepdims=True).astype(np.float64)
    frac = np.divide(cm, totals, out=np.zeros(cm.shape, dtype=np.float64), where=totals > 0)
    size = max(4.0, 1.0 + 0.75 * k)
    fig = _new_figure(size + 1.2, size)
    ax = fig.subplots()
    im = ax.imshow(frac, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of true class")
    fontsize = 9 if k <= 8 else 7
    for i in range(k):
        for j in range(k):
            colour = "white" if frac[i, j] > 0.5 else "black"
            ax.text(
                j,
                i,
                f"{int(cm[i, j])}\n{frac[i, j]:.0%}",
                ha="center",
                va="center",
                color=colour,
                fontsize=fontsize,
            )
    ax.set_xticks(
        range(k),
        [str(c) for c in class_names],
        rotation=45 if k > 4 else 0,
        ha="right" if k > 4 else "center",
    )
    ax.set_yticks(range(k), [str(c) for c in class_names])
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title or f"confusion matrix (n = {int(cm.sum())})", fontsize=10)
    return _save_atomic(fig, path)


def plot_resolution_comparison(
    results: Mapping[str, Mapping[str, float | int | None]],
    path: str | os.PathLike[str],
    *,
    metrics: Sequence[str] | None = None,
    title: str = "",
) -> Path:
    """Bar chart of metrics per setting, e.g. full resolution vs 8x downsampled; return ``path``.

    ``results`` maps a setting's label (``"full resolution (1.0 um/px)"``) to
    its metrics (``{"auc": 0.93, "accuracy": 0.88}``). ``metrics`` picks which
    keys to draw; by default those of ``auc``, ``macro_auc``, ``accuracy``,
    ``qwk`` that any setting has. A missing or undefined value leaves a gap
    marked ``n/a``. AUC gets a dashed chance line at 0.5.
    """
    if not results:
        raise ValueError("plot_resolution_comparison: no results; pass at least one setting.")
    if metrics is None:
        metrics = [
            m
            for m in _COMPARE_METRICS
            if any(_finite(r.get(m)) is not None for r in results.values())
        ]
    if not metrics:
        raise ValueError(
            "plot_resolution_comparison: none of the settings has a metric among "
            f"{list(_COMPARE_METRICS)}; pass metrics=[...] naming the keys to draw."
        )
    labels = list(results)
    n_set, n_met = len(labels), len(metrics)
    width = 0.8 / n_met
    fig = _new_figure(max(5.5, 1.6 + 1.5 * n_set * max(1, n_met) / 2), 4.5)
    ax = fig.subplots()
    top = 1.0
    for m_idx, metric in enumerate(metrics):
        xs = np.arange(n_set) + (m_idx - (n_met - 1) / 2) * width
        values = [_finite(results[s].get(metric)) for s in labels]
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(xs, heights, width * 0.92, label=metric)
        for bar, v in zip(bars, values, strict=True):
            text = "n/a" if v is None else f"{v:.3f}"
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), 0.0)),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        top = max([top, *(v for v in values if v is not None)])
    if any(m in ("auc", "macro_auc") for m in metrics):
        ax.axhline(0.5, color="grey", ls="--", lw=1, label="chance AUC")
    ax.set_xticks(range(n_set), labels)
    ax.set_ylim(0.0, top * 1.22)  # headroom for the legend above the bars
    ax.set_yticks(np.linspace(0.0, 1.0, 6) if top <= 1.0 else ax.get_yticks()[:-1])
    ax.set_ylabel("score")
    ax.legend(fontsize=8, loc="upper center", ncols=n_met + 1, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "whole image vs downsampled", fontsize=10)
    return _save_atomic(fig, path)
