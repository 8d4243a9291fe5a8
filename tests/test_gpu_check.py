"""``benchmarks/gpu_check.py --dry-run``: every item of the GPU check runs on the CPU and is recorded.

The dry run is the CI check of the script a lent GPU machine runs first (issue 19, item 5):
the same code paths, tiny sizes, Gloo instead of NCCL, a simulated memory cap for the
largest-image search. Its figures mean nothing; what is checked is that every item ran,
that the facts the CPU can decide hold (resume is bitwise, hyfi-verify agrees, the search
finds the simulated caps), and that the report names the device and the date.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_dry_run_records_every_item(tmp_path: Path) -> None:
    out, md = tmp_path / "check" / "gpu_check.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n")
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--markdown", str(md)]
    # About a minute on two idle cores; the budgets leave room for a busy machine.
    for budget in ("a=120", "b=60", "c=60", "d=90", "e=120"):
        cmd += ["--budget", budget]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())

    items = report["items"]
    assert sorted(items) == ["a", "b", "c", "d", "e"]
    for key, item in items.items():
        assert item["status"] == "ok", (key, item.get("error"))
    a = items["a"]
    assert a["interrupted"] and a["losses_equal"] and a["backend"] == "gloo", a
    assert a["resumed_from_step"] >= a["killed_after_checkpoint"]
    assert items["b"]["ok"] and items["b"]["1x2"]["status"] == "skipped"
    assert {r["contender"] for r in items["c"]["rows"]} >= {"plain", "hyfi", "hyfi_ckpt"}
    assert all(r["flops"] > 0 for r in items["c"]["rows"])
    index = items["c"]["index"]  # per-pixel time on both sides of 2^31 elements (tiny here)
    assert index["sides"] == [64, 72] and index["elements"] == [64 * 64**2, 64 * 72**2]
    assert all(index[fmt]["ratio"] > 0 for fmt in ("nchw", "channels_last")), index
    predicted = items["c"]["predicted"]  # the speed model, on this CPU's calibrated row
    assert predicted["row"] == "cpu" and sorted(predicted["sides"]) == ["64", "96"]
    assert all(v > 0 for v in predicted["sides"].values()), predicted
    # the simulated caps (64 and 128): found exactly, 4x the pixels
    assert (items["d"]["plain"]["side"], items["d"]["hyfi_ckpt"]["side"]) == (64, 128)
    assert items["e"]["hyfi"]["status"] == "ok" and items["e"]["hyfi"]["compile_s"] > 0

    verdicts = report["verdicts"]
    assert verdicts and all(v.startswith(("PASS: ", "MISS: ")) for v in verdicts)
    assert all(v in proc.stdout for v in verdicts)
    # the table's row, and its compute figures measured here in each memory format
    assert sum("(c) hyfi-plan's speed model at" in v for v in verdicts) == 6
    for fmt in ("nchw", "channels_last"):
        figures = predicted["measured"][fmt]["figures"]
        assert figures["flops"] > 0 and figures["mem_bw"] > 0 and figures["op_overhead"] > 0
        assert sorted(predicted["measured"][fmt]["sides"]) == ["64", "96"]
    assert "need several GPUs" in report["multi_gpu"]

    text = md.read_text()
    assert text.startswith("# Benchmarks\n")  # appended to, never replaced
    section = text[text.index("\n## GPU check") :]
    assert report["device"]["name"] in section and report["date"] in section
    day = datetime.date.fromisoformat(report["date"][:10])
    assert abs((datetime.datetime.now(datetime.timezone.utc).date() - day).days) <= 1
    assert "dry run" in section.splitlines()[1]
    assert all(v in section for v in verdicts)

    # (d) again, the rest from this run: (c)'s rows come from it, and its probes bracket (d)
    again = tmp_path / "again.json"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--items", "d", "--earlier", str(out),
           "--out", str(again), "--markdown", str(md)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    second = json.loads(again.read_text())["items"]
    for key in "abce":
        assert second[key] == {**items[key], "from": out.name}, key
    d = second["d"]  # 64 and 128 fitted, 96 and 160 did not: converged, nothing probed again
    assert (d["plain"]["side"], d["hyfi_ckpt"]["side"]) == (64, 128), d
    assert {p["side"] for p in d["hyfi_ckpt"]["probes"]}.isdisjoint(
        p["side"] for p in items["d"]["hyfi_ckpt"]["probes"] if p["outcome"] == "ok"
    )
    assert f"from the earlier run `{out.name}`" in md.read_text().split("## GPU check")[-1]
    bad = subprocess.run([*cmd[:6], str(md)], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "not a gpu_check.py JSON record" in bad.stderr


def test_no_cuda_without_dry_run_is_one_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--markdown", str(tmp_path / "b.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr
    assert not out.exists() and not (tmp_path / "b.md").exists()


@functools.cache
def _script() -> ModuleType:
    """The script as a module (benchmarks/ is not a package); it imports torch lazily."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_peak_table_by_device_name() -> None:
    gc = _script()
    names = {
        "NVIDIA H100 80GB HBM3": 989.0,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H100 NVL": 835.0,
        "NVIDIA H200": 989.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA L4": None,
    }
    assert {n: gc.peak_tflops(n) for n in names} == names


