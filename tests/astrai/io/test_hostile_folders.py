"""Hostile model folders: files linked or `../`-named out of the folder, unreadable tokenizers, deeply nested
JSON. Each is refused by `astrai.load` with a CheckpointError naming the file, and by `astrai serve` with one
error line and exit status 2 (no traceback); a plain folder and a Hugging Face cache snapshot (symlinks into
`../../blobs`) are the positive controls."""

import json
import os
import shutil
from pathlib import Path

import pytest

import astrai
from astrai.io.errors import CheckpointError
from helpers import tiny_model_dir

COMMIT = "c" * 40


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return Path(tiny_model_dir(tmp_path_factory.mktemp("model")))


@pytest.fixture
def folder(tmp_path, source) -> Path:
    out = tmp_path / "model"
    shutil.copytree(source, out)
    return out


def _move_out(folder: Path, name: str) -> Path:
    """Move `name` to a sibling folder and leave a symlink to it: the same bytes, outside the model folder."""
    outside = folder.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    shutil.move(folder / name, outside / name)
    (folder / name).symlink_to(outside / name)
    return outside / name


def _serve_fails(folder: Path, capsys, *flags: str) -> str:
    from astrai.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(folder), "--device", "cpu", "--port", "1", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err


def test_plain_folder_loads(folder):
    model = astrai.load(folder)
    assert model.tokenizer is not None and model.tokenizer.chat_template


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors", "tokenizer_config.json"])
def test_a_file_linked_out_of_the_folder_is_refused_unless_allowed(folder, name, capsys):
    target = _move_out(folder, name)
    with pytest.raises(CheckpointError, match="outside the model folder") as err:
        astrai.load(folder)
    assert str(folder / name) in str(err.value) and str(target) in str(err.value)
    assert "outside the model folder" in _serve_fails(folder, capsys)
    assert astrai.load(folder, allow_outside_files=True).config.vocab_size > 0  # the flag lets the same folder in


def test_a_chat_template_linked_out_is_refused(folder):
    (folder.parent / "secret.txt").write_text("{{ 'stolen' }}")
    (folder / "chat_template.jinja").symlink_to(folder.parent / "secret.txt")
    with pytest.raises(CheckpointError, match="chat_template.jinja"):
        astrai.load(folder)
    model = astrai.load(folder, allow_outside_files=True)
    assert model.tokenizer.chat_template == "{{ 'stolen' }}"  # the control: the link is what the check stopped


def test_index_shards_named_with_dotdot_are_refused(folder, capsys):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (folder.parent / "outside").mkdir()
    shutil.move(folder / "model.safetensors", folder.parent / "outside" / "model.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "../outside/model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\.\./outside/model\.safetensors.*outside the model folder"):
        astrai.load(folder)
    assert "outside the model folder" in _serve_fails(folder, capsys)
    assert astrai.load(folder, allow_outside_files=True).num_parameters > 0


def _fake_snapshot(root: Path, source: Path) -> Path:
    repo = root / "models--tiny-org--tiny-model"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in source.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_hf_cache_snapshot_of_symlinks_loads_but_not_a_link_out_of_its_repo(tmp_path, source, monkeypatch):
    snap = _fake_snapshot(tmp_path / "hub", source)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert astrai.load("tiny-org/tiny-model").tokenizer is not None  # by id
    assert astrai.load(snap).tokenizer is not None  # by snapshot folder
    (tmp_path / "secret.jinja").write_text("x")
    (snap / "chat_template.jinja").symlink_to(tmp_path / "secret.jinja")  # out of the repo folder
    with pytest.raises(CheckpointError, match="outside the model folder"):
        astrai.load("tiny-org/tiny-model")


def test_the_same_links_from_a_folder_that_is_no_snapshot_are_refused(tmp_path, source):
    """The cache exemption holds only for a `models--*/snapshots/<commit>` folder, not any folder of links."""
    snap = _fake_snapshot(tmp_path / "hub", source)
    other = tmp_path / "x" / "y"
    other.mkdir(parents=True)
    for f in snap.iterdir():
        (other / f.name).symlink_to(f.resolve())
    with pytest.raises(CheckpointError, match="outside the model folder"):
        astrai.load(other)


@pytest.mark.parametrize("breakage", ["corrupt", "dangling", "unreadable"])
def test_an_unreadable_tokenizer_is_an_error_not_a_model_without_one(folder, breakage, capsys):
    tok = folder / "tokenizer.json"
    if breakage == "corrupt":
        tok.write_bytes(b"\x00garbage{")
    elif breakage == "dangling":
        tok.unlink()
        tok.symlink_to(folder / "gone.json")
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        tok.chmod(0)
    with pytest.raises((CheckpointError, FileNotFoundError), match="tokenizer.json"):
        astrai.load(folder)
    assert "tokenizer.json" in _serve_fails(folder, capsys)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "model.safetensors.index.json"])  # fmt: skip
def test_deeply_nested_json_is_a_clean_error(folder, name, capsys):
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=name):
        astrai.load(folder)
    assert name in _serve_fails(folder, capsys)


def test_absurd_max_position_embeddings_is_capped_by_the_kv_pool(tmp_path, caplog):
    """config.json claiming 10**12 positions: the engine starts at once, allocates by its KV budget, warns, and
    enforces the pool's capacity; an ordinary context (the control) and an explicit --max-model-len are kept."""
    import resource

    from astrai.inference.engine import Engine
    from astrai.inference.engine_config import EngineConfig

    model = astrai.load(tiny_model_dir(tmp_path / "huge", max_position_embeddings=10**12))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with caplog.at_level("WARNING", logger="astrai.inference.budget"):
        engine = Engine(model, EngineConfig(max_running=4, compile=False, kv_budget_bytes=1 << 20))
    capacity = (engine.pool.num_pages - 1) * engine.config.page_size
    assert engine.max_model_len == capacity < 10**6 and "capping the context length" in caplog.text
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 << 10  # KiB: nothing sized by 10**12
    engine = Engine(model, EngineConfig(max_running=4, compile=False, kv_budget_bytes=1 << 20, max_model_len=100))
    assert engine.max_model_len == 100
    normal = astrai.load(tiny_model_dir(tmp_path / "normal", max_position_embeddings=64))
    assert Engine(normal, EngineConfig(max_running=4, compile=False, kv_budget_bytes=1 << 20)).max_model_len == 64
