"""Fair segmentation scores: the empty-truth rule, lesion counts, means, CSV, curves, overlays.

Every expected number is worked out by hand in the comments from masks built
here, not taken from the code under test. The grid test runs the trainer's
scoring path (all-reduced counts, stitched masks, rank 0's lesions broadcast)
on 2x2 tiles and on two replicas of 1x2 with mpiexec (4 ranks, a few seconds),
with lesions that cross the tile borders, and wants these same rows on every rank.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyfi_imaging.train.losses import overlap_counts, scores_from_counts
from hyfi_imaging.train.seg_scores import (
    SCORE_COLUMNS,
    LesionCounts,
    SegmentationTally,
    count_lesions,
    segmentation_line,
    summarise_segmentation,
)

CLASSES = 3  # background, tumour, stroma
SIZE = (37, 45)  # odd: the 2x2 tiles are 19x23 with a padded tail


def grid_masks() -> tuple[list[str], np.ndarray, np.ndarray]:
    """Four images ``(ids, pred, truth)`` of ``SIZE`` (also read by tests/workers/seg_scores.py).

    * ``lesions``: truth tumour 15:25 x 18:29 (110 px, across both tile borders at row 19 and
      column 23) and 2:6 x 2:6 (16 px, missed), stroma 30:35 x 35:41 (found exactly).
      Prediction: tumour 17:25 x 20:31 (88 px), false positives 30:33 x 2:5 (9 px) and
      8:10 x 21:26 (10 px, across the column border: one component), the stroma.
    * ``empty-clean``: nothing in either.
    * ``empty-fp``: no truth; predicted tumour at (0, 0) and 18:21 x 5:7 (across the row border).
    * ``diagonal``: truth tumour (i, i + 5) for i in 15..22, one lesion with 8-connectivity
      across both borders; predicted only (15, 20).
    """
    pred = np.zeros((4, *SIZE), np.uint8)
    truth = np.zeros((4, *SIZE), np.uint8)
    truth[0, 15:25, 18:29] = 1
    truth[0, 2:6, 2:6] = 1
    truth[0, 30:35, 35:41] = 2
    pred[0, 17:25, 20:31] = 1
    pred[0, 30:33, 2:5] = 1
    pred[0, 8:10, 21:26] = 1
    pred[0, 30:35, 35:41] = 2
    pred[2, 0, 0] = 1
    pred[2, 18:21, 5:7] = 1
    for i in range(15, 23):
        truth[3, i, i + 5] = 1
    pred[3, 15, 20] = 1
    return ["lesions", "empty-clean", "empty-fp", "diagonal"], pred, truth


# Image "lesions", tumour: 126 true, 107 predicted, 8 x 9 = 72 shared; stroma perfect.
DICE_A = (2 * 72 / (126 + 107) + 1) / 2
IOU_A = (72 / (126 + 107 - 72) + 1) / 2
EXPECTED = [
    # id, dice, iou, truth px, pred px, lesions, hit, sensitivity, predicted, false positives
    ("lesions", DICE_A, IOU_A, 126 + 30, 107 + 30, 3, 2, 2 / 3, 4, 2),
    ("empty-clean", 1.0, 1.0, 0, 0, 0, 0, None, 0, 0),
    ("empty-fp", 0.0, 0.0, 0, 7, 0, 0, None, 2, 2),
    ("diagonal", 2 / 9, 1 / 8, 8, 1, 1, 1, 1.0, 1, 0),
]
NOTES = {
    "empty-clean": "empty truth and prediction: Dice = IoU = 1 by rule",
    "empty-fp": "empty truth, 2 predicted lesion(s): Dice = IoU = 0",
}


def _check_rows(rows: list[dict[str, object]]) -> None:
    assert [r["id"] for r in rows] == [e[0] for e in EXPECTED]
    for row, (sid, dice, iou, tp, pp, les, hit, sens, predicted, fp) in zip(
        rows, EXPECTED, strict=True
    ):
        assert row["dice"] == pytest.approx(dice, abs=1e-12), sid
        assert row["iou"] == pytest.approx(iou, abs=1e-12), sid
        got = [row[k] for k in ("truth_pixels", "pred_pixels", "lesions", "lesions_hit")]
        assert got == [tp, pp, les, hit], sid
        assert [row["pred_lesions"], row["false_positives"]] == [predicted, fp], sid
        assert row["sensitivity"] == (None if sens is None else pytest.approx(sens)), sid
        assert row["note"] == NOTES.get(sid, ""), sid


def _check_summary(summary: dict[str, object]) -> None:
    assert summary["n"] == 4 and summary["n_with_lesions"] == 2 and summary["n_empty"] == 2
    assert summary["dice"] == pytest.approx((DICE_A + 1 + 0 + 2 / 9) / 4)
    assert summary["iou"] == pytest.approx((IOU_A + 1 + 0 + 1 / 8) / 4)
    assert summary["dice_with_lesions"] == pytest.approx((DICE_A + 2 / 9) / 2)
    assert summary["iou_with_lesions"] == pytest.approx((IOU_A + 1 / 8) / 2)
    assert summary["lesion_sensitivity"] == pytest.approx(3 / 4)  # pooled: (2 + 1) / (3 + 1)
    assert summary["fp_per_image"] == pytest.approx(1.0)  # (2 + 0 + 2 + 0) / 4
    assert summary["empty_clean"] == pytest.approx(0.5)


def _one_process_scores() -> tuple[list[dict[str, object]], dict[str, object]]:
    ids, pred, truth = grid_masks()
    logits = F.one_hot(torch.from_numpy(pred).long(), CLASSES).movedim(-1, 1).double()
    counts = overlap_counts(logits, torch.from_numpy(truth).long())
    tally = SegmentationTally(CLASSES)
    dice = tally.add(ids, counts, pred, truth)
    assert dice == pytest.approx([e[1] for e in EXPECTED])
    scores = tally.finish()
    return [s.row() for s in scores], summarise_segmentation(scores)


# -- lesion counts by hand ---------------------------------------------------------------------
def test_empty_truth_and_prediction_is_a_perfect_score() -> None:
    empty = np.zeros((6, 7), np.uint8)
    assert count_lesions(empty, empty, 2) == LesionCounts(0, 0, 0, 0)
    counts = torch.zeros(1, 2, 3, dtype=torch.float64)
    assert [float(v[0]) for v in scores_from_counts(counts)] == [1.0, 1.0]


def test_empty_truth_with_a_prediction_scores_zero_and_counts_its_lesions() -> None:
    truth = np.zeros((6, 7), np.uint8)
    pred = truth.copy()
    pred[0, 0] = pred[4:6, 4:7] = 1  # two predicted components
    assert count_lesions(pred, truth, 2) == LesionCounts(0, 0, 2, 2)
    counts = torch.tensor([[[0.0, 0, 0], [0.0, 7.0, 0.0]]], dtype=torch.float64)
    dice, iou = scores_from_counts(counts)
    assert float(dice[0]) == 0.0 and float(iou[0]) == 0.0


def test_two_lesions_one_hit_is_half_sensitivity() -> None:
    truth = np.zeros((8, 10), np.uint8)
    truth[1:3, 1:3] = 1
    truth[5:8, 6:10] = 1
    pred = np.zeros_like(truth)
    pred[2, 2] = 1  # one pixel of the first lesion: a hit (any overlap)
    got = count_lesions(pred, truth, 2)
    assert got == LesionCounts(lesions=2, hit=1, predicted=1, false_positives=0)
    assert got.hit / got.lesions == 0.5


def test_hit_fraction_connectivity_classes_and_volumes() -> None:
    truth = np.zeros((3, 12), np.uint8)
    truth[1, 1:11] = 1  # one lesion of 10 px
    pred = np.zeros_like(truth)
    pred[1, 1:3] = 1  # covers 2 px = 20 %
    assert count_lesions(pred, truth, 2).hit == 1
    assert count_lesions(pred, truth, 2, hit_fraction=0.5).hit == 0  # 2 > 5 is false
    pred[1, 1:7] = 1  # 6 px = 60 %
    assert count_lesions(pred, truth, 2, hit_fraction=0.5).hit == 1
    # Diagonal neighbours are one lesion (8-connectivity).
    diag = np.eye(5, dtype=np.uint8)
    assert count_lesions(diag, diag, 2) == LesionCounts(1, 1, 1, 0)
    # The right place with the wrong class: a missed lesion and a false positive.
    t, p = np.zeros((4, 4), np.uint8), np.zeros((4, 4), np.uint8)
    t[1:3, 1:3], p[1:3, 1:3] = 1, 2
    assert count_lesions(p, t, 3) == LesionCounts(lesions=1, hit=0, predicted=1, false_positives=1)
    # Volumes: voxels touching at a corner across z are one lesion (26-connectivity).
    vol = np.zeros((3, 3, 3), np.uint8)
    vol[0, 0, 0] = vol[1, 1, 1] = vol[2, 2, 2] = 1
    assert count_lesions(vol, vol, 2) == LesionCounts(1, 1, 1, 0)
    with pytest.raises(ValueError, match="are not one 2-D or 3-D image"):
        count_lesions(vol[0], vol, 2)


def test_a_class_absent_from_both_does_not_lift_the_score() -> None:
    # Tumour: 1 shared of 2 true and 2 predicted (Dice 1/2, IoU 1/3); stroma nowhere.
    counts = torch.tensor([[[0.0, 0, 0], [1.0, 2.0, 2.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    dice, iou = scores_from_counts(counts)
    assert float(dice[0]) == pytest.approx(0.5) and float(iou[0]) == pytest.approx(1 / 3)
    # Stroma predicted on a slide without any: its 0 counts, (1/2 + 0) / 2.
    counts[0, 2, 1] = 5.0
    assert float(scores_from_counts(counts)[0][0]) == pytest.approx(0.25)


# -- one evaluation pass -----------------------------------------------------------------------
def test_per_image_rows_and_means_by_hand() -> None:
    rows, summary = _one_process_scores()
    _check_rows(rows)
    _check_summary(summary)
    line = segmentation_line(summary)
    assert "with lesions (2/4): dice 0." in line and "lesion sensitivity 0.7500" in line
    assert "fp/image 1.0000" in line and "empty clean 0.5000" in line


def test_scores_csv_states_the_rule(tmp_path: Path) -> None:
    from hyfi_imaging.train.outputs import write_scores

    rows, _ = _one_process_scores()
    path = write_scores(tmp_path / "val_per_image.csv", rows)
    with path.open(newline="") as fh:
        got = list(csv.DictReader(fh))
    assert tuple(got[0]) == SCORE_COLUMNS
    assert [r["dice"] for r in got] == [f"{DICE_A:.6f}", "1.000000", "0.000000", f"{2 / 9:.6f}"]
    assert [r["sensitivity"] for r in got] == [f"{2 / 3:.6f}", "", "", "1.000000"]
    assert [r["false_positives"] for r in got] == ["2", "0", "2", "0"]
    assert got[1]["note"] == NOTES["empty-clean"] and got[2]["note"] == NOTES["empty-fp"]


def test_stitched_masks_that_disagree_with_the_tile_counts_are_refused() -> None:
    ids, pred, truth = grid_masks()
    logits = F.one_hot(torch.from_numpy(pred).long(), CLASSES).movedim(-1, 1).double()
    counts = overlap_counts(logits, torch.from_numpy(truth).long())
    shifted = np.zeros_like(pred)
    shifted[..., 20:] = pred[..., :-20]  # a stitch that drops pixels off the edge
    tally = SegmentationTally(CLASSES)
    tally.add(ids, counts, shifted, truth)
    with pytest.raises(RuntimeError, match="image lesions: the stitched masks hold"):
        tally.finish()


# -- exact on a grid ---------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["1:2:2", "2:1:2"])
def test_scores_on_a_grid_equal_one_process_on_every_rank(case: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
    from _launch import have_mpiexec, json_line, mpiexec

    if not have_mpiexec():
        pytest.skip("mpiexec is not installed")
    worker = Path(__file__).parent / "workers" / "seg_scores.py"
    job = mpiexec(4, str(worker), case, timeout=180)
    assert job.returncode == 0, job.describe()
    result = json_line(job)
    assert result["case"] == case and len(result["ranks"]) == 4
    for rank in result["ranks"]:
        _check_rows(rank["rows"])
        _check_summary(rank["summary"])


# -- pictures ----------------------------------------------------------------------------------
def test_training_curves_draw_dice(tmp_path: Path) -> None:
    from hyfi_imaging.train.logs import RunLogger
    from hyfi_imaging.train.plots import plot_training_curves, validation_series

    _, summary = _one_process_scores()
    log = RunLogger(tmp_path, enabled=True)
    for step in range(1, 5):
        log.log_step(step, epoch=0, loss=1.0 / step, lr=0.01)
    log.log_eval(4, 1, {**summary, "dice": 0.25, "val_loss": 0.9})
    log.log_eval(8, 2, {**summary, "val_loss": 0.7})
    x_name, series = validation_series(log.history)
    assert x_name == "epoch"
    x, y = series["val_dice"]
    assert x.tolist() == [1.0, 2.0] and y.tolist() == pytest.approx([0.25, summary["dice"]])
    assert series["val_dice_with_lesions"][1].tolist() == pytest.approx(
        [summary["dice_with_lesions"]] * 2
    )
    assert {"val_iou", "val_lesion_sensitivity", "val_loss"} <= set(series)
    path = plot_training_curves(log.history, tmp_path / "training_curves.png")
    log.close()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_overlay_outlines_the_truth_in_its_own_colour(tmp_path: Path) -> None:
    import matplotlib.image

    from hyfi_imaging.io.zarr_store import write_ome_zarr
    from hyfi_imaging.train.outputs import OUTLINE_RGB, outline, overlay_picture, write_overlay

    truth = np.zeros((12, 16), np.uint8)
    truth[3:9, 4:12] = 1  # a 6x8 block: its outline is the 2 * (6 + 8) - 4 = 24 px ring
    truth[10:12, 0:3] = 1  # cut by the image's edge: closed along it
    ring = outline(truth)
    assert int(ring[3:9, 4:12].sum()) == 24 and not ring[4:8, 5:11].any()
    assert ring[11, 0:3].all() and ring[10:12, 0].all()
    pred = np.zeros_like(truth)
    pred[5:7, 6:10] = 1  # inside the truth, off its outline
    rgb = np.full((12, 16, 3), 0.5)
    picture = overlay_picture(rgb, pred, truth)
    yellow = np.array(OUTLINE_RGB) / 255.0
    assert np.array_equal(picture[ring], np.broadcast_to(yellow, (int(ring.sum()), 3)))
    assert np.array_equal(picture[~ring & (pred == 0)], rgb[~ring & (pred == 0)])
    assert not np.isclose(picture[6, 7], yellow).all() and not np.isclose(picture[6, 7], 0.5).all()

    image = tmp_path / "image.zarr"
    write_ome_zarr(image, np.full((3, 12, 16), 200, np.uint8), mpp=None, hyfi_attrs={})

    def yellow_share(truth_map: np.ndarray | None) -> float:
        out = write_overlay(
            tmp_path / f"{truth_map is None}.png",
            pred,
            image=str(image),
            title="t",
            truth=truth_map,
        )
        px = matplotlib.image.imread(out)[..., :3]
        return float(((px[..., 0] > 0.95) & (px[..., 1] > 0.95) & (px[..., 2] < 0.05)).mean())

    assert yellow_share(truth) > 0.05 and yellow_share(None) == 0.0


def test_an_overlay_of_a_coarser_levels_map_is_drawn_over_that_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A map predicted at data.level 1 was drawn over level 0's top-left quarter (the picture
    chose its level from 0 and sampled the map by that level's factor): the truth outlined
    empty glass. It is drawn over its own level, or a coarser one sampled by the difference."""
    import hyfi_imaging.train.outputs as outputs
    from hyfi_imaging.io.zarr_store import ZarrReader, write_ome_zarr

    y, x = np.mgrid[0:64, 0:96]
    image = np.stack([(x * 2 + y) % 256, (x * 3) % 256, y * 4 % 256]).astype(np.uint8)
    store = tmp_path / "image.zarr"
    write_ome_zarr(store, image, mpp=1.0, hyfi_attrs={}, pyramid_levels=3, chunk=16)
    seen: list[np.ndarray] = []
    drawn = outputs.overlay_picture
    monkeypatch.setattr(
        outputs, "overlay_picture", lambda rgb, *a: seen.append(rgb) or drawn(rgb, *a)
    )
    with ZarrReader(store) as reader:
        levels = [reader.read_region(k, 0, 0, *reader.level_dimensions[k]) for k in range(3)]
    mask = np.zeros((32, 48), np.uint8)  # level 1's size
    outputs.write_overlay(tmp_path / "a.png", mask, image=str(store), title="t", level=1)
    np.testing.assert_allclose(seen[-1], levels[1].transpose(1, 2, 0) / 255.0)
    outputs.write_overlay(tmp_path / "b.png", mask, image=str(store), title="t", level=1, limit=30)
    np.testing.assert_allclose(seen[-1], levels[2].transpose(1, 2, 0) / 255.0)  # coarser


