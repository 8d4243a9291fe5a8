"""Evaluation metrics for whole-slide classification, in one frozen value.

Why one function and one result type: the trainer's evaluation gives every rank
the same ``(N, K)`` scores (each data replica predicts the whole validation set)
and then needs the same handful of numbers in four places — the log line, ``metrics.csv``, TensorBoard and the
checkpoint's metadata. :func:`evaluate_predictions` computes them once from
the gathered ``(N, K)`` scores, and :class:`EvalResult` renders them for each
place (:meth:`EvalResult.line`, :meth:`EvalResult.scalars`,
:meth:`EvalResult.as_dict`).

Which numbers, and why:

* ``accuracy`` — on the argmax prediction, for every task.
* ``auc`` — ROC AUC of the positive class (column 1) when ``K == 2``: the
  headline metric of slide-level detection (CAMELYON16). It is rank based, so
  any increasing function of each probability gives the same value: the
  log-odds, which the trainer passes (:func:`log_odds`: probabilities, even
  their logarithms, of a confident model round to 1.0 and 0.0 and tie, from a
  logit margin of 17 in float32 and 37 in float64; column 1's log-odds is the
  margin). Not raw logits: column 1's logit alone is not the log-odds.
* ``macro_auc`` — one-vs-rest ROC AUC averaged over the classes present in the
  labels, when ``K > 2`` (TCGA subtyping): a class without samples has no AUC,
  and :meth:`EvalResult.line` says how many classes the mean is of. Each class
  is scored on its own column, so the scores need not sum to one.
* ``qwk`` — quadratic weighted Cohen's kappa on the argmax prediction for
  ``task="graded"`` (PANDA ISUP grades 0-5), the metric of the PANDA challenge.
* ``confusion`` — ``K x K`` counts, rows = true class, columns = prediction.

A metric that is undefined on the data (AUC with one class present, kappa when
truth and prediction are one and the same constant) is ``None``, never NaN, so
that logs and JSON stay honest and parseable. Bad input (no samples, NaN
scores, labels outside ``[0, K)``) raises :class:`ValueError` naming the
offending numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hyfi_imaging.errors import problem

__all__ = ["TASKS", "EvalResult", "Task", "evaluate_predictions", "log_odds"]

Task = Literal["binary", "graded", "multiclass"]
TASKS: tuple[Task, ...] = ("binary", "graded", "multiclass")

_WHERE = "evaluate_predictions"


@dataclass(frozen=True, eq=False)
class EvalResult:
    """The metrics of one evaluation pass (see the module docstring for each one).

    ``confusion`` is a read-only ``int64`` array; equality is not defined on
    this type (compare :meth:`as_dict` values instead).
    """

    n: int
    accuracy: float
    auc: float | None
    macro_auc: float | None
    qwk: float | None
    confusion: np.ndarray
    class_names: tuple[str, ...]
    task: Task = "multiclass"

    @property
    def num_classes(self) -> int:
        """``K``, the number of classes."""
        return len(self.class_names)

    @property
    def classes_present(self) -> int:
        """How many classes have samples (the confusion matrix's non-empty rows)."""
        return int((self.confusion.sum(axis=1) > 0).sum())

    def scalars(self) -> dict[str, float]:
        """The defined numeric metrics (``n``, ``accuracy``, ``auc``, ...) for CSV and TensorBoard."""
        out: dict[str, float] = {"n": float(self.n), "accuracy": self.accuracy}
        for key in ("auc", "macro_auc", "qwk"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict: scalars (``None`` when undefined), ``class_names`` and ``confusion`` as lists."""
        return {
            "task": self.task,
            "n": self.n,
            "accuracy": self.accuracy,
            "auc": self.auc,
            "macro_auc": self.macro_auc,
            "qwk": self.qwk,
            "class_names": list(self.class_names),
            "confusion": self.confusion.tolist(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        """Rebuild a result from :meth:`as_dict` output (e.g. read back from JSON)."""
        confusion = np.asarray(data["confusion"], dtype=np.int64)
        confusion.setflags(write=False)

        def opt(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        return cls(
            n=int(data["n"]),
            accuracy=float(data["accuracy"]),
            auc=opt("auc"),
            macro_auc=opt("macro_auc"),
            qwk=opt("qwk"),
            confusion=confusion,
            class_names=tuple(str(c) for c in data["class_names"]),
            task=_as_task(data.get("task", "multiclass")),
        )

    def line(self) -> str:
        """One line for the log, e.g. ``n=40 accuracy=0.8750 auc=0.9125``.

        Shows the metrics that apply to this task and ``K``; an undefined one
        is shown as ``n/a`` rather than hidden, and a macro AUC over fewer than
        ``K`` classes says of how many (``macro_auc=0.7500 (3/4 classes)``), so
        a missing class is noticed.
        """

        def fmt(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        parts = [f"n={self.n}", f"accuracy={fmt(self.accuracy)}"]
        if self.num_classes == 2:
            parts.append(f"auc={fmt(self.auc)}")
        else:
            parts.append(f"macro_auc={fmt(self.macro_auc)}")
            present = self.classes_present
            if self.macro_auc is not None and present < self.num_classes:
                parts[-1] += f" ({present}/{self.num_classes} classes)"
        if self.task == "graded":
            parts.append(f"qwk={fmt(self.qwk)}")
        return " ".join(parts)

    def __str__(self) -> str:
        return self.line()


def _as_task(task: object) -> Task:
    for known in TASKS:
        if task == known:
            return known
    raise ValueError(problem(_WHERE, f"unknown task {task!r}", f"use one of {list(TASKS)}"))


def _check_inputs(
    probs: np.ndarray, labels: np.ndarray, task: str, class_names: Sequence[str] | None
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Validate and normalise the inputs; every message names the offending numbers."""
    _as_task(task)
    p = np.asarray(probs)
    y = np.asarray(labels)
    if p.ndim == 1 and task == "binary":
        # A sigmoid head gives one score per sample: its probability of the positive class.
        # A logit read as one put the threshold at 0.5 (accuracy 0.5 where it was 1.0).
        q = p.astype(np.float64)
        outside = ~((q >= 0) & (q <= 1))
        if outside.any():
            raise ValueError(
                problem(
                    _WHERE,
                    f"1-D binary scores outside [0, 1] (e.g. {float(q[outside][0])})",
                    "pass the positive class's probabilities (a sigmoid of the logits), "
                    "or (N, 2) scores",
                )
            )
        p = np.stack([1.0 - p.astype(np.float64), p.astype(np.float64)], axis=1)
    if p.ndim != 2:
        raise ValueError(
            problem(_WHERE, f"probs has shape {p.shape}", "pass scores of shape (N, K)")
        )
    n, k = p.shape
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(
            problem(
                _WHERE,
                f"labels has shape {y.shape} but probs has shape {p.shape}",
                "pass one integer label per row of probs",
            )
        )
    if n == 0:
        raise ValueError(problem(_WHERE, "no samples (N = 0)", "evaluate at least one sample"))
    if k < 2:
        raise ValueError(
            problem(_WHERE, f"probs has K = {k} column(s)", "pass at least 2 class scores")
        )
    if task == "binary" and k != 2:
        raise ValueError(
            problem(_WHERE, f"task 'binary' with K = {k} classes", "use 'multiclass' or 'graded'")
        )
    if not np.issubdtype(p.dtype, np.number) or np.issubdtype(p.dtype, np.complexfloating):
        raise ValueError(problem(_WHERE, f"probs has dtype {p.dtype}", "pass real scores"))
    p = p.astype(np.float64, copy=False)
    bad = ~np.isfinite(p)
    if bad.any():
        rows = np.flatnonzero(bad.any(axis=1))
        raise ValueError(
            problem(
                _WHERE,
                f"{int(bad.sum())} non-finite score(s) (NaN/inf), first in row(s) "
                f"{rows[:5].tolist()}",
                "check the model output for divergence before evaluating",
            )
        )
    if np.issubdtype(y.dtype, np.bool_):
        y = y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        if not (np.isfinite(y).all() and (y == np.round(y)).all()):
            raise ValueError(
                problem(_WHERE, "labels are not whole numbers", "pass integer class indices")
            )
        y = y.astype(np.int64)
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            problem(_WHERE, f"labels have dtype {y.dtype}", "pass integer class indices")
        )
    y = y.astype(np.int64, copy=False)
    outside = (y < 0) | (y >= k)
    if outside.any():
        values = sorted(set(y[outside].tolist()))
        raise ValueError(
            problem(
                _WHERE,
                f"label(s) {values[:5]} outside [0, {k}) for K = {k} score columns",
                "map labels to 0..K-1 or give the model K outputs",
            )
        )
    if class_names is None:
        names = tuple(str(c) for c in range(k))
    else:
        names = tuple(str(c) for c in class_names)
        if len(names) != k:
            raise ValueError(
                problem(
                    _WHERE,
                    f"{len(names)} class names for K = {k} score columns",
                    "pass one name per class",
                )
            )
    return p, y, names


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``, tied values sharing their mean rank."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    stops = np.r_[starts[1:], values.size]
    mean_rank = (starts + 1 + stops) / 2.0  # the mean of ranks start + 1 .. stop
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, stops - starts)
    return ranks


