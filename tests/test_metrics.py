"""Evaluation metrics against values worked out by hand, plus every input error.

The expected numbers below are derived in the comments (pair counting for ROC
AUC, the kappa formula for QWK), so a wrong formula (wrong column, wrong weights,
a class left out) shows; scikit-learn, an independent implementation, is then
held against ours on random data with many ties.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyfi_imaging.train.metrics import EvalResult, evaluate_predictions, log_odds


def _binary(pos: list[float], neg: list[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.array(pos + neg)
    probs = np.stack([1 - s, s], axis=1)
    labels = np.array([1] * len(pos) + [0] * len(neg))
    return probs, labels


def _qwk_by_formula(y: np.ndarray, pred: np.ndarray, k: int) -> float:
    """kappa = 1 - sum(W O) / sum(W E), W_ij = (i - j)^2, E = outer(hist_y, hist_pred) / N."""
    o = np.zeros((k, k))
    np.add.at(o, (y, pred), 1)
    e = np.outer(o.sum(1), o.sum(0)) / len(y)
    w = (np.arange(k)[:, None] - np.arange(k)[None, :]) ** 2
    return float(1 - (w * o).sum() / (w * e).sum())


def test_binary_auc_by_pair_counting() -> None:
    # Positives 0.8, 0.4; negatives 0.5, 0.1, 0.3. Pairs won: 0.8 beats all 3,
    # 0.4 beats 0.1 and 0.3 -> 5 of 6.
    probs, labels = _binary([0.8, 0.4], [0.5, 0.1, 0.3])
    r = evaluate_predictions(probs, labels, task="binary")
    assert r.auc == pytest.approx(5 / 6)
    # argmax: 0.8 -> 1 (right), 0.4 -> 0 (wrong), 0.5 ties -> column 0 (right), 0.1, 0.3 right.
    assert r.accuracy == pytest.approx(4 / 5)
    assert r.confusion.tolist() == [[3, 0], [1, 1]]
    assert r.macro_auc is None and r.qwk is None


def test_binary_auc_counts_ties_as_half() -> None:
    # Positives 0.8, 0.3; negatives 0.5, 0.3, 0.1: 3 + (0 + 0.5 + 1) = 4.5 of 6.
    probs, labels = _binary([0.8, 0.3], [0.5, 0.3, 0.1])
    assert evaluate_predictions(probs, labels, task="binary").auc == pytest.approx(0.75)


def test_binary_accepts_one_score_per_sample_and_logits() -> None:
    probs, labels = _binary([0.8, 0.4], [0.5, 0.1, 0.3])
    one_column = evaluate_predictions(probs[:, 1], labels, task="binary")
    assert one_column.auc == pytest.approx(5 / 6)
    logits = np.log(probs)  # monotone per column: the ranking, hence the AUC, is unchanged
    assert evaluate_predictions(logits, labels, task="binary").auc == pytest.approx(5 / 6)


def test_a_confident_models_ranking_survives_rounding() -> None:
    """Log-probabilities of logit margins past 37 round to 0.0 in float64: ranked on them the
    slides tied (AUC 0.5 for 1.0, a 3-class macro AUC 0.9375 for 0.979); the log-odds (the
    trainer's scores) keep the margins."""
    import torch

    margins = torch.tensor([38.0, 40.0, 45.0, 60.0])  # negatives 38, 40; positives 45, 60
    z = torch.stack([torch.zeros(4), margins], 1).double()
    lp = torch.log_softmax(z, 1).numpy()
    assert (lp[:, 1] == 0).all()  # the rounding: column 1 alone ties every slide
    y = np.array([0, 0, 1, 1])
    assert evaluate_predictions(lp, y, task="binary").auc == 0.5
    assert evaluate_predictions(log_odds(lp), y, task="binary").auc == 1.0
    np.testing.assert_allclose(log_odds(lp)[:, 1], margins.numpy(), rtol=1e-12)
    logits = torch.tensor(
        [[45.0, 0, 1], [52, 0, 0], [40, 0, 2], [0, 2, 55], [0, 50, 0], [0, 0, 40]]
    ).double()
    y3 = np.array([0, 0, 1, 2, 1, 2])
    # each class's one-vs-rest ranking by its exact log-odds, from the logits
    want = np.mean(
        [
            _auc_by_pairs(
                (
                    logits[:, c] - torch.logsumexp(logits[:, [j for j in range(3) if j != c]], 1)
                ).numpy(),
                y3 == c,
            )
            for c in range(3)
        ]
    )
    lp3 = torch.log_softmax(logits, 1).numpy()
    got = evaluate_predictions(log_odds(lp3), y3, task="multiclass").macro_auc
    assert got == pytest.approx(want, rel=1e-12) and want > 0.97


def _auc_by_pairs(scores: np.ndarray, positive: np.ndarray) -> float:
    """The share of (positive, negative) pairs ordered right, a tie counting one half."""
    pos, neg = scores[positive], scores[~positive]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


def test_a_macro_auc_over_fewer_classes_says_so() -> None:
    r = evaluate_predictions(np.eye(4)[[0, 1, 2, 0]], np.array([0, 1, 2, 0]), task="multiclass")
    assert r.line() == "n=4 accuracy=1.0000 macro_auc=1.0000 (3/4 classes)"
    whole = evaluate_predictions(np.eye(3)[[0, 1, 2]], np.array([0, 1, 2]), task="multiclass")
    assert whole.line() == "n=3 accuracy=1.0000 macro_auc=1.0000"


def test_multiclass_macro_auc_and_confusion_by_hand() -> None:
    probs = np.array(
        [
            [0.6, 0.3, 0.1],  # true 0, predicted 0
            [0.2, 0.5, 0.3],  # true 1, predicted 1
            [0.3, 0.1, 0.6],  # true 2, predicted 2
            [0.5, 0.2, 0.3],  # true 2, predicted 0
        ]
    )
    labels = np.array([0, 1, 2, 2])
    # class 0: 0.6 vs {0.2, 0.3, 0.5} -> 1. class 1: 0.5 vs {0.3, 0.1, 0.2} -> 1.
    # class 2: {0.6, 0.3} vs {0.1, 0.3} -> (2 + 1 + 0.5) / 4 = 0.875.
    expected = (1 + 1 + 0.875) / 3
    r = evaluate_predictions(probs, labels, task="multiclass", class_names=["a", "b", "c"])
    assert r.macro_auc == pytest.approx(expected)
    assert r.auc is None
    assert r.accuracy == pytest.approx(0.75)
    assert r.confusion.tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert r.class_names == ("a", "b", "c")
    # A 4th class that never occurs is left out of the average (it has no positives).
    wider = np.concatenate([probs, np.full((4, 1), 0.05)], axis=1)
    r4 = evaluate_predictions(wider, labels, task="multiclass")
    assert r4.macro_auc == pytest.approx(expected)
    assert r4.confusion.shape == (4, 4) and r4.confusion[3].sum() == 0


def test_qwk_hand_values() -> None:
    eye = np.eye(6)
    # Perfect agreement is 1, exact reversal of 4 grades is -1 (PANDA's ISUP 0-5 scale).
    y = np.array([0, 1, 2, 3, 4, 5])
    assert evaluate_predictions(eye[y], y, task="graded").qwk == pytest.approx(1.0)
    y = np.array([0, 1, 2, 3])
    assert evaluate_predictions(eye[3 - y], y, task="graded").qwk == pytest.approx(-1.0)
    # y = (0, 1, 2), pred = (0, 2, 2): sum W O = 1; hist_y = (1, 1, 1), hist_pred = (1, 0, 2),
    # sum W E = (1/3) * [(0 + 2*4) + (1 + 2*1) + (4 + 0)] = 5 -> kappa = 1 - 1/5 = 0.8.
    # The unused grades 3-5 must not change it.
    r = evaluate_predictions(eye[[0, 2, 2]], np.array([0, 1, 2]), task="graded")
    assert r.qwk == pytest.approx(0.8)
    assert "qwk=0.8000" in r.line()


def test_qwk_matches_the_formula_on_random_grades() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 200)
    probs = rng.random((200, 6)) + 2.0 * np.eye(6)[y] * (rng.random(200) < 0.6)[:, None]
    r = evaluate_predictions(probs, y, task="graded")
    assert r.qwk == pytest.approx(_qwk_by_formula(y, probs.argmax(1), 6))
    assert r.macro_auc is not None and 0.5 < r.macro_auc <= 1.0


