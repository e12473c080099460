"""`astrai info / generate / chat` on a saved tiny model, and friendly errors instead of tracebacks."""

import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

import astrai
from astrai.cli.main import main
from helpers import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cli") / "m")


def test_info_shows_config_and_counts(model_dir, capsys):
    main(["info", "--model", model_dir])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    assert "qwen3" in out and "num_hidden_layers" in out
    assert f"{model.num_parameters:,}" in out


def test_help_lists_every_subcommand_train_included(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("info", "generate", "chat", "serve", "preprocess", "quickstart", "train"):
        assert f"• {name}" in out, out
    assert "Train or resume a run" in out


def test_device_defaults_to_auto_and_is_printed(model_dir, capsys):
    main(["generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "2"])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"device: {expected} (auto)" in capsys.readouterr().out
    main(["generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"])
    assert "device: cpu\n" in capsys.readouterr().out
    assert astrai.load(model_dir, device="auto").device.type == expected


def test_model_repr_is_one_short_line(model_dir):
    text = repr(astrai.load(model_dir))
    assert len(text) < 150 and "\n" not in text, text  # the attrs default printed every tensor (23k characters)
    assert text.startswith("Model(qwen3, 2 layers,") and "K parameters" in text and "float32, cpu" in text


def test_generate_streams_the_greedy_completion(model_dir, capsys):
    main(["generate", "--model", model_dir, "--prompt", "hello world", "--max-tokens", "12"])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    expected = astrai.generate(model, ["hello world"], max_tokens=12)[0]
    assert expected in out


def test_chat_uses_the_template_over_turns(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi there\nand again\n/exit\n"))
    main(["chat", "--model", model_dir, "--temperature", "0", "--max-tokens", "8"])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    first = [{"role": "user", "content": "hi there"}]
    reply = astrai.generate(model, [model.tokenizer.apply_chat_template(first, tokenize=True)], max_tokens=8)[0]
    assert reply in out and out.count("model>") == 2


def test_bad_folder_is_one_line_error_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli.main", "info", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


class _ServeProcess:
    """`astrai serve` in a subprocess on a free port, waited for until /health answers; SIGTERM on exit.

    After the `with` block, `out` holds its output and `returncode` its exit status.
    """

    def __init__(self, model_dir, *flags: str, env: dict[str, str] | None = None) -> None:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "astrai.cli.main", "serve", "--model", str(model_dir), "--port",
                     str(self.port), "--no-compile", "--no-cuda-graphs", *flags]  # fmt: skip
        self.env, self.out, self.returncode = env, "", None

    def __enter__(self) -> "_ServeProcess":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)  # fmt: skip
        for _ in range(300):
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.out, _ = self.proc.communicate(timeout=30)
        self.returncode = self.proc.returncode


def test_serve_takes_the_api_key_from_the_environment(model_dir):
    with _ServeProcess(model_dir, env={**os.environ, "ASTRAI_API_KEY": "from-env"}) as server:
        url = f"{server.base_url}/v1/models"
        assert httpx.get(url).status_code == 401  # the key is required although no flag named it
        assert httpx.get(url, headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert "from-env" not in server.out  # never logged


def test_serve_command_starts_answers_and_stops_on_sigterm(model_dir):
    with _ServeProcess(model_dir, "--served-model-name", "cli-model", "--api-key", "k") as server:
        models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer k"})
        assert models.json()["data"][0]["id"] == "cli-model"
    # a requested stop that shut down cleanly is a success: status 0 (uvicorn alone re-raises SIGTERM: -15)
    assert server.returncode == 0 and "Application shutdown complete" in server.out, server.out


def test_serve_names_a_failed_graph_capture_without_a_traceback(tmp_path, monkeypatch, capsys):
    import tyro

    import astrai.cli.serve as serve
    import astrai.inference.engine as engine_mod
    from astrai.inference.graphs import GraphCaptureError

    def failing_engine(model, config):
        raise GraphCaptureError("capturing the CUDA graph of the decode step for batch 64 failed (...)")

    monkeypatch.setattr(engine_mod, "Engine", failing_engine)
    monkeypatch.setattr(serve, "load_model", lambda *a: None)
    with pytest.raises(SystemExit) as exit_info:
        serve.main(tyro.cli(serve.ServeConfig, args=["--model", str(tmp_path)]))
    assert exit_info.value.code == 2
    assert "batch 64 failed" in capsys.readouterr().err
