"""A user's own model, not a registered chain: ``verify_model``, ``apply_spatial`` and hyfi-train.

The models (``tests/workers/user_model.py``) are written the way torchvision
and timm write theirs -- ``forward`` is not the children in order, functions
sit between modules -- so the old chain-only checker crashed on them. Each
check runs under real ``mpiexec`` in float64 and compares with one process;
the broken halo exchange proves the check can fail.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyfi_imaging.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from _launch import results_per_world

from hyfi_imaging.models import create_model
from hyfi_imaging.parallel.engine import ParallelPlan
from hyfi_imaging.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
WORKER = WORKERS / "user_model.py"
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


#: (mode, grid, dp, micro-batches): cases compared with one process on a 38x45 image.
EXACT = [
    ("classify", (1, 2), 1, 1),
    ("classify", (2, 2), 1, 1),
    ("classify-cl", (1, 2), 1, 1),  # channels-last weights (FSDP2 used to refuse them)
    ("classify-cl1", (2, 2), 1, 1),  # the same, one image per step
    # BatchNorm(momentum=None) read its batch count on the meta device: every trace failed
    ("classify-cma", (1, 2), 1, 1),
    ("dense", (1, 2), 1, 1),
    ("dense", (2, 2), 1, 1),
    ("dense-mse", (2, 1), 1, 1),
    # data replicas and micro-batches: FSDP2's head/tile rule on the user's own modules
    ("classify", (1, 2), 2, 2),
    ("dense", (1, 2), 2, 2),
]
#: Cases that must fail: a broken halo exchange, a loss that cannot be computed on tiles.
MUST_FAIL = [("broken", (1, 2), 1, 1), ("dense-scalar-loss", (1, 2), 1, 1)]


def _case(mode: str, grid: tuple[int, int], dp: int, m: int) -> str:
    return ":".join(map(str, (mode, *grid, 38, 45, dp, m)))


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    """Every case, one launch per world size (start-up costs seconds, a case less)."""
    worlds: dict[int, list[str]] = {}
    for mode, grid, dp, m in [*EXACT, *MUST_FAIL]:
        worlds.setdefault(dp * grid[0] * grid[1], []).append(_case(mode, grid, dp, m))
    out: dict[str, dict[str, Any]] = {}
    for case, (result, job) in results_per_world(WORKER, worlds).items():
        out[case] = {**result, "returncode": job.returncode}
        if result.get("error") == "no result":
            out[case]["launch"] = job.describe()
    return out


@pytest.mark.mpi
@pytest.mark.parametrize(("mode", "grid", "dp", "m"), EXACT)
def test_user_model_matches_one_process(
    results: dict[str, dict[str, Any]], mode: str, grid: tuple[int, int], dp: int, m: int
) -> None:
    """Loss, outputs (a dense map stitched from tiles), input and parameter gradients, weights."""
    result = results[_case(mode, grid, dp, m)]
    assert result["returncode"] == 0, result
    assert result["ok"] and result["max_rel_error"] < 1e-9, result
    assert result["compared"] > 30
    if mode.startswith("classify-cl"):  # every convolution on the tiles ran channels-last
        assert result["spatial_convs"] > 0, result
        assert result["channels_last_convs"] == result["spatial_convs"], result


@pytest.mark.mpi
def test_verify_model_fails_on_a_broken_halo_exchange(results: dict[str, dict[str, Any]]) -> None:
    result = results[_case("broken", (1, 2), 1, 1)]
    assert result["returncode"] == 0, result
    assert not result["ok"]
    assert any("input_grad" in name for name in result["failed"]), result


@pytest.mark.mpi
def test_a_tile_mean_loss_on_a_dense_output_is_refused(results: dict[str, dict[str, Any]]) -> None:
    result = results[_case("dense-scalar-loss", (1, 2), 1, 1)]
    assert "per-pixel" in result["error"], result


def _user_model() -> Any:
    sys.path.insert(0, str(WORKERS))
    try:
        import user_model
    finally:
        sys.path.remove(str(WORKERS))
    return user_model


def test_verify_model_in_one_process() -> None:
    """No launcher: a world of one, the non-chain model runs its own forward (used to crash)."""
    from hyfi_imaging import verify_model
    from hyfi_imaging.parallel.launch import shutdown

    try:
        report = verify_model(_user_model().ResidualNet(), (30, 26), steps=1)
    finally:
        shutdown()
    assert report.ok and report.max_rel_error == 0.0
    assert report.format("ResidualNet").startswith("hyfi-verify: OK: ResidualNet, ")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_model_refuses_a_half_type(dtype: torch.dtype) -> None:
    """A half type ran and reported FAIL on an exact model (1.5-1.7 relative, float32's
    tolerance): its own rounding is as large as any layout error."""
    from hyfi_imaging import verify_model
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.parallel.launch import shutdown

    try:
        with pytest.raises(ConfigError, match="has no tolerance") as err:
            verify_model(_user_model().ResidualNet(), (30, 26), steps=1, dtype=dtype)
    finally:
        shutdown()
    assert "\n" not in str(err.value)


def test_a_channels_last_batch_trains_under_torchs_stage_checks() -> None:
    """torch's ``PipelineStage`` checks a stage's input strides against its contiguous meta
    trace (torch 2.11 always; 2.13 at debug level DETAIL): a channels-last batch and model
    were refused on an H200. The loss is the contiguous batch's, in float64."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from hyfi_imaging.parallel.engine import ParallelModel
    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    torch.manual_seed(0)
    model = _user_model().ResidualNet().to(torch.float64)
    x = torch.randn(2, 3, 30, 26, dtype=torch.float64)
    y = torch.tensor([0, 2])
    with torch.no_grad():
        expected = F.cross_entropy(copy.deepcopy(model)(x), y).item()
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        pc = init_parallel(Layout())
        cl = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        pm = ParallelModel(cl, pc, ParallelPlan(Layout()), image_hw=(30, 26))
        batch = x.contiguous(memory_format=torch.channels_last)
        loss = pm.train_step(pm.tile_of(batch), y)
    finally:
        dist.set_debug_level(level)
        shutdown()
    assert loss == pytest.approx(expected, rel=1e-12)


