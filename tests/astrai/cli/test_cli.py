"""`astrai info / generate / chat / serve` on a saved tiny model, and friendly errors instead of tracebacks.

vLLM-style flags (positional MODEL, aliases, CORS, chat templates, generation config): test_conventions.py.
"""

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import httpx
import pytest
import torch

import astrai
from astrai.cli.main import main
from helpers import draft_pair_dirs, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cli") / "m")


def test_info_shows_config_and_counts(model_dir, capsys):
    main(["info", str(model_dir)])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    assert "qwen3" in out and "num_hidden_layers" in out
    assert f"{model.num_parameters:,}" in out


def test_help_lists_every_subcommand_train_included(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in ("info", "generate", "chat", "serve", "preprocess", "quickstart", "train"):
        (i,) = [i for i, line in enumerate(lines) if f"• {name} " in line]
        # a one-line description: text beside the name, and the next row is the next bullet or the box's end
        following = lines[i + 1].strip(" │") if i + 1 < len(lines) else ""
        assert re.search(rf"• {name}\s+[A-Z]\w+ .*\.", lines[i]), out
        assert following == "" or following.startswith(("•", "╰")), out
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
    main(["generate", str(model_dir), "--prompt", "hello world", "--max-tokens", "12"])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    expected = astrai.generate(model, ["hello world"], max_tokens=12)[0]
    assert expected in out


def test_generate_takes_vllms_speculative_config(model_dir, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    main(["generate", str(model_dir), "--prompt", "hello world hello world hello", "--max-tokens", "24",
          "--speculative-config", spec])  # fmt: skip
    out = capsys.readouterr().out
    expected = astrai.generate(astrai.load(model_dir), ["hello world hello world hello"], max_tokens=24)[0]
    assert expected in out  # the same text as without speculation
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(model_dir), "--prompt", "hi", "--speculative-config", '{"method": "ngram"}'])
    assert exit_.value.code != 0 and "num_speculative_tokens is required" in capsys.readouterr().err


def test_generate_takes_a_draft_model(tmp_path, capsys):
    target_dir, draft_dir = draft_pair_dirs(tmp_path)
    spec = f'{{"model": "{draft_dir}", "num_speculative_tokens": 3}}'  # vLLM's JSON: a draft model by its folder
    main(["generate", target_dir, "--prompt", "hello world", "--max-tokens", "16", "--speculative-config", spec])
    expected = astrai.generate(astrai.load(target_dir), ["hello world"], max_tokens=16)[0]
    assert expected in capsys.readouterr().out  # the same text as without speculation
    missing = f'{{"model": "{tmp_path / "nowhere"}", "num_speculative_tokens": 3}}'
    with pytest.raises(SystemExit) as exit_:
        main(["generate", target_dir, "--prompt", "hi", "--speculative-config", missing])
    assert exit_.value.code != 0 and "cannot load the draft model" in capsys.readouterr().err


def test_chat_uses_the_template_over_turns(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi there\nand again\n/exit\n"))
    main(["chat", str(model_dir), "--temperature", "0", "--max-tokens", "8"])
    out = capsys.readouterr().out
    model = astrai.load(model_dir)
    first = [{"role": "user", "content": "hi there"}]
    reply = astrai.generate(model, [model.tokenizer.apply_chat_template(first, tokenize=True)], max_tokens=8)[0]
    assert reply in out and out.count("model>") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "gpu"])
def test_an_unusable_device_is_one_error_line(model_dir, capsys, command, device):
    """`--device cuda` on a machine without CUDA (or a name torch does not know) is one `error:` line and exit 2
    from every model command, before any weight is read; was torch's assertion with a traceback. Control: the
    same command line with `--device cpu` runs (`generate`)."""
    extra = {"generate": ["--prompt", "hi", "--max-tokens", "1"], "serve": ["--port", "0"]}.get(command, [])
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(model_dir), "--device", device, *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error:" in err and device in err, err
    assert "CUDA is not available" in err if device != "gpu" else "not a device name" in err, err
    if command == "generate":
        main([command, str(model_dir), "--device", "cpu", *extra])


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
        self.argv = [sys.executable, "-m", "astrai.cli.main", "serve", str(model_dir), "--port",
                     str(self.port), "--no-compile", "--no-cuda-graphs", *flags]  # fmt: skip
        self.env, self.out, self.returncode = env, "", None

    def __enter__(self) -> "_ServeProcess":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)  # fmt: skip
        # up to 120 s: a first start in a fresh clone builds the CPU ops library and imports cold, which took
        # longer than the 30 s this waited before on a loaded 2-core box; a server that exits stops the wait
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
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


CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def test_serve_command_end_to_end(model_dir, tmp_path):
    """One server start: positional MODEL, ASTRAI_API_KEY, --served-model-name, CORS, --chat-template,
    --enable-log-requests (shown at the default --log-level info), SIGTERM."""
    template = tmp_path / "t.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    flags = ["--served-model-name", "cli-model", "cli-alias", "--allowed-origins", "http://ok.example",
             "--chat-template", str(template), "--enable-log-requests"]  # fmt: skip
    with _ServeProcess(model_dir, *flags, env={**os.environ, "ASTRAI_API_KEY": "from-env"}) as server:
        url, auth = f"{server.base_url}/v1/models", {"Authorization": "Bearer from-env"}
        assert httpx.get(url).status_code == 401  # the key is required although no flag named it
        models = httpx.get(url, headers=auth)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "cli-model"
        # CORS: a preflight (no API key) from the allowed origin is answered, with the origin allowed
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(f"{server.base_url}/v1/chat/completions", headers={"Origin": "http://ok.example",
                                                                              **preflight})  # fmt: skip
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert httpx.get(url, headers={**auth, "Origin": "http://ok.example"}).headers[
            "access-control-allow-origin"] == "http://ok.example"  # fmt: skip
        # another origin gets no CORS grant, on the preflight or the request
        bad = httpx.options(f"{server.base_url}/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                                               **preflight})  # fmt: skip
        assert "access-control-allow-origin" not in bad.headers and bad.status_code == 400
        assert (
            "access-control-allow-origin"
            not in httpx.get(url, headers={**auth, "Origin": "http://evil.example"}).headers
        )
        # --chat-template FILE renders the prompt
        messages = [{"role": "user", "content": "hello"}]
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers=auth,
                           json={"model": "cli-model", "messages": messages, "max_tokens": 1})  # fmt: skip
        assert reply.status_code == 200, reply.text
        tok = astrai.load(model_dir).tokenizer
        expected = len(tok.with_chat_template(CUSTOM_TEMPLATE).encode_chat(messages))
        assert expected != len(tok.encode_chat(messages))  # the two templates tokenize differently
        assert reply.json()["usage"]["prompt_tokens"] == expected
        # every --served-model-name is accepted, the first is reported; any other name is a 404
        for name, status in (("cli-alias", 200), ("other-model", 404)):
            reply = httpx.post(f"{server.base_url}/v1/completions", headers=auth,
                               json={"model": name, "prompt": "hi", "max_tokens": 1})  # fmt: skip
            assert reply.status_code == status, reply.text
        assert reply.json()["error"]["code"] == "model_not_found"
    assert "from-env" not in server.out  # never logged
    assert "prompt=" in server.out and "hello" in server.out, server.out  # --enable-log-requests, shown at info
    assert "grammar engine ready" in server.out  # the grammar view is built at start, not by the first request
    # a requested stop that shut down cleanly is a success: status 0 (uvicorn alone re-raises SIGTERM: -15)
    assert server.returncode == 0 and "Application shutdown complete" in server.out, server.out


def test_serve_warns_at_start_when_the_chat_template_always_fails(model_dir):
    """A template that fails on a one-message conversation is named by a warning at start; chat routes answer
    400 in their shape (never 500) and /v1/completions, which needs no template, still serves."""
    failing = "{% for i in range(10**6) %}x{% endfor %}"  # past the sandbox's range limit on every render
    with _ServeProcess(model_dir, "--chat-template", failing) as server:
        chat = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        plain = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"], chat.text
    assert plain.status_code == 200, plain.text
    assert "warning: the chat template fails on a one-message conversation" in " ".join(server.out.split())


def test_serve_names_a_failed_graph_capture_without_a_traceback(tmp_path, monkeypatch, capsys):
    import astrai.cli.serve as serve
    import astrai.inference.engine as engine_mod
    from astrai.cli._common import parse
    from astrai.inference.graphs import GraphCaptureError

    def failing_engine(model, config):
        raise GraphCaptureError("capturing the CUDA graph of the decode step for batch 64 failed (...)")

    monkeypatch.setattr(engine_mod, "Engine", failing_engine)
    monkeypatch.setattr(serve, "load_model", lambda *a: types.SimpleNamespace(generation_defaults={}, tokenizer=None))
    with pytest.raises(SystemExit) as exit_info:
        serve.main(parse(serve.ServeConfig, ["--model", str(tmp_path), "--port", "0"]))
    assert exit_info.value.code == 2
    assert "batch 64 failed" in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading_the_model(tmp_path):
    """A port another process listens on is named in one `error:` line, at once: the model is not loaded first
    (the folder here is not even a model), no "serving ..." line is printed and there is no traceback. Control:
    the same command on a free port gets past the bind and fails on the folder instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "astrai.cli.main", "serve", str(tmp_path), "--port"]
        busy = subprocess.run([*argv, str(port)], capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2, busy.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr and "another --port" in busy.stderr, busy.stderr
    assert "Traceback" not in busy.stderr + busy.stdout and "serving" not in busy.stdout
    free = subprocess.run([*argv, "0"], capture_output=True, text=True, timeout=120)
    assert free.returncode == 2 and "cannot listen" not in free.stderr and "config.json" in free.stderr, free.stderr