@pytest.mark.parametrize("seed", range(4))
def test_auc_kappa_and_confusion_equal_scikit_learns(seed: int) -> None:
    """Ours (rank sums, the kappa formula, counts) against scikit-learn's (trapezoids under
    the ROC curve, its own kappa and confusion matrix): coarse scores tie often."""
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    n, k = 57, 4
    labels = rng.integers(0, k, n)
    probs = rng.integers(0, 6, (n, k)).astype(np.float64) / 5  # six levels: many ties
    r = evaluate_predictions(probs, labels, task="graded")
    pred = probs.argmax(axis=1)
    per_class = [sk.roc_auc_score(labels == c, probs[:, c]) for c in range(k)]
    assert r.macro_auc == pytest.approx(float(np.mean(per_class)), rel=1e-12)
    qwk = sk.cohen_kappa_score(labels, pred, weights="quadratic", labels=list(range(k)))
    assert r.qwk == pytest.approx(qwk, rel=1e-12)
    assert np.array_equal(r.confusion, sk.confusion_matrix(labels, pred, labels=list(range(k))))
    binary = evaluate_predictions(probs[:, :2], (labels % 2), task="binary")
    assert binary.auc == pytest.approx(sk.roc_auc_score(labels % 2, probs[:, 1]), rel=1e-12)


