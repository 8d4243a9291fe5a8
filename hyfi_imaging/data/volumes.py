"""Deterministic synthetic volumes: Gaussian random fields to regress, blobs to segment.

Why generated, not shipped: the repository holds no binaries, and a generator
with a known answer is a better test than a downloaded sample. Two kinds:

* **Gaussian random fields** (:func:`gaussian_random_field`): white noise from
  a seeded generator, Fourier transformed, shaped by ``sqrt(P(k))`` with
  ``P(k) = A · (k / k_pivot)^-n``, transformed back. On a periodic grid this
  is exact: the field's power spectrum *is* ``A k^-n`` up to sampling noise,
  so the spectral index ``n`` (and the amplitude ``A``) is a regression target
  whose true value is known, recoverable by :func:`fit_spectral_index`.
  Like CosmoFlow's four redshift channels, a volume has one channel per
  redshift ``z``: the same field scaled by the linear growth ``1 / (1 + z)``
  (a matter-dominated universe), so every channel has the same index.
* **Blobs** (:func:`blob_volume`): random ellipsoids (spheres when the radii
  agree), each a constant intensity, on a dark background plus Gaussian noise,
  with an exact ``uint8`` label volume (blob ``i`` is label ``i``; a later blob
  covers an earlier one). Membership is the analytic test of the voxel centre
  (:meth:`Blob.contains`), so labels are exact, not rasterised approximations.

Both are reproducible bit for bit: every random number comes from
``numpy.random.Generator(PCG64(SeedSequence([...])))`` and the arithmetic is
numpy's, in a fixed order. Cohort writers store each volume as an OME-Zarr
volume (:mod:`hyfi_imaging.io.volume_store`) and list them in a volume
manifest (:mod:`hyfi_imaging.data.volume_manifest`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyfi_imaging.data.volume_manifest import VolumeRow, write_volume_manifest
from hyfi_imaging.errors import ConfigError

__all__ = [
    "K_PIVOT",
    "REDSHIFTS",
    "Blob",
    "blob_volume",
    "fit_spectral_index",
    "gaussian_random_field",
    "grf_volume",
    "radial_power_spectrum",
    "write_blob_cohort",
    "write_grf_cohort",
]

#: Default redshifts of the four channels of a field volume (CosmoFlow has four).
REDSHIFTS = (0.0, 0.5, 1.0, 1.5)
#: Wavenumber (cycles per voxel) at which ``P(k) = amplitude``: a wavelength of 16 voxels.
K_PIVOT = 1.0 / 16.0


def _rng(*seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))


def _wavenumbers(shape: tuple[int, ...]) -> np.ndarray:
    """``|k|`` in cycles per voxel on the grid of ``rfftn`` of an array of ``shape``."""
    freqs = [np.fft.fftfreq(n) for n in shape[:-1]] + [np.fft.rfftfreq(shape[-1])]
    grids = np.meshgrid(*freqs, indexing="ij", sparse=True)
    k2 = sum(g * g for g in grids)
    return np.sqrt(np.asarray(k2, dtype=np.float64))


def _check_shape(shape: int | Sequence[int]) -> tuple[int, int, int]:
    s = (shape,) * 3 if isinstance(shape, (int, np.integer)) else tuple(shape)
    if len(s) != 3 or min(int(n) for n in s) < 4:
        raise ConfigError(f"volume shape {shape!r}", "needs 3 sizes >= 4", "use e.g. 64")
    return int(s[0]), int(s[1]), int(s[2])


def gaussian_random_field(
    shape: int | Sequence[int], spectral_index: float, *, amplitude: float = 1.0, seed: int
) -> np.ndarray:
    """A periodic Gaussian random field of ``shape`` with ``P(k) = A (k / k_pivot)^-n``, float32.

    The power spectrum is defined as ``|FFT(field)|^2 / N`` (``N`` voxels), the
    normalisation :func:`radial_power_spectrum` measures; the mean (``k = 0``) is 0.
    """
    s = _check_shape(shape)
    if not amplitude > 0 or not np.isfinite(spectral_index):
        raise ConfigError(
            f"field n={spectral_index} A={amplitude}", "needs a finite n and A > 0", "fix them"
        )
    noise = _rng(seed).standard_normal(s)
    k = _wavenumbers(s)
    power = np.zeros_like(k)
    nonzero = k > 0
    power[nonzero] = amplitude * (k[nonzero] / K_PIVOT) ** (-float(spectral_index))
    # White noise has E|FFT|^2 = N per mode: scaling by sqrt(P) gives |FFT(field)|^2 / N = P.
    field = np.fft.irfftn(np.fft.rfftn(noise) * np.sqrt(power), s=s, axes=(0, 1, 2))
    return field.astype(np.float32)


def grf_volume(
    shape: int | Sequence[int],
    spectral_index: float,
    *,
    amplitude: float = 1.0,
    seed: int,
    redshifts: Sequence[float] = REDSHIFTS,
) -> np.ndarray:
    """A ``(len(redshifts), Z, Y, X)`` float32 volume: one field, one channel per redshift.

    Channel ``c`` is the field times the linear growth ``1 / (1 + z_c)``.
    """
    if not redshifts or min(redshifts) < 0:
        raise ConfigError(f"redshifts {list(redshifts)}", "need one or more z >= 0", "fix them")
    field = gaussian_random_field(shape, spectral_index, amplitude=amplitude, seed=seed)
    return np.stack([field * np.float32(1.0 / (1.0 + z)) for z in redshifts])


def _modes(field: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per ``rfftn`` mode: shell index, ``|k|``, power ``|FFT|^2 / N`` and multiplicity.

    Shells are one fundamental mode (of the longest axis) wide; modes in the
    ``k = 0`` shell and beyond the Nyquist sphere are left out. ``rfftn`` holds
    half the modes: those of the ``x = 0`` (and even-length Nyquist) plane once,
    the rest for themselves and their conjugate, hence the multiplicity.
    """
    shape = field.shape
    k = _wavenumbers(shape)
    power = np.abs(np.fft.rfftn(field.astype(np.float64))) ** 2 / field.size
    weight = np.full(k.shape, 2.0)
    weight[..., 0] = 1.0
    if shape[-1] % 2 == 0:
        weight[..., -1] = 1.0
    fundamental = 1.0 / max(shape)
    shell = np.rint(k / fundamental).astype(np.int64).ravel()
    keep = (shell > 0) & (shell <= int(0.5 / fundamental))
    return shell[keep], k.ravel()[keep], power.ravel()[keep], weight.ravel()[keep]