def test_apply_spatial_leaves_a_1x1_grid_alone_and_refuses_a_spatial_model() -> None:
    from hyfi_imaging import apply_spatial
    from hyfi_imaging.parallel import Neighbours, spatialize
    from hyfi_imaging.parallel.launch import init_parallel, shutdown

    model = _user_model().ResidualNet()
    try:
        pc = init_parallel(Layout())
        assert apply_spatial(model, pc) is None
        assert type(model.stem) is torch.nn.Conv2d
        spatialize(model, grid=(1, 2), tile=(0, 0), neighbours=Neighbours(right=1), group=None)
        with pytest.raises(ConfigError, match=r"already spatial.*pass the plain"):
            apply_spatial(model, pc)
    finally:
        shutdown()


def test_pipeline_of_a_model_that_is_not_a_chain_is_its_traced_form() -> None:
    """Cut into stages, it is its traced chain form (``parallel/chain_form.py``; what cannot be
    traced is refused in ``tests/test_any_model_pipeline.py``)."""
    model = _user_model().ResidualNet()
    ParallelPlan(Layout(pp=2)).validate(model, 2)
    ParallelPlan(Layout(pp=1)).validate(model, 2)  # one stage: the model itself


def test_create_model_from_a_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(WORKERS))
    model = create_model("user_model:build_classifier", num_classes=2, width=0.5)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 2)
    with pytest.raises(ConfigError, match="did you mean build_classifier"):
        create_model("user_model:build_clasifier")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        create_model("no_such_module:build")
    with pytest.raises(ConfigError, match="unknown option depth"):
        create_model("user_model:build_classifier", depth=3)
    with pytest.raises(ConfigError, match=r"not a torch\.nn\.Module"):
        create_model("collections:OrderedDict")


@pytest.mark.mpi
def test_hyfi_train_accepts_a_model_as_module_function(tmp_path: Path) -> None:
    """``model.name: user_model:build_classifier`` trained on 1x2 tiles (its stride is measured)."""
    from cohorts import preprocessed_cohort

    from hyfi_imaging.preprocess import PreprocessOptions

    options = PreprocessOptions(mpp=1.0, size=(74, 90))
    manifest = preprocessed_cohort(tmp_path, 4, options, seed=5, size=(256, 256), lesions=2)
    out = tmp_path / "run"
    sets = [
        f"data.manifest={manifest}", f"train.out_dir={out}", "train.epochs=1",
        "train.batch_size=1", "train.progress=false", "train.checkpoint_every_steps=2",
        "model.name=user_model:build_classifier", "parallel.spatial=1x2",
    ]  # fmt: skip
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "hyfi_imaging.cli.train",
           str(ROOT / "recipes" / "synthetic.yaml")]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    path = os.pathsep.join(p for p in (str(WORKERS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hyfi-train: done" in proc.stdout
    with (out / "metrics.csv").open() as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
    assert losses and all(math.isfinite(v) for v in losses)
