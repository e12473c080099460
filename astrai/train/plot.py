"""Line-chart PNGs (loss curves) drawn with numpy + zlib + struct: no plotting dependency.

The canvas is an RGB uint8 array: white background, an axes box with tick marks, tick labels and titles in a
built-in 5x7 bitmap font (upper case; lower case is drawn as upper case), one colour per series and a legend in
the emptiest corner of the plot box. Non-finite points (and y <= 0 with `log_y`) are skipped and break the
line; an isolated point is drawn as a small square. The PNG uses filter type 0 on every row and is written
atomically.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

from astrai.train.metrics import atomic_write_bytes, read_metrics

# 5x7 glyphs: 7 rows top to bottom, each row two hex digits whose low 5 bits are the pixels (bit 4 = left).
_GLYPHS = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c", "A": "0e1111111f1111", "B": "1e11111e11111e",
    "C": "0e11101010110e", "D": "1c12111111121c", "E": "1f10101e10101f", "F": "1f10101e101010",
    "G": "0e11101711110f", "H": "1111111f111111", "I": "0e04040404040e", "J": "0702020202120c",
    "K": "11121418141211", "L": "1010101010101f", "M": "111b1515111111", "N": "11111915131111",
    "O": "0e11111111110e", "P": "1e11111e101010", "Q": "0e111111151209", "R": "1e11111e141211",
    "S": "0f10100e01011e", "T": "1f040404040404", "U": "1111111111110e", "V": "11111111110a04",
    "W": "1111111515150a", "X": "11110a040a1111", "Y": "1111110a040404", "Z": "1f01020408101f",
    " ": "00000000000000", ".": "00000000000c0c", "-": "0000001f000000", "+": "0004041f040400",
    ":": "000c0c000c0c00", "/": "00010204081000", "(": "02040808080402", ")": "08040202020408",
    "_": "0000000000001f", "%": "18190204081303", "=": "00001f001f0000", ",": "000000000c0408",
    "?": "0e110102040004", "[": "0e08080808080e", "]": "0e02020202020e", "#": "0a0a1f0a1f0a0a",
}  # fmt: skip
_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]  # fmt: skip
_INK = (40, 40, 40)
_BITS = np.array([16, 8, 4, 2, 1], dtype=np.uint8)


def _glyph(ch: str) -> np.ndarray:
    rows = bytes.fromhex(_GLYPHS.get(ch.upper(), _GLYPHS["?"]))
    return (np.frombuffer(rows, dtype=np.uint8)[:, None] & _BITS) > 0


def text_mask(s: str) -> np.ndarray:
    """Bool mask [7, 6*len-1] of `s` in the 5x7 font with one blank column between glyphs."""
    if not s:
        return np.zeros((7, 0), dtype=bool)
    gap = np.zeros((7, 1), dtype=bool)
    return np.concatenate([part for ch in s for part in (_glyph(ch), gap)][:-1], axis=1)


def _blit(img: np.ndarray, mask: np.ndarray, x: int, y: int, color: tuple[int, int, int]) -> None:
    """Paint `mask` with its top-left at (x, y), clipped to the image."""
    h, w = img.shape[:2]
    x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + mask.shape[1], w), min(y + mask.shape[0], h)
    if x0 < x1 and y0 < y1:
        img[y0:y1, x0:x1][mask[y0 - y : y1 - y, x0 - x : x1 - x]] = color


def _polyline(img: np.ndarray, u: np.ndarray, v: np.ndarray, ok: np.ndarray, color: tuple, box: tuple) -> None:
    """Draw 2-px segments between consecutive valid pixel points, clipped inside `box` = (left, top, right, bottom)."""
    seg = np.flatnonzero(ok[:-1] & ok[1:])
    for chunk in np.array_split(seg, max(1, seg.size // 4096)):  # bounds memory for long, noisy series
        du, dv = u[chunk + 1] - u[chunk], v[chunk + 1] - v[chunk]
        n = np.maximum(np.abs(du), np.abs(dv)).astype(np.int64) + 2
        k = np.repeat(np.arange(chunk.size), n)
        t = (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)) / (n[k] - 1)
        xs, ys = np.rint(u[chunk][k] + t * du[k]).astype(int), np.rint(v[chunk][k] + t * dv[k]).astype(int)
        for dx, dy in ((0, 0), (1, 0), (0, 1)):
            x, y = xs + dx, ys + dy
            inside = (x > box[0]) & (x < box[2]) & (y > box[1]) & (y < box[3])
            img[y[inside], x[inside]] = color


def nice_ticks(lo: float, hi: float, target: int = 6, *, integer: bool = False) -> np.ndarray:
    """Ticks at multiples of 1, 2 or 5 x 10^k inside [lo, hi], the step giving closest to `target` of them."""
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10)), key=lambda st: abs((hi - lo) / st - (target - 1)))
    step = max(1.0, round(step)) if integer else step
    first = math.ceil(lo / step - 1e-9)
    ticks = (first + np.arange(int(math.floor(hi / step + 1e-9)) - first + 1)) * step
    return np.where(np.abs(ticks) < step * 1e-9, 0.0, ticks)


def format_tick(v: float, step: float, sci: bool | None = None) -> str:
    """Short tick label: fixed point with just enough decimals for `step`, or scientific (default: huge or tiny)."""
    if sci is None:
        sci = v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3)
    if sci and v != 0:
        mant, exp = f"{v:.1e}".split("e")
        return f"{mant.removesuffix('.0')}e{int(exp)}"
    return f"{v:.{max(0, -math.floor(math.log10(step) + 1e-9))}f}"


def _axis_labels(ticks: np.ndarray, step: float) -> list[str]:
    """Labels for one linear axis, all scientific when the largest tick is >= 1e5 or below 1e-3."""
    top = float(np.abs(ticks).max())
    return [format_tick(float(v), step, sci=top >= 1e5 or top < 1e-3) for v in ticks]


def encode_png(img: np.ndarray) -> bytes:
    """Encode an RGB uint8 [H, W, 3] array as a PNG (8-bit truecolour, filter type 0 on every row)."""
    h, w, _ = img.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _padded(lo: float, hi: float, frac: float) -> tuple[float, float]:
    if hi <= lo:  # constant data: open a window around it
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    return lo - (hi - lo) * frac, hi + (hi - lo) * frac


def render_curves(
    series: dict[str, tuple[list[float], list[float]]],
    *,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    width: int = 800,
    height: int = 480,
    log_y: bool = False,
    legend: bool = True,
) -> np.ndarray:
    """Draw a line chart of `series` ({name: (xs, ys)}) and return it as an RGB uint8 [height, width, 3] array."""
    if not series:
        raise ValueError("plot_curves: no series given")
    data = {}
    for name, (xs, ys) in series.items():
        x, y = np.asarray(xs, dtype=np.float64).ravel(), np.asarray(ys, dtype=np.float64).ravel()
        if x.shape != y.shape:
            raise ValueError(f"plot_curves: series {name!r} has {x.size} x values but {y.size} y values")
        if log_y:
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)
        data[name] = (x, y, np.isfinite(x) & np.isfinite(y))
    all_x = np.concatenate([x[ok] for x, _, ok in data.values()])
    all_y = np.concatenate([y[ok] for _, y, ok in data.values()])
    if all_x.size == 0:
        raise ValueError("plot_curves: no finite points to plot" + (" (log_y drops y <= 0)" if log_y else ""))
    xlo, xhi = _padded(float(all_x.min()), float(all_x.max()), 0.02)
    ylo, yhi = _padded(float(all_y.min()), float(all_y.max()), 0.05)
    if not np.isfinite([xhi - xlo, yhi - ylo]).all():
        raise ValueError("plot_curves: data range overflows float64")
    xt, yt = nice_ticks(xlo, xhi), nice_ticks(ylo, yhi, integer=log_y and yhi - ylo >= 2)
    ystep = float(yt[1] - yt[0]) if yt.size > 1 else abs(yhi - ylo)
    xstep = float(xt[1] - xt[0]) if xt.size > 1 else abs(xhi - xlo)
    if log_y:  # label the value itself: decades as 0.01 / 1e-5, finer ticks with about 3 significant digits
        ylabels = [format_tick(10.0**v, 10.0**v if ystep >= 1 else 10.0**v / 100) for v in yt]
    else:
        ylabels = _axis_labels(yt, ystep)
    xlabels = _axis_labels(xt, xstep)

    left = 6 * max(len(s) for s in ylabels) + 12 + (12 if ylabel else 0)
    top, right, bottom = (26 if title else 12), 16, 24 + (12 if xlabel else 0)
    box = (left, top, width - right - 1, height - bottom - 1)
    if box[2] - box[0] < 20 or box[3] - box[1] < 20:
        raise ValueError(f"plot_curves: {width}x{height} leaves no room for the plot box")
    img = np.full((height, width, 3), 255, dtype=np.uint8)

    def px(x: np.ndarray) -> np.ndarray:
        return box[0] + (x - xlo) / (xhi - xlo) * (box[2] - box[0])

    def py(y: np.ndarray) -> np.ndarray:
        return box[3] - (y - ylo) / (yhi - ylo) * (box[3] - box[1])

    for i, (x, y, ok) in enumerate(data.values()):
        color = _PALETTE[i % len(_PALETTE)]
        u, v = np.where(ok, px(x), 0.0), np.where(ok, py(y), 0.0)
        _polyline(img, u, v, ok, color, box)
        lone = ok & ~np.r_[False, ok[:-1]] & ~np.r_[ok[1:], False]
        for j in np.flatnonzero(lone):
            _blit(img, np.ones((4, 4), bool), int(round(u[j])) - 1, int(round(v[j])) - 1, color)

    img[box[1], box[0] : box[2] + 1] = img[box[3], box[0] : box[2] + 1] = _INK
    img[box[1] : box[3] + 1, box[0]] = img[box[1] : box[3] + 1, box[2]] = _INK
    for v, s in zip(xt, xlabels, strict=True):
        c = int(round(px(v)))
        img[box[3] + 1 : box[3] + 5, c] = _INK
        _blit(img, text_mask(s), c - (6 * len(s) - 1) // 2, box[3] + 8, _INK)
    for v, s in zip(yt, ylabels, strict=True):
        r = int(round(py(v)))
        img[r, box[0] - 4 : box[0]] = _INK
        _blit(img, text_mask(s), box[0] - 7 - (6 * len(s) - 1), r - 3, _INK)
    if title:
        _blit(img, np.kron(text_mask(title), np.ones((2, 2), bool)), (width - 12 * len(title)) // 2, 6, _INK)
    if xlabel:
        _blit(img, text_mask(xlabel), (box[0] + box[2] - 6 * len(xlabel)) // 2, height - 11, _INK)
    if ylabel:
        _blit(img, np.rot90(text_mask(ylabel)), 3, (box[1] + box[3] - 6 * len(ylabel)) // 2, _INK)
    if legend:
        _legend(img, list(data), box)
    return img


def _legend(img: np.ndarray, names: list[str], box: tuple[int, int, int, int]) -> None:
    """Draw a framed legend in whichever plot-box corner covers the fewest already-drawn pixels."""
    w, h = 6 * max(len(s) for s in names) + 34, 12 * len(names) + 6
    spots = [(box[0] + 6, box[1] + 6), (box[2] - 6 - w, box[1] + 6), (box[0] + 6, box[3] - 6 - h)]
    spots.append((box[2] - 6 - w, box[3] - 6 - h))
    x, y = min(spots, key=lambda p: int((img[p[1] : p[1] + h, p[0] : p[0] + w] != 255).sum()))
    if x < box[0] or y < box[1]:
        return  # no room for a legend
    img[y : y + h, x : x + w] = 255
    img[y, x : x + w] = img[y + h - 1, x : x + w] = img[y : y + h, x] = img[y : y + h, x + w - 1] = (160, 160, 160)
    for i, name in enumerate(names):
        color, r = _PALETTE[i % len(_PALETTE)], y + 6 + 12 * i
        img[r + 2 : r + 5, x + 5 : x + 23] = color
        _blit(img, text_mask(name), x + 28, r, _INK)


def plot_curves(
    series: dict[str, tuple[list[float], list[float]]],
    path: str | Path,
    *,
    title: str | None = None,
    width: int = 800,
    height: int = 480,
    log_y: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    legend: bool = True,
) -> Path:
    """Render `series` ({name: (xs, ys)}) as a line-chart PNG at `path` (atomic write); see `render_curves`."""
    kw = dict(title=title, xlabel=xlabel, ylabel=ylabel, width=width, height=height, log_y=log_y, legend=legend)
    img = render_curves(series, **kw)
    atomic_write_bytes(path, encode_png(img))
    return Path(path)


def loss_curve_png(metrics_path: str | Path, png_path: str | Path, *, key: str = "loss", log_y: bool = False) -> Path:
    """Plot train `key` (and eval `key` when logged) against step from a metrics JSONL file into a PNG."""
    series = {}
    for kind in ("train", "eval"):
        pts = [(e["step"], e[key]) for e in read_metrics(metrics_path, kind) if isinstance(e.get(key), (int, float))]
        if pts:
            series[f"{kind} {key}"] = ([p[0] for p in pts], [p[1] for p in pts])
    if not series:
        raise ValueError(f"{metrics_path}: no {key!r} values to plot")
    return plot_curves(series, png_path, title=key, xlabel="step", log_y=log_y)