def _shell_means(shell: np.ndarray, weight: np.ndarray, *values: np.ndarray) -> list[np.ndarray]:
    """Per non-empty shell: its mode count, then the mean of each of ``values``."""
    counts = np.bincount(shell, weights=weight)
    used = counts > 0
    means = [np.bincount(shell, weights=weight * v)[used] / counts[used] for v in values]
    return [counts[used], *means]


def radial_power_spectrum(field: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k, P)``: the power spectrum ``|FFT|^2 / N`` averaged over shells of ``|k|``.

    ``k`` is the mean wavenumber (cycles per voxel) of the modes of each shell
    (one fundamental mode of the longest axis wide); ``k = 0`` is left out.
    """
    shell, k, power, weight = _modes(field)
    _, k_mean, p_mean = _shell_means(shell, weight, k, power)
    return k_mean, p_mean


def fit_spectral_index(
    field: np.ndarray, *, k_range: tuple[float, float] = (1.0 / 32.0, 0.25)
) -> tuple[float, float]:
    """``(n, A)``: a least-squares power law fitted to the radially averaged spectrum.

    Why shells of *log* power against mean *log* k: with ``P`` falling as
    ``k^-n``, the mean power of a shell is not the power at its mean ``k``
    (a steep spectrum biases the slope by ~0.1 on a 32^3 grid). Each mode's
    power is ``P(k)`` times an exponential variable, whose log has the
    constant mean ``-gamma`` (Euler's constant), so the shell means of
    ``log P`` lie exactly on a line of slope ``-n`` in mean ``log k``; ``A``
    is the line at :data:`K_PIVOT`, corrected by ``gamma``. Shells with mean
    ``k`` in ``k_range`` (cycles per voxel) are fitted, each weighted by its
    mode count (the inverse variance of its mean).
    """
    shell, k, power, weight = _modes(field)
    positive = power > 0
    shell, k, power, weight = shell[positive], k[positive], power[positive], weight[positive]
    counts, log_k, log_p = _shell_means(shell, weight, np.log(k / K_PIVOT), np.log(power))
    k_shell = np.exp(log_k) * K_PIVOT
    sel = (k_shell >= k_range[0]) & (k_shell <= k_range[1])
    if sel.sum() < 2:
        raise ConfigError(
            f"power-law fit over k {k_range}",
            f"only {int(sel.sum())} shells of a {field.shape} field lie in the range",
            "use a larger field or a wider k range",
        )
    # Weighted by mode count: the variance of a shell's mean log power is ~1.64 / count.
    slope, intercept = np.polyfit(log_k[sel], log_p[sel], 1, w=np.sqrt(counts[sel]))
    return -float(slope), float(np.exp(intercept + np.euler_gamma))


@dataclass(frozen=True)
class Blob:
    """One ellipsoid: centre ``(z, y, x)`` in voxels, radii along its own axes, a rotation.

    ``rotation`` is a 3x3 orthonormal matrix whose columns are the ellipsoid's
    axes in ``(z, y, x)``; ``label`` is its value in the label volume.
    """

    label: int
    center: tuple[float, float, float]
    radii: tuple[float, float, float]
    rotation: tuple[tuple[float, float, float], ...]
    intensity: float

    def contains(self, z: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Whether voxel centres ``(z, y, x)`` (broadcastable arrays) lie in the ellipsoid."""
        d = (z - self.center[0], y - self.center[1], x - self.center[2])
        total = np.zeros(np.broadcast_shapes(*(np.shape(v) for v in d)))
        for axis in range(3):
            q = sum(self.rotation[row][axis] * d[row] for row in range(3))
            total = total + (q / self.radii[axis]) ** 2
        return np.asarray(total <= 1.0)


def _random_rotation(rng: np.random.Generator) -> tuple[tuple[float, float, float], ...]:
    # QR of a Gaussian matrix with the signs fixed is a uniformly random rotation.
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return tuple((float(a), float(b), float(c)) for a, b, c in q)


def blob_volume(
    shape: int | Sequence[int],
    *,
    seed: int,
    n_blobs: int = 8,
    radius_range: tuple[float, float] = (3.0, 8.0),
    spheres: bool = False,
    noise: float = 0.1,
    background: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, list[Blob]]:
    """``(image (1, Z, Y, X) float32, labels (Z, Y, X) uint8, blobs)`` of random ellipsoids.

    Blob ``i`` (from 1) has label ``i`` and an intensity uniform in
    ``[0.5, 1]``; later blobs cover earlier ones. The image is the intensity
    (``background`` outside) plus Gaussian noise of standard deviation ``noise``.
    """
    s = _check_shape(shape)
    if not 1 <= n_blobs <= 255 or not 0 < radius_range[0] <= radius_range[1]:
        raise ConfigError(
            f"blobs n={n_blobs} radii={radius_range}",
            "need 1-255 blobs (uint8 labels) and 0 < min radius <= max radius",
            "fix them",
        )
    rng = _rng(seed)
    blobs = []
    for label in range(1, n_blobs + 1):
        # Drawn in a fixed order, always all of them: options do not shift the stream.
        c = rng.uniform(0.0, 1.0, 3) * np.array(s)
        r = rng.uniform(*radius_range, 3)
        rotation = _random_rotation(rng)
        intensity = float(rng.uniform(0.5, 1.0))
        radii = (float(r[0]),) * 3 if spheres else (float(r[0]), float(r[1]), float(r[2]))
        center = (float(c[0]), float(c[1]), float(c[2]))
        blobs.append(Blob(label, center, radii, rotation, intensity))
    labels = np.zeros(s, np.uint8)
    image = np.full(s, background, np.float32)
    for blob in blobs:
        # Only the bounding cube of the blob is tested; voxel centres are integer coordinates.
        reach = max(blob.radii)
        lo = [max(0, int(np.floor(c - reach))) for c in blob.center]
        hi = [min(n, int(np.ceil(c + reach)) + 1) for c, n in zip(blob.center, s, strict=True)]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        z, y, x = np.ogrid[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]]
        inside = blob.contains(z, y, x)
        box = (slice(lo[0], hi[0]), slice(lo[1], hi[1]), slice(lo[2], hi[2]))
        labels[box][inside] = blob.label
        image[box][inside] = np.float32(blob.intensity)
    image += rng.standard_normal(s).astype(np.float32) * np.float32(noise)
    return image[None], labels, blobs


