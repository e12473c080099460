"""vLLM's CLI conventions on `astrai serve / generate / chat`: positional MODEL (`--model` too), vLLM flag names
with astrai's as aliases, `--chat-template`, `--generation-config`, `--gpu-memory-utilization`, CORS, log level.

The end-to-end server check (one subprocess: ASTRAI_API_KEY, CORS preflight, --chat-template) is in test_cli.py.
"""

import json
import shutil
import types

import pytest
import torch

import astrai
import astrai.cli.main as cli_main
from astrai.cli._common import dtype_name, load_model, model_flag_to_positional, parse, read_chat_template
from astrai.cli.chat import ChatConfig
from astrai.cli.generate import GenerateConfig
from astrai.cli.main import main
from astrai.cli.serve import ServeConfig, engine_config, origin_list, sampling_defaults
from astrai.inference.budget import activation_headroom, kv_budget_for_utilization, kv_pool_pages
from astrai.inference.cache import kv_bytes_per_token
from astrai.inference.engine import EngineConfig
from astrai.serve.server import logging_config
from helpers import tiny_model_dir

GiB = 1 << 30
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("conv") / "m")


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_vllm_flags_and_the_astrai_aliases(capsys):
    out = _help(capsys, "serve")
    assert "usage: astrai serve [-h] [SERVE OPTIONS] MODEL" in out and "--model MODEL" in out
    for flag in ["--revision", "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-running",
                 "--max-num-batched-tokens", "--max-step-tokens", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--seed", "--chat-template", "--served-model-name",
                 "--dtype {auto,float32,bfloat16,float16,half,float}", "--api-key", "ASTRAI_API_KEY",
                 "--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials",
                 "--log-level", "--uvicorn-log-level", "--enable-log-requests", "--generation-config",
                 "--kv-budget", "--device"]:  # fmt: skip
        assert flag in out, flag
    for sub in ("generate", "chat"):
        out = _help(capsys, sub)
        assert f"usage: astrai {sub}" in out and "MODEL" in out
        for flag in ["--revision", "--max-model-len", "--dtype {auto,", "--seed", "--chat-template", "--device"]:
            assert flag in out, (sub, flag)


def test_aliases_and_model_flag_parse_like_the_primary_spelling(monkeypatch):
    seen = []
    monkeypatch.setitem(cli_main.COMMANDS, "serve", (ServeConfig, seen.append))
    common = ["--no-enable-prefix-caching", "--seed", "7", "--max-model-len", "64", "--gpu-memory-utilization", "0.5"]
    main(["serve", "org/m", "--max-num-seqs", "3", "--max-num-batched-tokens", "256", "--log-level", "debug",
          *common])  # fmt: skip
    main(["serve", "--max-running", "3", "--model", "org/m", "--max-step-tokens", "256", "--uvicorn-log-level",
          "debug", *common])  # fmt: skip
    main(["serve", "--model=org/m", "--max-running", "3", "--max-step-tokens", "256", "--log-level", "debug", *common])
    assert seen[0] == seen[1] == seen[2]
    cfg = seen[0]
    assert cfg.model == "org/m" and cfg.max_num_seqs == 3 and cfg.log_level == "debug"  # an HF id stays a str
    engine = engine_config(cfg)
    assert (engine.max_running, engine.max_step_tokens, engine.prefix_cache) == (3, 256, False)
    assert (engine.seed, engine.max_model_len, engine.gpu_memory_utilization) == (7, 64, 0.5)
    assert engine_config(parse(ServeConfig, ["m"])).prefix_cache is True
    assert engine.overlap_schedule is False  # vLLM's --async-scheduling turns on the overlap schedule
    assert engine_config(parse(ServeConfig, ["m", "--async-scheduling"])).overlap_schedule is True
    fuse = {v: engine_config(parse(ServeConfig, ["m", "--fuse-projections", v])).fuse_projections
            for v in ("auto", "on", "off")}  # fmt: skip
    assert fuse == {"auto": None, "on": True, "off": False} and engine.fuse_projections is None
    for cls, extra in ((GenerateConfig, ["--prompt", "x"]), (ChatConfig, [])):
        positional = parse(cls, ["m", "--dtype", "half", "--revision", "v1", *extra])
        assert positional == parse(cls, ["--dtype", "half", "--model", "m", "--revision", "v1", *extra])
        assert positional.model == "m" and dtype_name(positional.dtype) == "float16"
    assert [dtype_name(d) for d in ("auto", "float", "bfloat16")] == [None, "float32", "bfloat16"]
    # arguments after `--` are not rewritten
    assert model_flag_to_positional(["--port", "1", "--model", "a", "--", "--model", "b"]) == [
        "a", "--port", "1", "--", "--model", "b"]  # fmt: skip