def _binary_auc(positive: np.ndarray, scores: np.ndarray) -> float | None:
    """ROC AUC of ``scores`` for the boolean ``positive``; ``None`` with one class only.

    The area under the ROC curve is the Mann-Whitney statistic: the share of
    (positive, negative) pairs ranked right, a tie counting one half, from the
    positives' rank sum with tied scores on their mean rank -- the value
    scikit-learn's trapezoids give. Why not ``sklearn.metrics``: every rank
    evaluates, and importing it cost each rank 0.45 s of start-up.
    """
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = float(_average_ranks(scores.astype(np.float64))[positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _confusion(y: np.ndarray, pred: np.ndarray, k: int) -> np.ndarray:
    """``k x k`` counts, rows the true class, columns the prediction."""
    return np.bincount(y * k + pred, minlength=k * k).reshape(k, k).astype(np.int64)


def _quadratic_kappa(y: np.ndarray, pred: np.ndarray, k: int) -> float | None:
    """Quadratic weighted kappa; ``None`` when undefined (0/0).

    ``1 - sum(W O) / sum(W E)`` with ``O`` the confusion matrix, ``W_ij = (i -
    j)^2`` and ``E`` the outer product of the true and predicted class counts
    over ``N`` (Cohen's, as scikit-learn computes it). The expected
    disagreement is zero exactly when truth and prediction are the same single
    class; then kappa is 0/0 and we say so.
    """
    if np.unique(y).size == 1 and np.array_equal(np.unique(pred), np.unique(y)):
        return None
    observed = _confusion(y, pred, k).astype(np.float64)
    expected = np.outer(observed.sum(axis=1), observed.sum(axis=0)) / observed.sum()
    weights = np.subtract.outer(np.arange(k), np.arange(k)) ** 2.0
    with np.errstate(divide="ignore", invalid="ignore"):  # NumPy's 0/0 is NaN, not an error
        value = float(1.0 - (weights * observed).sum() / (weights * expected).sum())
    return value if math.isfinite(value) else None


def evaluate_predictions(
    probs: np.ndarray,
    labels: np.ndarray,
    *,
    task: Task,
    class_names: Sequence[str] | None = None,
) -> EvalResult:
    """Compute accuracy, AUC / macro AUC, QWK and the confusion matrix.

    ``probs`` is ``(N, K)`` scores: probabilities, or any increasing function of each
    (log-probabilities: every metric here uses only the argmax or the ranking within a
    column). Not raw logits: a column's logit ranks samples unlike its probability. For
    ``task="binary"`` a 1-D array is read as the positive-class score.
    ``labels`` is ``(N,)`` integer class indices in ``[0, K)``.

    OK::

        >>> r = evaluate_predictions(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([0, 1]),
        ...                          task="binary")
        >>> r.line()
        'n=2 accuracy=1.0000 auc=1.0000'

    Error::

        >>> evaluate_predictions(np.zeros((2, 2)), np.array([0, 2]), task="binary")
        Traceback (most recent call last):
        ValueError: evaluate_predictions: label(s) [2] outside [0, 2) ...
    """
    p, y, names = _check_inputs(probs, labels, task, class_names)
    n, k = p.shape
    pred = p.argmax(axis=1)
    accuracy = float((pred == y).mean())
    auc = _binary_auc(y == 1, p[:, 1]) if k == 2 else None
    macro_auc: float | None = None
    if k > 2:
        per_class = [_binary_auc(y == c, p[:, c]) for c in np.unique(y).tolist()]
        defined = [a for a in per_class if a is not None]
        macro_auc = float(np.mean(defined)) if defined else None
    qwk = _quadratic_kappa(y, pred, k) if task == "graded" else None
    confusion = _confusion(y, pred, k)
    confusion.setflags(write=False)
    return EvalResult(
        n=int(n),
        accuracy=accuracy,
        auc=auc,
        macro_auc=macro_auc,
        qwk=qwk,
        confusion=confusion,
        class_names=names,
        task=task,
    )


def log_odds(log_probs: np.ndarray) -> np.ndarray:
    """Each class's log-odds ``log p_c - log(1 - p_c)`` from ``(N, K)`` log-probabilities.

    The scores to rank a confident model by: its log-probabilities round to 0.0 from a
    logit margin of 37 (float64), and tied slides' AUC fell to one half, but the rest's
    ``log(1 - p_c) = logsumexp_{j != c} log p_j`` keeps the margin (``K = 2``: the
    margin itself). The logit of ``p``, one increasing function of every column: the
    argmax and each column's ranking are the probabilities'.
    """
    lp = np.asarray(log_probs, dtype=np.float64)
    k = lp.shape[1]
    rest = np.empty_like(lp)
    for c in range(k):
        others = np.delete(lp, c, axis=1)
        top = others.max(axis=1, keepdims=True)
        safe = np.where(np.isfinite(top), top, 0.0)  # every other class -inf: log 0
        with np.errstate(divide="ignore"):
            rest[:, c] = (safe + np.log(np.exp(others - safe).sum(axis=1, keepdims=True)))[:, 0]
    return lp - rest