def _cohort_dir(out: str | os.PathLike[str], n: int) -> Path:
    if n < 1:
        raise ConfigError(f"cohort of {n} volumes", "needs at least one volume", "use n >= 1")
    path = Path(out)
    if (path / "manifest.csv").exists():
        raise ConfigError(str(path), "already holds a manifest", "choose an empty output folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_grf_cohort(
    out: str | os.PathLike[str],
    n: int,
    *,
    size: int = 64,
    seed: int = 0,
    index_range: tuple[float, float] = (1.0, 3.0),
    amplitude_range: tuple[float, float] = (0.5, 2.0),
    redshifts: Sequence[float] = REDSHIFTS,
    voxel_size: float = 1.0,
    chunks: int = 32,
) -> Path:
    """Write ``n`` field volumes ``grf_000.zarr, ...`` and their ``manifest.csv``; return its path.

    Volume ``i`` has index and amplitude drawn uniformly from the ranges (in
    order, from ``seed``) and its field from seed ``seed * 100003 + i``; its
    targets are ``spectral_index`` and ``amplitude``.
    """
    from hyfi_imaging.io.volume_store import write_ome_zarr_volume

    path = _cohort_dir(out, n)
    draws = _rng(seed).uniform(0.0, 1.0, (n, 2))
    rows = []
    for i in range(n):
        index = index_range[0] + (index_range[1] - index_range[0]) * float(draws[i, 0])
        amp = amplitude_range[0] + (amplitude_range[1] - amplitude_range[0]) * float(draws[i, 1])
        vid, vseed = f"grf_{i:03d}", seed * 100003 + i
        volume = grf_volume(size, index, amplitude=amp, seed=vseed, redshifts=redshifts)
        source = f"hyfi_imaging.data.volumes.grf_volume seed={vseed}"
        write_ome_zarr_volume(
            path / f"{vid}.zarr",
            volume,
            voxel_size=(voxel_size,) * 3,
            chunks=chunks,
            channel_names=[f"z={z:g}" for z in redshifts],
            name=vid,
            attrs={"source": source, "spectral_index": index, "amplitude": amp},
        )
        rows.append(
            VolumeRow(
                vid,
                f"{vid}.zarr",
                (size, size, size),
                (voxel_size,) * 3,
                {"spectral_index": index, "amplitude": amp},
                source=source,
            )
        )
    return write_volume_manifest(rows, path / "manifest.csv")


