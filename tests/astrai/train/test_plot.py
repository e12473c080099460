"""Loss-curve PNGs: decoded here by an independent minimal PNG reader, then checked pixel by pixel."""

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from astrai.train.metrics import MetricsLog
from astrai.train.plot import format_tick, loss_curve_png, nice_ticks, plot_curves, text_mask

WHITE = np.array([255, 255, 255], dtype=np.uint8)


def decode_png(path: Path) -> np.ndarray:
    """Minimal PNG decoder: 8-bit RGB, no interlace, filter type 0 rows only; verifies every chunk CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body), f"bad CRC in {tag!r}"
        chunks.append((tag, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all(), "expected filter type 0 on every row"
    return rows[:, 1:].reshape(h, w, 3)


def frame(img: np.ndarray) -> tuple[int, int, int, int]:
    """Find the axes box as the rows/columns that are mostly dark: (left, top, right, bottom)."""
    dark = (img < 100).all(axis=2)
    rows = np.flatnonzero(dark.sum(axis=1) > img.shape[1] // 2)
    cols = np.flatnonzero(dark.sum(axis=0) > img.shape[0] // 2)
    assert rows.size >= 2 and cols.size >= 2, "no axes box found"
    return int(cols.min()), int(rows.min()), int(cols.max()), int(rows.max())


def coloured(img: np.ndarray) -> np.ndarray:
    """Mask of saturated (non-grey) pixels: series lines, never ink, background or legend frame."""
    c = img.astype(int)
    return (c.max(axis=2) - c.min(axis=2)) > 40


def colours(img: np.ndarray) -> dict[tuple[int, ...], int]:
    px = img[coloured(img)]
    values, counts = np.unique(px, axis=0, return_counts=True)
    return {tuple(int(c) for c in v): int(n) for v, n in zip(values, counts, strict=True)}


def test_diagonal_line_lights_the_diagonal_and_nothing_else(tmp_path: Path) -> None:
    x = np.linspace(0, 10, 50)
    path = plot_curves({"y=x": (list(x), list(x))}, tmp_path / "d.png", width=640, height=400, legend=False)
    img = decode_png(path)
    assert img.shape == (400, 640, 3)
    left, top, right, bottom = frame(img)
    assert 0 < left < right < 640 and 0 < top < bottom < 400
    assert right - left > 400 and bottom - top > 250
    inner = img[top + 1 : bottom, left + 1 : right]
    mask = coloured(inner)
    assert len(colours(inner)) == 1
    cols = np.flatnonzero(mask.any(axis=0))
    assert cols.size > 0.9 * inner.shape[1], "the line should cross almost the whole box"
    centre = np.array([np.flatnonzero(mask[:, c]).mean() for c in cols])
    slope, icpt = np.polyfit(cols, centre, 1)
    assert slope < 0
    assert np.abs(centre - (slope * cols + icpt)).max() < 2.0
    w, h = inner.shape[1], inner.shape[0]
    assert cols.min() < 0.05 * w and cols.max() > 0.95 * w
    assert centre[0] > 0.9 * h and centre[-1] < 0.1 * h  # from bottom-left to top-right
    rr, cc = np.mgrid[0:h, 0:w]
    dist = np.abs(slope * cc - rr + icpt) / np.hypot(slope, 1.0)
    far = dist > 4
    assert (inner[far] == WHITE).all(), "background far from the line must be white"
    assert not mask[far].any()


def test_two_series_two_colours_in_the_right_order(tmp_path: Path) -> None:
    xs = list(range(20))
    series = {"high": (xs, [3.0] * 20), "low": (xs, [1.0 + 0.01 * i for i in xs])}
    img = decode_png(plot_curves(series, tmp_path / "two.png"))
    found = colours(img)
    assert len(found) == 2 and all(n > 200 for n in found.values())
    (high,) = colours(decode_png(plot_curves({"high": series["high"]}, tmp_path / "one.png")))
    (low,) = set(found) - {high}

    def median_row(c: tuple[int, ...]) -> float:
        return float(np.median(np.nonzero((img == np.array(c, np.uint8)).all(axis=2))[0]))

    assert median_row(high) < median_row(low) - 100, "the higher series is drawn higher up"


def test_tick_marks_and_labels_are_drawn_outside_the_box(tmp_path: Path) -> None:
    img = decode_png(plot_curves({"a": ([0, 100, 200], [5.0, 2.0, 1.0])}, tmp_path / "t.png", legend=False))
    left, top, right, bottom = frame(img)
    dark = (img < 100).all(axis=2)
    assert dark[top : bottom + 1, : left - 5].sum() > 50, "y tick labels left of the axis"
    assert dark[bottom + 6 :, left : right + 1].sum() > 50, "x tick labels below the axis"
    assert dark[top : bottom + 1, left - 4 : left].sum() >= 3 * 4, "y tick marks"
    assert dark[bottom + 1 : bottom + 5, left : right + 1].sum() >= 3 * 4, "x tick marks"
    assert not dark[: top - 1].any(), "nothing above the box without a title"
    img2 = decode_png(plot_curves({"a": ([0, 1], [0, 1])}, tmp_path / "t2.png", title="Loss", legend=False))
    assert (img2[: frame(img2)[1] - 1] < 100).all(axis=2).sum() > 20, "title drawn above the box"


def test_nan_and_inf_break_the_line(tmp_path: Path) -> None:
    x = np.arange(21, dtype=float)
    y = x.copy()
    y[10] = np.nan
    y[15] = np.inf
    img = decode_png(plot_curves({"a": (x, y)}, tmp_path / "n.png", legend=False))
    left, top, right, bottom = frame(img)
    cols = np.flatnonzero(coloured(img[top + 1 : bottom, left + 1 : right]).any(axis=0))
    gaps = np.flatnonzero(np.diff(cols) > 5)
    assert len(gaps) == 2
    mid = [(cols[g] + cols[g + 1]) / 2 / (right - left) for g in gaps]
    assert 0.4 < mid[0] < 0.6 and 0.65 < mid[1] < 0.85


def test_single_point_and_constant_series(tmp_path: Path) -> None:
    img = decode_png(plot_curves({"p": ([7], [3.0])}, tmp_path / "p.png", legend=False))
    left, top, right, bottom = frame(img)
    rr, cc = np.nonzero(coloured(img))
    assert 4 <= rr.size <= 16
    assert abs(rr.mean() - (top + bottom) / 2) < 3 and abs(cc.mean() - (left + right) / 2) < 3

    img = decode_png(plot_curves({"c": ([0, 1, 2, 3], [2.0] * 4)}, tmp_path / "c.png", legend=False))
    left, top, right, bottom = frame(img)
    rr, cc = np.nonzero(coloured(img))
    assert np.abs(rr - (top + bottom) / 2).max() <= 2
    assert cc.max() - cc.min() > 0.9 * (right - left)


def test_log_scale_makes_exponentials_straight(tmp_path: Path) -> None:
    x = np.linspace(0, 4, 40)
    y = 10.0**x
    y[0] = 0.0  # not representable on a log axis: skipped
    img = decode_png(plot_curves({"e": (x, y)}, tmp_path / "l.png", log_y=True, legend=False))
    mask = coloured(img)
    cols = np.flatnonzero(mask.any(axis=0))
    centre = np.array([np.flatnonzero(mask[:, c]).mean() for c in cols])
    fit = np.polyval(np.polyfit(cols, centre, 1), cols)
    assert np.abs(centre - fit).max() < 2.0


def test_invalid_input_raises_clear_errors_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    with pytest.raises(ValueError, match="no series"):
        plot_curves({}, out)
    with pytest.raises(ValueError, match="no finite points"):
        plot_curves({"a": ([], [])}, out)
    with pytest.raises(ValueError, match="no finite points"):
        plot_curves({"a": ([1.0, 2.0], [float("nan"), float("inf")])}, out)
    with pytest.raises(ValueError, match="2 x values but 1 y"):
        plot_curves({"a": ([1, 2], [1])}, out)
    with pytest.raises(ValueError, match="no room"):
        plot_curves({"a": ([1, 2], [1, 2])}, out, width=40, height=30)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    out = tmp_path / "o.png"
    plot_curves({"a": ([0, 1], [0, 1])}, out, width=300, height=200)
    plot_curves({"a": ([0, 1], [0, 1])}, out, width=320, height=210)
    assert decode_png(out).shape == (210, 320, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["o.png"]


def test_loss_curve_png_from_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    with MetricsLog(metrics) as log:
        for s in range(0, 100, 5):
            log.train(s, loss=3.0 / (1 + s), lr=1e-3)
            if s % 25 == 0:
                log.eval(s, loss=3.5 / (1 + s))
        log.train(100, loss=float("nan"))
    with open(metrics, "a") as f:
        f.write('{"type": "train", "step": 105, "lo')  # crash mid-write
    img = decode_png(loss_curve_png(metrics, tmp_path / "loss.png"))
    assert img.shape == (480, 800, 3)
    assert len(colours(img)) == 2

    train_only = tmp_path / "train.jsonl"
    with MetricsLog(train_only) as log:
        log.train(1, loss=2.0)
        log.train(2, loss=1.0)
    assert len(colours(decode_png(loss_curve_png(train_only, tmp_path / "t.png")))) == 1
    with pytest.raises(ValueError, match="no 'acc' values"):
        loss_curve_png(train_only, tmp_path / "a.png", key="acc")


def test_font_and_tick_helpers() -> None:
    digits = [text_mask(d) for d in "0123456789"]
    assert all(m.shape == (7, 5) and m.any() for m in digits)
    assert len({m.tobytes() for m in digits}) == 10
    assert text_mask("1.5e-3").shape == (7, 6 * 6 - 1)
    assert (text_mask("abc") == text_mask("ABC")).all()
    assert np.allclose(nice_ticks(-0.05, 1.05), [0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert np.allclose(nice_ticks(0, 104000), np.arange(0, 100001, 20000))
    assert [format_tick(v, 0.2) for v in (0.0, 0.4, 1.0)] == ["0.0", "0.4", "1.0"]
    assert format_tick(500.0, 100.0) == "500" and format_tick(1e-5, 1e-5) == "1e-5"
    assert format_tick(250000.0, 50000.0) == "2.5e5"