def test_model_id_revision_and_dtype_reach_load_unchanged(monkeypatch):
    import astrai.io.model as model_mod

    calls, loaded = [], types.SimpleNamespace(quantization=None)
    monkeypatch.setattr(model_mod, "load", lambda path, **kw: calls.append((path, kw)) or loaded)
    args = parse(GenerateConfig, ["Qwen/Qwen3-0.6B", "--revision", "abc", "--dtype", "half", "--prompt", "x",
                                  "--device", "cpu"])  # fmt: skip
    assert load_model(args) is loaded
    assert calls == [
        (
            "Qwen/Qwen3-0.6B",
            {"dtype": "float16", "device": "cpu", "revision": "abc", "quantize": None, "allow_outside_files": False},
        )
    ]
    for flag in ("--quantize", "--quantization", "-q"):  # ours, and vLLM's spellings
        load_model(parse(GenerateConfig, ["m", "--prompt", "x", "--device", "cpu", flag, "int8"]))
        assert calls[-1][1]["quantize"] == "int8"
    load_model(parse(GenerateConfig, ["m", "--prompt", "x", "--device", "cpu", "--allow-outside-model-files"]))
    assert calls[-1][1]["allow_outside_files"] is True


def test_chat_template_file_or_inline_replaces_the_tokenizers(model_dir, tmp_path, capsys):
    tok = astrai.load(model_dir).tokenizer
    messages = [{"role": "user", "content": "hi"}]
    custom = tok.with_chat_template(TEMPLATE).apply_chat_template(messages, tokenize=True)
    assert len(custom) != len(tok.apply_chat_template(messages, tokenize=True))
    assert tok.with_chat_template(TEMPLATE).chat_template == TEMPLATE and tok.chat_template != TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    inline = TEMPLATE.replace("\n", "\\n")  # as typed in a shell: vLLM decodes the escapes of inline templates
    assert read_chat_template(str(path)) == TEMPLATE and read_chat_template(inline) == TEMPLATE
    for value in (str(path), inline):
        main(["generate", model_dir, "--chat", "--prompt", "hi", "--max-tokens", "1", "--chat-template", value])
        assert f"{len(custom)} prompt tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", model_dir, "--prompt", "hi", "--chat-template", str(tmp_path / "missing.jinja")])
    assert exit_info.value.code == 2 and "looks like a file path" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gen_model_dir(model_dir, tmp_path_factory):
    """The tiny model with sampling defaults in its generation_config.json."""
    folder = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(model_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_k": 5}))
    return folder


def test_generation_config_auto_none_vllm_or_a_folder(gen_model_dir, tmp_path):
    model = astrai.load(gen_model_dir)
    assert sampling_defaults("auto", model) == {"temperature": 0.6, "top_k": 5}
    assert sampling_defaults("none", model) == sampling_defaults("vllm", model) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.8}))
    assert sampling_defaults(str(tmp_path), model) == {"top_p": 0.8}
    with pytest.raises(ValueError, match="auto, none, vllm or a folder"):
        sampling_defaults(str(tmp_path / "nope"), model)