def write_blob_cohort(
    out: str | os.PathLike[str],
    n: int,
    *,
    shape: int | Sequence[int] = 64,
    seed: int = 0,
    n_blobs: int = 8,
    radius_range: tuple[float, float] = (3.0, 8.0),
    noise: float = 0.1,
    voxel_size: Sequence[float] = (1.0, 1.0, 1.0),
    chunks: int = 32,
) -> Path:
    """Write ``n`` blob volumes ``blobs_000.zarr, ...`` with label images ``labels/blobs``.

    Volume ``i`` uses seed ``seed * 100003 + i``; the manifest's ``labels``
    column names the label image, and its one target is the blob count.
    """
    from hyfi_imaging.io.volume_store import write_ome_zarr_volume

    path = _cohort_dir(out, n)
    s = _check_shape(shape)
    vs = (float(voxel_size[0]), float(voxel_size[1]), float(voxel_size[2]))
    rows = []
    for i in range(n):
        vid, vseed = f"blobs_{i:03d}", seed * 100003 + i
        image, labels, blobs = blob_volume(
            s, seed=vseed, n_blobs=n_blobs, radius_range=radius_range, noise=noise
        )
        source = f"hyfi_imaging.data.volumes.blob_volume seed={vseed}"
        write_ome_zarr_volume(
            path / f"{vid}.zarr",
            image,
            voxel_size=vs,
            chunks=chunks,
            channel_names=["intensity"],
            name=vid,
            attrs={"source": source, "blobs": len(blobs)},
            labels={"blobs": labels},
        )
        rows.append(
            VolumeRow(
                vid, f"{vid}.zarr", s, vs, {"count": float(len(blobs))}, "blobs", source=source
            )
        )
    return write_volume_manifest(rows, path / "manifest.csv")