def _search_below(
    limit: int, start: int, known: int, grow: float = 2.0
) -> tuple[int, int | None, bool, list[int]]:
    """``largest_side`` against a memory that holds sides up to ``limit``; and the probes."""
    probed: list[int] = []

    def fits(side: int) -> bool:
        probed.append(side)
        return side <= limit

    found = _script().largest_side(
        fits, start=start, known=known, grow=grow, deadline=time.monotonic() + 60
    )
    return (*found, probed)


@pytest.mark.parametrize(
    ("limit", "start", "known", "found"),
    [(1000, 64, 0, 992), (20000, 2048, 8192, None), (100, 256, 0, 96), (31, 32, 0, 0)],
)
def test_largest_side_doubles_then_bisects(limit: int, start: int, known: int, found: int) -> None:
    lo, hi, converged, probed = _search_below(limit, start, known)
    assert converged and hi is not None and lo <= limit < hi and lo % 32 == 0 and hi % 32 == 0
    assert hi - lo <= max(32, lo // _script().RESOLUTION)
    assert found is None or lo == found
    assert known not in probed and len(probed) == len(set(probed))


@pytest.mark.parametrize(("limit", "start"), [(22_300, 22_272), (22_300, 23_040), (21_800, 23_040)])
def test_largest_side_from_a_projection_steps_a_few_percent(limit: int, start: int) -> None:
    """Started at a projected side, the search brackets the limit with probes near it."""
    lo, hi, converged, probed = _search_below(limit, start, 8192, grow=1.03)
    assert (
        converged
        and hi is not None
        and lo <= limit < hi
        and hi - lo <= max(32, lo // _script().RESOLUTION)
    )
    assert probed[0] == start and len(probed) <= 5 and len(probed) == len(set(probed))
    assert all(abs(side / limit - 1) < 0.1 for side in probed)


def test_peak_line_projects_the_side_that_fills_the_memory() -> None:
    """The H200's (c) peaks of 2026-11-28 project the side its (d) probes found."""
    gc = _script()
    rows = [
        {"contender": "plain", "side": 4096, "status": "ok", "peak_gib": 14.2492},
        {"contender": "plain", "side": 8192, "status": "ok", "peak_gib": 56.0392},
        {"contender": "hyfi", "side": 8192, "status": "ok", "peak_gib": 56.0384},
        {"contender": "hyfi_ckpt", "side": 4096, "status": "ok", "peak_gib": 4.8999},
        {"contender": "hyfi_ckpt", "side": 8192, "status": "ok", "peak_gib": 18.5864},
        {"contender": "hyfi_cl", "side": 8192, "status": "oom"},
    ]
    fixed, per_px = gc.peak_fit(rows, "plain")
    assert per_px == pytest.approx((56.0392 - 14.2492) * 2**30 / (8192**2 - 4096**2))
    assert fixed == pytest.approx(14.2492 * 2**30 - per_px * 4096**2)
    assert gc.peak_fit(rows, "hyfi") is None and gc.peak_fit(rows, "hyfi_cl") is None
    capacity = 0.97 * 139.8 * 2**30
    plain = gc.projected_side((fixed, per_px), capacity)
    assert plain % 32 == 0 and 12_704 <= plain <= 12_800  # measured: 12800 fits, 13312 not
    ckpt = gc.peak_fit(rows, "hyfi_ckpt")
    assert ckpt is not None and 290 < ckpt[1] < 295  # bytes per pixel
    assert 16_896 < gc.projected_side(ckpt, capacity) < 25_600  # measured: fits, does not
    assert gc.projected_side(ckpt, ckpt[0]) == 0


def test_search_starts_at_the_side_the_measured_peaks_project() -> None:
    """(d) on the CPU with made-up (c) peaks that project 128^2 and --max-side 128: each
    search probes 128 (a real two-step run), then 160 (over the cap), and converges."""
    gc = _script()
    s = dataclasses.replace(gc.DRY, search_caps=None, max_side=128)
    gib = 2**30
    rows = [  # 1 KiB per pixel + 1 GiB: 128^2 fills 1.0160 GiB; 0.97 of 1.05 GiB = 1.0185
        {"contender": name, "side": side, "status": "ok", "peak_gib": 1 + side**2 * 1024 / gib}
        for name in ("plain", "hyfi_ckpt")
        for side in (32, 64)
    ]
    d = gc.item_d(s, {"rows": rows}, {"memory_gib": 1.05}, time.monotonic() + 240)
    assert d["status"] == "ok", d
    for name in ("plain", "hyfi_ckpt"):
        v = d[name]
        assert v["projected_side"] == 128 and v["bytes_per_pixel"] == pytest.approx(1024)
        assert [p["side"] for p in v["probes"]] == [128, 160], v["probes"]
        assert v["probes"][0]["outcome"] == "ok" and (v["side"], v["converged"]) == (128, True)
    assert d["pixel_ratio"] == 1.0 and d["projected_ratio"] == pytest.approx(1.0)
    assert d["alloc_conf"] == os.environ.get("PYTORCH_CUDA_ALLOC_CONF", gc.PROBE_ALLOC_CONF)


@pytest.mark.parametrize(
    ("limit", "known", "upper"), [(27_800, 8192, 28_384), (20_000, 12_736, 28_384)]
)
def test_largest_side_below_a_known_miss(limit: int, known: int, upper: int) -> None:
    """An earlier run's out-of-memory side is never probed again, nor anything above it."""
    gc = _script()
    probed: list[int] = []

    def fits(side: int) -> bool:
        probed.append(side)
        return side <= limit

    lo, hi, converged = gc.largest_side(fits, start=29_000, known=known, upper=upper,
                                        grow=1.03, deadline=time.monotonic() + 60)  # fmt: skip
    assert converged and hi is not None and lo <= limit < hi <= upper
    assert all(known < side < upper for side in probed) and len(probed) == len(set(probed))
    assert probed[0] == 28_384 * 100 // 103 // 32 * 32  # one step below the miss
    # a bracket already within 1/RESOLUTION of the side probes nothing
    assert gc.largest_side(fits, start=1, known=12_736, upper=13_088, deadline=0) == (
        12_736, 13_088, True,
    )  # fmt: skip


def test_earlier_bracket_from_probes() -> None:
    gc = _script()
    earlier = {"hyfi_ckpt": {"known": 8192, "probes": [
        {"side": 28_384, "outcome": "oom"}, {"side": 27_552, "outcome": "timeout"},
        {"side": 26_720, "outcome": "ok"}, {"side": 29_000, "outcome": "oom"}]}}  # fmt: skip
    assert gc.earlier_bracket(earlier, "hyfi_ckpt") == (26_720, 28_384)
    assert gc.earlier_bracket(earlier, "plain") == (0, None)
    assert gc.earlier_bracket(None, "plain") == (0, None)


def test_largest_side_stops_when_a_probe_runs_out_of_time() -> None:
    gc = _script()
    answers = iter([True, None])
    lo, hi, converged = gc.largest_side(
        lambda side: next(answers), start=64, deadline=time.monotonic() + 60
    )
    assert (lo, hi, converged) == (64, None, False)


def _gpu_like_items(gc: ModuleType) -> dict[str, dict[str, Any]]:
    """Records as a one-H100 run could leave them: out of memory at 8192^2, a compile error."""
    oom = {"status": "oom", "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate"}
    rows = []
    for side, flops, steps in ((4096, 8.12e12, (0.0250, 0.0262, 0.0190, 0.0195, 0.041)),
                               (8192, 32.48e12, (None, None, None, None, 0.170))):  # fmt: skip
        results: list[dict[str, Any]] = [{"flops": flops}]
        for name, t in zip(gc.CONTENDERS, steps, strict=True):
            one = {"contender": name, "side": side}
            results.append({**one, **oom} if t is None else {**one, "status": "ok", "step_s": t})
        rows += gc.step_rows(side, results, 989.0, "")
    probes = [{"side": 16384, "outcome": "oom"}, {"side": 12288, "outcome": "ok"}]
    return {
        "a": {"status": "ok", "backend": "nccl", "device": "cuda", "steps": 24,
              "killed_after_checkpoint": 4, "steps_logged_when_killed": 5, "interrupted": True,
              "resumed_from_step": 4, "losses_equal": False, "max_abs_loss_diff": 1.2e-7,
              "losses": [0.7] * 24, "resumed_losses": [0.7] * 24, "seconds": 48.0},
        "b": {"status": "ok", "ok": True, "max_rel_error": 3e-12, "compared": 800, "failed": [],
              "backend": "nccl", "1x2": {"status": "skipped"}, "seconds": 14.0},
        "c": {"status": "ok", "model": "resnet50", "rows": rows, "error": None, "seconds": 70.0,
              "predicted": {"row": "h100", "sides": {"4096": 0.0226, "8192": 0.09},
                            "measured": {"channels_last": {"sides": {"4096": 0.0300, "8192": 0.12},
                                         "figures": {"flops": 1.8e14, "mem_bw": 3.1e12,
                                                     "op_overhead": 6e-6, "px_half": 5000.0,
                                                     "fresh_s": []}}}}},
        "d": {"status": "ok", "pixel_ratio": (20480 / 9216) ** 2, "error": None, "seconds": 128.0,
              "projected_ratio": 891.5 / 291.9,
              "plain": {"side": 9216, "upper": 9344, "converged": True, "known": 8192,
                        "probes": probes, "projected_side": 9184, "bytes_per_pixel": 891.5},
              "hyfi_ckpt": {"side": 20480, "upper": None, "converged": False, "known": 8192,
                            "probes": probes, "projected_side": None, "bytes_per_pixel": 291.9}},
        "e": {"status": "ok", "backend": "inductor", "side": 4096, "error": None, "seconds": 80.0,
              "hyfi": {"contender": "hyfi", "status": "ok", "compile_s": 55.0, "step_s": 0.018,
                       "eager_step_s": 0.026, "speedup": 0.026 / 0.018},
              "hyfi_ckpt": {"contender": "hyfi_ckpt", "status": "error", "refused": False,
                            "error": "BackendCompilerFailed: backend='inductor' raised: ..."}},
    }  # fmt: skip


def test_verdicts_and_markdown_of_a_gpu_like_run(tmp_path: Path) -> None:
    """What a GPU run records is judged and written without a fault (no GPU needed)."""
    gc = _script()
    items = _gpu_like_items(gc)
    by = {(r["contender"], r["side"]): r for r in items["c"]["rows"]}
    assert by["hyfi_cl", 4096]["peak_share"] == pytest.approx(8.12e12 / 0.0195 / 989e12)
    assert by["hyfi_cl", 4096]["overhead"] == pytest.approx(0.0195 / 0.0190 - 1)
    assert "overhead" not in by["plain", 4096] and by["hyfi", 8192]["status"] == "oom"
    lines = gc.verdicts(items, 989.0, "NVIDIA H100 80GB HBM3")
    text = "\n".join(lines)
    assert lines[0].startswith("MISS: (a)") and "1.2e-07" in lines[0]
    assert lines[1].startswith("PASS: (b)")
    assert "PASS: (c) hyfi 1x1 at 4096^2, share of peak: 416.4 TFLOP/s = 42.1 %" in text
    assert "PASS: (c) hyfi 1x1 at 4096^2, overhead over plain PyTorch" in text
    assert "MISS: (c) hyfi 1x1 at 8192^2: did not run (OutOfMemoryError" in text
    by_hyfi = by["hyfi", 4096]["step_s"]
    assert (
        f"PASS: (c) hyfi-plan's speed model at 4096^2 (row h100): predicted 22.6 ms, measured "
        f"{1e3 * by_hyfi:.1f} ms (hyfi 1x1, NCHW): {100 * (0.0226 / by_hyfi - 1):+.1f} %"
    ) in text
    assert "MISS: (c) hyfi-plan's speed model at 8192^2 (row h100): predicted 90.0 ms; hyfi" in text
    by_cl = by["hyfi_cl", 4096]["step_s"]
    assert (
        f"MISS: (c) hyfi-plan's speed model at 4096^2 (row h100 with figures measured here, "
        f"channels-last): predicted 30.0 ms, measured {1e3 * by_cl:.1f} ms (hyfi 1x1, "
        f"channels-last): {100 * (0.0300 / by_cl - 1):+.1f} %"
    ) in text
    assert "(row h100 with figures measured here, NCHW)" not in text  # not measured
    assert "PASS: (d)" in text and "4.94x" in text and "time cap" in text
    assert (
        "MISS: (d) memory per pixel, hyfi deep ckpt + streamed stem / plain: 292 vs 892 bytes "
        "(the slopes of (c)'s peaks) = 3.05x the pixels in the same memory (target >= 4x)"
    ) in text
    assert "PASS: (e) torch.compile of hyfi 1x1: works (inductor)" in text
    assert "MISS: (e) torch.compile of hyfi 1x1 + deep ckpt + streamed stem: fails" in text
    report = {
        "date": "2026-11-27 10:00 UTC", "dry_run": False, "seconds": 440.0,
        "device": {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "count": 1,
                   "torch": "2.13.0+cu128", "cuda": "12.8", "cudnn": 91000, "nccl": "2.27.3"},
        "peak_tflops": 989.0, "peak_source": "table", "multi_gpu": "Several NCCL ranks ...",
        "items": {k: {"title": gc.ITEMS[k], **v} for k, v in items.items()}, "verdicts": lines,
    }  # fmt: skip
    md = gc._markdown(report, tmp_path / "gpu_check.json")
    assert "## GPU check, 2026-11-27 10:00 UTC: NVIDIA H100 80GB HBM3\n" in md
    assert "| resnet50 bf16, batch 1 |" in md
    assert "| hyfi_cl | 4096 | 19.5 | 416.4 | 42.1 % | +2.6 % |" in md
    assert "| hyfi_ckpt | 20480 | 419.4 |  | 292 | 16384: oom, 12288: ok |" in md
    assert "| plain | 9216 | 84.9 | 9184 | 892 | 16384: oom, 12288: ok |" in md
    assert "| channels_last | 180.0 | 3100 | 6.0 | 5000 |" in md


def test_a_timed_out_run_says_what_it_reached() -> None:
    """A worker killed at its deadline is recorded with the last phase it printed."""
    gc = _script()
    out = "PHASE 3.1 hyfi 64^2 built\nRESULT {}\nPHASE 95.2 hyfi 64^2 compiling\n"
    assert gc.Run(None, out, "").error() == (
        "timed out (its time budget ran out; reached at 95.2 s: hyfi 64^2 compiling)"
    )
    assert gc.Run(None, "", "").reached() == "before any step"
    assert gc.Run(1, out, "RuntimeError: boom\n").error() == "RuntimeError: boom"
