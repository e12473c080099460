"""Model ids resolved from a fake Hugging Face cache tree (no network), checked against huggingface_hub's own
offline lookup; generation_config.json sampling defaults read, validated and saved back."""

import json
import shutil
from pathlib import Path

import pytest

import astrai
from astrai.io.errors import CheckpointError
from astrai.io.hub import hf_cache_dir, resolve_model
from astrai.io.model import read_generation_defaults
from helpers import tiny_model_dir

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
REPO = "tiny-org/tiny-model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(tiny_model_dir(tmp_path_factory.mktemp("model")))


def _fake_cache(root: Path, model_dir: Path, *, refs: dict[str, str], snapshots: tuple[str, ...]) -> Path:
    """A hub cache laid out as huggingface_hub writes it: blobs, snapshot symlinks, refs."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    for commit in snapshots:
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in model_dir.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, blob)
            (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    for name, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    return repo


def _hf_snapshot(root: Path, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(REPO, cache_dir=root, revision=revision, local_files_only=True))


def test_model_id_loads_from_hf_hub_cache_as_huggingface_hub_finds_it(tmp_path, model_dir, monkeypatch):
    _fake_cache(tmp_path, model_dir, refs={"main": COMMIT_A, "dev": COMMIT_B}, snapshots=(COMMIT_A, COMMIT_B))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for revision in (None, "dev", COMMIT_A):
        assert resolve_model(REPO, revision) == _hf_snapshot(tmp_path, revision)
    assert resolve_model(REPO).name == COMMIT_A and resolve_model(REPO, "dev").name == COMMIT_B
    model = astrai.load(REPO, revision="dev")
    assert model.config.vocab_size == astrai.load(model_dir).config.vocab_size
    assert model.tokenizer is not None


def test_cache_folder_follows_the_environment_like_huggingface_hub(tmp_path, monkeypatch):
    import importlib

    import huggingface_hub.constants as hc

    def check(expected: Path) -> None:
        importlib.reload(hc)  # huggingface_hub reads the environment when its constants module runs
        assert hf_cache_dir() == expected == Path(hc.HF_HUB_CACHE)

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    try:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        check(tmp_path / "home/.cache/huggingface/hub")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        check(tmp_path / "xdg/huggingface/hub")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
        check(tmp_path / "hfhome/hub")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
        check(tmp_path / "hubcache")
    finally:
        monkeypatch.undo()
        importlib.reload(hc)


def test_a_folder_wins_over_an_id_and_takes_no_revision(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert resolve_model(model_dir) == model_dir
    with pytest.raises(CheckpointError, match="local folder"):
        resolve_model(model_dir, "main")


def test_missing_model_says_how_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"huggingface-cli download Qwen/Qwen3-0\.6B") as err:
        astrai.load("Qwen/Qwen3-0.6B")
    assert str(tmp_path) in str(err.value)
    with pytest.raises(CheckpointError, match="no such model folder"):
        astrai.load(tmp_path / "not" / "here" / "at-all")  # an absolute path: never a model id
    with pytest.raises(CheckpointError, match="not a branch"):
        resolve_model("Qwen/Qwen3-0.6B", "../../etc")


def test_incomplete_and_ambiguous_caches_are_named(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = _fake_cache(tmp_path, model_dir, refs={"main": COMMIT_B}, snapshots=(COMMIT_A,))
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_model(REPO)
    (repo / "refs" / "main").unlink()
    assert resolve_model(REPO).name == COMMIT_A  # no ref, one snapshot: that one
    shutil.copytree(repo / "snapshots" / COMMIT_A, repo / "snapshots" / COMMIT_B, symlinks=True)
    with pytest.raises(CheckpointError, match="snapshots there") as err:
        resolve_model(REPO)
    assert COMMIT_A in str(err.value) and COMMIT_B in str(err.value)
    assert resolve_model(REPO, COMMIT_B).name == COMMIT_B
    (repo / "snapshots" / COMMIT_B / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(REPO, COMMIT_B)


def test_generation_defaults_read_validated_and_saved_back(tmp_path, model_dir):
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    extra = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1,
             "max_new_tokens": 64, "do_sample": True, "num_beams": 1, "length_penalty": None}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps({**gen, **extra}))
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1,
                "max_tokens": 64}  # fmt: skip
    assert read_generation_defaults(folder) == expected
    model = astrai.load(folder)
    assert model.generation_defaults == expected
    saved = astrai.save(model, tmp_path / "saved")
    assert astrai.load(saved).generation_defaults == expected
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(saved).top_k == 20  # transformers reads what we wrote
    assert read_generation_defaults(tmp_path) == {}  # no file: no defaults
    for bad in ({"temperature": "hot"}, {"top_k": 1.5}, {"top_p": float("nan")}, {"max_new_tokens": 0},
                {"temperature": True}):  # fmt: skip
        (folder / "generation_config.json").write_text(json.dumps({**gen, **bad}))
        key = next(iter(bad))
        with pytest.raises(CheckpointError, match=f"generation_config.json: {key}"):
            astrai.load(folder)


def test_cli_takes_a_cached_model_id(tmp_path, model_dir, monkeypatch, capsys):
    from astrai.cli.main import main

    _fake_cache(tmp_path, model_dir, refs={"main": COMMIT_A}, snapshots=(COMMIT_A,))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    main(["info", REPO])
    assert "qwen3" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--model", "tiny-org/not-downloaded"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "huggingface-cli download tiny-org/not-downloaded" in err and "Traceback" not in err