def test_regression_rows_keep_every_digit(tmp_path: Path) -> None:
    """``%.6g`` wrote a manifest's target 0.123456789 as 0.123457 (and the prediction beside
    it): what is read back is what was predicted and given."""
    import csv

    from hyfi_imaging.train.outputs import write_regressions

    pred = np.array([[0.30000001192092896, -1.5e-9]], dtype=np.float32)
    truth = np.array([[0.123456789, 12345678.9]])
    out = write_regressions(tmp_path / "r.csv", ["v1"], pred, ["a", "b"], truth)
    (row,) = csv.DictReader(out.open())
    assert [float(row[k]) for k in ("true_a", "true_b")] == [0.123456789, 12345678.9]
    assert [np.float32(row[k]) for k in ("pred_a", "pred_b")] == list(pred[0])


def test_hyfi_predicts_regression_rows_account_for_every_volume(tmp_path: Path) -> None:
    """A volume left out (status not ok) was dropped from the regression CSV (7 rows for 8
    volumes) where a classifier's keeps it with its status."""
    import csv

    from hyfi_imaging.train.outputs import write_regressions

    pred = np.array([[1.0], [2.0]], dtype=np.float32)
    out = write_regressions(tmp_path / "r.csv", ["v0", "v2"], pred, ["a"], np.array([[0.5], [1.5]]),
                            left_out=[(1, "v1", "failed"), (3, "v3", "missing")])  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert [(r["id"], r["status"], r["pred_a"], r["true_a"]) for r in rows] == [
        ("v0", "ok", "1.0", "0.5"), ("v1", "failed", "", ""),
        ("v2", "ok", "2.0", "1.5"), ("v3", "missing", "", ""),
    ]  # fmt: skip