def test_undefined_metrics_are_none() -> None:
    eye = np.eye(3)
    one_class = evaluate_predictions(eye[[2, 2, 2]], np.array([2, 2, 2]), task="graded")
    assert one_class.qwk is None  # truth and prediction one and the same grade: 0/0
    assert one_class.macro_auc is None
    assert "macro_auc=n/a" in one_class.line() and "qwk=n/a" in one_class.line()
    # Constant truth, constant different prediction: observed = expected disagreement -> 0.
    off = evaluate_predictions(eye[[0, 0, 0]], np.array([2, 2, 2]), task="graded")
    assert off.qwk == pytest.approx(0.0)
    binary = evaluate_predictions(
        np.array([[0.3, 0.7], [0.6, 0.4]]), np.array([1, 1]), task="binary"
    )
    assert binary.auc is None and "auc=n/a" in binary.line()


def test_result_renders_for_logs_and_json() -> None:
    probs, labels = _binary([0.8, 0.4], [0.5, 0.1, 0.3])
    r = evaluate_predictions(probs, labels, task="binary", class_names=["normal", "tumour"])
    assert r.line() == "n=5 accuracy=0.8000 auc=0.8333"
    assert r.scalars() == {"n": 5.0, "accuracy": pytest.approx(0.8), "auc": pytest.approx(5 / 6)}
    d = json.loads(json.dumps(r.as_dict()))
    assert d["confusion"] == [[3, 0], [1, 1]] and d["class_names"] == ["normal", "tumour"]
    assert d["qwk"] is None and d["task"] == "binary"
    back = EvalResult.from_dict(d)
    assert back.as_dict() == r.as_dict()
    with pytest.raises(ValueError):
        r.confusion[0, 0] = 7  # read-only: the result is a frozen value


@pytest.mark.parametrize(
    ("probs", "labels", "kwargs", "match"),
    [
        (np.zeros((0, 2)), np.zeros(0, dtype=int), {}, "no samples"),
        (
            np.array([[0.5, np.nan], [0.1, 0.9]]),
            np.array([0, 1]),
            {},
            r"non-finite.*row\(s\) \[0\]",
        ),
        (
            np.array([[0.5, 0.5], [0.1, 0.9]]),
            np.array([0, 2]),
            {},
            r"label\(s\) \[2\] outside \[0, 2\)",
        ),
        (np.array([[0.5, 0.5], [0.1, 0.9]]), np.array([-1, 1]), {}, "outside"),
        (np.array([[0.5, 0.5], [0.1, 0.9]]), np.array([0, 1, 1]), {}, "one integer label per row"),
        (np.array([[0.5, 0.5], [0.1, 0.9]]), np.array([0.0, 0.5]), {}, "whole numbers"),
        (np.full((2, 3), 1 / 3), np.array([0, 1]), {}, "task 'binary' with K = 3"),
        (np.ones((2, 1)), np.array([0, 0]), {"task": "multiclass"}, "K = 1"),
        (np.eye(2), np.array([0, 1]), {"class_names": ["a"]}, "1 class names for K = 2"),
        (np.eye(2), np.array([0, 1]), {"task": "ordinal"}, "unknown task"),
        # a sigmoid head's logits are not its probabilities: read as them, the threshold
        # was 0.5 (accuracy 0.5 where it was 1.0)
        (np.log([0.1, 0.4, 0.6, 0.9]), np.array([0, 0, 1, 1]), {}, r"outside \[0, 1\]"),
    ],
)
def test_bad_input_is_one_clear_error(
    probs: np.ndarray, labels: np.ndarray, kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {"task": "binary", **kwargs}
    with pytest.raises(ValueError, match=match):
        evaluate_predictions(probs, labels, **args)  # type: ignore[arg-type]


def test_a_confident_models_metrics_are_its_logits(train_manifest: Path, tmp_path: Path) -> None:
    """The trainer scores log-probabilities in float64: float32 probabilities round to 1.0 past
    a logit gap of ~17, so a confident model's slides tied in the AUC (0.44 reported for 0.38)
    and each slide's loss was capped at -log(1e-12) (13.8 reported for 190.9); its
    log-probabilities round to 0.0 past a gap of ~37, where the AUC is now taken on the
    log-odds (0.375 reported for 0.5)."""
    worker = Path(__file__).parent / "workers" / "confident_eval.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(
        [sys.executable, str(worker), str(train_manifest), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    got = json.loads(job.stdout.strip().splitlines()[-1])
    assert sum(abs(g) > 37 for g in got["gaps"]) >= 2, got  # float64 saturates on these slides
    assert got["auc"] == got["auc_logits"], got
    assert got["val_loss"] == pytest.approx(got["loss_logits"], rel=1e-9), got


def test_prediction_tables_keep_every_digit() -> None:
    """With 6 decimals a confident model's probabilities were all 1.000000 from a logit
    margin of 14.6, and an AUC taken from the file 0.83 where the run logged 1.0."""
    from hyfi_imaging.train.predictions import class_cells

    p = np.exp(-np.array([15.0, 16.0]))  # the negative class's probability at margins 15, 16
    cells = [class_cells(np.array([q, 1.0 - q]), ["normal", "tumour"]) for q in p]
    assert [float(c[1]) for c in cells] == p.tolist()
    assert cells[0][2] != cells[1][2]  # 1 - 3.1e-7 and 1 - 1.1e-7 stay apart
