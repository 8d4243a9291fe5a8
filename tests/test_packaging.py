"""The wheel, installed without the repository, has everything the commands look for.

Why a real wheel and a real install: a source checkout (and an editable
install) finds ``recipes/`` and the dataset cards beside the package, which is
exactly what hides a wheel that forgot them. The wheel is built from a copy
of the tree (``pip wheel --no-build-isolation``, so no network is needed and
the checkout gets no ``build/`` folder), installed by pip into an empty virtual
environment, and only then given this environment's dependencies (a ``.pth``
file), so that pip never sees — let alone replaces — the checkout's install.
The installed interpreter runs isolated (``-I``: no ``PYTHONPATH``, no
current folder), so what it imports is the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("recipes", "datasets", "models")


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the package, its data folders and its metadata."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("hyfi_imaging", *SHIPPED):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(src)],
        cwd=dist,
    )  # fmt: skip
    (found,) = dist.glob("hyfi_imaging-*.whl")
    return found


def test_wheel_holds_every_module_and_the_shipped_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "hyfi_imaging").rglob("*.py")}
    assert modules - names == set(), "a package is missing from [tool.setuptools] packages"
    for folder in SHIPPED:
        files = {p.name for p in (REPO / folder).iterdir() if p.suffix in (".yaml", ".md")}
        assert files, folder
        assert {f"hyfi_imaging/share/{folder}/{f}" for f in files} <= names


def test_test_tools_are_an_extra_not_a_dependency(wheel: Path) -> None:
    """pytest comes with the ``test`` extra (scripts/setup.sh installs it), not with the library."""
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
    requires = re.findall(r"^Requires-Dist: (.+)$", meta.decode(), flags=re.MULTILINE)
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if r.startswith("pytest")], runtime
    test_extra = [r.split(";")[0].strip() for r in requires if 'extra == "test"' in r]
    assert {"pytest>=8", "pytest-timeout>=2.3"} <= set(test_extra), requires
    extras = re.findall(r'-e "\.\[([^\]]*)\]"', (REPO / "scripts" / "setup.sh").read_text())
    assert extras and "test" in extras[0].split(","), extras


def test_installed_wheel_finds_the_recipes(wheel: Path, tmp_path: Path) -> None:
    """From an installed wheel, the demo's recipe and ``hyfi-train synthetic`` resolve."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        cwd=tmp_path,
    )  # fmt: skip
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    # Dependencies (torch, pydantic ...) come from this environment, after the install.
    (purelib / "_hyfi_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    probe = """if True:
        import json, sys
        from pathlib import Path
        import hyfi_imaging
        from hyfi_imaging.resources import data_root, recipe_path
        from hyfi_imaging.train.config import load_recipe
        recipe = load_recipe(Path("synthetic"), ["data.manifest=m.csv", "train.out_dir=o"])
        print(json.dumps({
            "package": hyfi_imaging.__file__,
            "root": str(data_root()),
            "recipe": str(recipe_path("synthetic")),
            "classes": recipe.data.classes,
            "model": recipe.model.name,
        }))
    """
    got = json.loads(_run([str(python), "-I", "-c", probe], cwd=tmp_path).stdout)
    assert Path(got["package"]).is_relative_to(purelib), got
    assert Path(got["root"]) == purelib / "hyfi_imaging" / "share"
    assert Path(got["recipe"]) == purelib / "hyfi_imaging" / "share" / "recipes" / "synthetic.yaml"
    assert got["classes"] == ["0", "1"] and got["model"] == "resnet18"  # the dataset card was read
    # The demo itself, from its console script: it checks its recipe before any work.
    demo = _run(
        [str(venv / "bin" / "hyfi-demo"), "--out", str(tmp_path / "demo"), "--slides", "1",
         "--slide-size", "256", "--size", "128", "--workers", "1", "--no-train"],
        cwd=tmp_path,
    )  # fmt: skip
    assert f"recipe: {got['recipe']}" in demo.stdout, demo.stdout


def test_recipes_by_name_in_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare name finds a shipped recipe; a path is taken as given; a wrong name lists them."""
    from hyfi_imaging.errors import ConfigError
    from hyfi_imaging.resources import data_root, find_recipe, recipe_names
    from hyfi_imaging.train.config import load_recipe

    assert data_root() == REPO  # a checkout: the folders beside the package
    assert {"synthetic", "camelyon16-8k", "panda"} <= set(recipe_names())
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    sets = ["data.manifest=m.csv", "train.out_dir=o"]
    assert load_recipe(Path("synthetic"), sets).name == "synthetic"
    assert load_recipe(Path("synthetic.yaml"), sets).name == "synthetic"
    assert find_recipe(Path("elsewhere/synthetic.yaml")) == Path("elsewhere/synthetic.yaml")
    with pytest.raises(ConfigError, match=r"no such recipe file; .*synthetic") as err:
        load_recipe(Path("synthetc"))
    assert "\n" not in str(err.value)
    (tmp_path / "synthetic").write_text("a file here wins: {")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(Path("synthetic"))