def test_serve_passes_its_flags_to_the_engine_the_app_and_uvicorn(gen_model_dir, monkeypatch):
    import astrai.serve.app as app_mod
    import astrai.serve.server as server_mod

    built = []

    def fake_build_app(engine, **kwargs):
        built.append({"engine": engine, **kwargs})
        return app_mod.Starlette()

    def fake_server_config(app, limits, **kwargs):
        built[-1].update(app=app, uvicorn=kwargs)  # uvicorn.Config would reconfigure this process's logging

    class FakeServer:  # records instead of serving
        def __init__(self, config, engine):
            pass

        def run(self, sockets=None):
            pass

    monkeypatch.setattr(app_mod, "build_app", fake_build_app)
    monkeypatch.setattr(server_mod, "server_config", fake_server_config)
    monkeypatch.setattr(server_mod, "GracefulServer", FakeServer)
    base = ["serve", str(gen_model_dir), "--no-compile", "--no-cuda-graphs", "--port", "0"]
    main([*base, "--api-key", "k", "--enable-log-requests", "--log-level", "debug", "--generation-config", "none",
          "--max-num-seqs", "3", "--seed", "7", "--max-model-len", "64", "--allowed-origins", "http://a",
          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])  # fmt: skip
    main(base)
    flags, plain = built
    for run in built:
        run["engine"].shutdown()
    assert flags["sampling_defaults"] == {} and plain["sampling_defaults"] == {"temperature": 0.6, "top_k": 5}
    assert flags["log_requests"] is True and plain["log_requests"] is False
    assert flags["api_key"] == ("k",) and flags["model_name"] == plain["model_name"] == "m"
    engine = flags["engine"]
    assert (engine.config.max_running, engine.config.seed, engine.max_model_len) == (3, 7, 64)
    spec = engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3) and plain["engine"].config.speculative is None
    assert flags["uvicorn"]["log_level"] == "debug" and plain["uvicorn"]["log_level"] == "info"
    assert flags["uvicorn"]["log_config"]["loggers"]["astrai"]["level"] == "DEBUG"
    assert type(flags["app"]).__name__ == "CORSMiddleware" and type(plain["app"]).__name__ == "Starlette"


def test_log_level_routes_astrai_loggers_through_uvicorns_handler():
    config = logging_config("warning")
    assert config["loggers"]["astrai"] == {"handlers": ["default"], "level": "WARNING", "propagate": False}
    assert config["loggers"]["uvicorn"]["handlers"] == ["default"]  # uvicorn's own config is kept


def test_allowed_origins_take_plain_values_or_vllms_json_list():
    assert origin_list(('["http://a", "http://b"]', "http://c")) == ("http://a", "http://b", "http://c")
    with pytest.raises(ValueError, match="JSON list"):
        origin_list(("[http://a",))


def test_gpu_memory_utilization_is_a_share_of_total_memory():
    # 80 GiB device, 16 GiB of weights, 2 GiB activation headroom: 0.9 of 80 GiB leaves 72 - 16 - 2 = 54 GiB of KV
    budget = kv_budget_for_utilization(0.9, total=80 * GiB, free=62 * GiB, in_use=16 * GiB, headroom=2 * GiB)
    assert budget == int(0.9 * 80 * GiB) - 18 * GiB
    # other processes hold memory: never more than is free
    assert kv_budget_for_utilization(0.9, total=80 * GiB, free=30 * GiB, in_use=16 * GiB, headroom=2 * GiB) == 28 * GiB
    with pytest.raises(ValueError, match="no memory left for the KV cache.*raise gpu_memory_utilization"):
        kv_budget_for_utilization(0.2, total=80 * GiB, free=62 * GiB, in_use=16 * GiB, headroom=2 * GiB)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)


def test_engine_sizes_its_pool_from_gpu_memory_utilization_on_cuda_only(model_dir, monkeypatch, capsys):
    """`kv_pool_pages` (the engine's pool size) on a fake CUDA memory reading: vLLM's meaning, not the free-memory
    share."""
    cfg = astrai.load(model_dir).config
    total, free, reserved = 10 * GiB, 8 * GiB, 1 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)

    def pages(device: str, **engine_kw) -> int:
        model = types.SimpleNamespace(config=cfg, dtype=torch.float32, device=torch.device(device))
        return kv_pool_pages(EngineConfig(**engine_kw), model, torch.device(device), per_token, 10**9)

    per_token = kv_bytes_per_token(cfg, torch.float32)
    headroom = activation_headroom(cfg, torch.float32, max_step_tokens=2048, max_running=64)
    expected = (int(0.5 * total) - reserved - headroom) // per_token // 16 + 1
    assert pages("cuda:0", gpu_memory_utilization=0.5) == expected
    assert pages("cuda:0") == int(free * 0.85) // per_token // 16 + 1  # unset: 85% of the free memory
    assert pages("cpu", gpu_memory_utilization=0.5) == pages("cpu") == (1 << 30) // per_token // 16 + 1  # ignored
    with pytest.raises(SystemExit) as exit_info:  # the CLI refuses a bad value before loading the model
        main(["serve", model_dir, "--gpu-memory-utilization", "1.5"])
    assert exit_info.value.code == 2 and "gpu_memory_utilization must be in (0, 1]" in capsys.readouterr().err
