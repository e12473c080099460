"""Shared test helpers: tolerance checks that report max and mean differences."""

from __future__ import annotations

import contextlib
import signal

import torch

# Kernel tests run on the GPU (compiled) when there is one, else on the CPU under TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# dtype -> (atol, rtol) used by kernel and model comparisons.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float = 0.0, msg: str = ""):
    """Like torch.testing.assert_close but reports the max and mean absolute difference on failure."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    nan_a, nan_e = int(a.isnan().sum()), int(e.isnan().sum())
    if nan_a or nan_e:
        raise AssertionError(f"{msg} NaNs: {nan_a} in actual, {nan_e} in expected")
    diff = (a - e).abs()
    bound = atol + rtol * e.abs()
    if not bool((diff <= bound).all()):
        raise AssertionError(
            f"{msg} not close: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
            f"atol {atol}, rtol {rtol}, worst at {tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])}"
        )


# ---- tiny random transformers checkpoints (independent reference models) ------------------------------------

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A random tiny transformers causal LM of `family` (eager attention, eval mode).

    Norm gains and biases are perturbed away from their 1/0 init so that tests see them.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    kwargs = {**TINY, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **overrides}
    if family in ("mistral", "mixtral"):
        kwargs.setdefault("sliding_window", None)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf(model, folder, **kwargs) -> str:
    """`save_pretrained` quietly; returns the folder as str."""
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(str(folder), **kwargs)
    return str(folder)


def hf_and_loaded(case: str, hf, tmp_path_factory) -> tuple:
    """(case, the transformers model, astrai's load of its saved folder): the parity tests' fixture value."""
    from astrai.io.model import load

    return case, hf, load(save_hf(hf, tmp_path_factory.mktemp(case)))


def tiny_model_dir(folder, *, seed: int = 0, max_position_embeddings: int = 2048) -> str:
    """Save a tiny random qwen3-shaped astrai model with a locally trained tokenizer and a ChatML template."""
    from astrai.io.model import Model, save
    from astrai.io.templates import chatml_template
    from astrai.io.tokenizer import train_tokenizer
    from astrai.models.config import ModelConfig
    from astrai.models.decoder import init_params

    corpus = ["hello world, this is a tiny corpus", "the quick brown fox jumps over the lazy dog"] * 4
    tok = train_tokenizer(corpus, vocab_size=300, chat_template=chatml_template())
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=(tok.eos_token_id,),
    )
    model = Model(config=cfg, params=init_params(cfg, seed=seed), tokenizer=tok, eos_token_ids=(tok.eos_token_id,))
    return str(save(model, folder))


def spec_engine(model, spec, **config):
    """A small eager engine with speculative config `spec` (None: plain) for the speculative-decoding tests: 4096
    tokens of KV in 16-token pages, seed 0; `config` overrides any EngineConfig field."""
    from astrai.inference.engine import Engine, EngineConfig

    options = {"compile": False, "kv_budget_tokens": 4096, "page_size": 16, "seed": 0, **config}
    return Engine(model, EngineConfig(speculative=spec, **options))


def draft_pair_dirs(folder, *, damp: float = 0.05) -> tuple[str, str]:
    """Save a tiny 2-layer target and its 1-layer draft (the target's first block, same tokenizer and head) under
    `folder`; the target's second block is damped by `damp`, so the draft's greedy guesses mostly pass."""
    import attrs

    from astrai.io.model import Model, load, save

    target = load(tiny_model_dir(f"{folder}/base", max_position_embeddings=512))
    block = target.params.blocks[1]
    with torch.no_grad():
        block.attn.o_proj.weight.mul_(damp)
        block.mlp.down_proj.weight.mul_(damp)
    draft = Model(config=attrs.evolve(target.config, num_hidden_layers=1),
                  params=attrs.evolve(target.params, blocks=target.params.blocks[:1]), tokenizer=target.tokenizer,
                  eos_token_ids=target.eos_token_ids)  # fmt: skip
    return str(save(target, f"{folder}/target")), str(save(draft, f"{folder}/draft"))


def randomize_routers(hf, *, weight_std: float = 0.5, bias_std: float = 0.3):
    """Make MoE routing depend on the input (some families start routers at zero) and give DeepSeek-V3's choice
    bias (a zero buffer) values, in place; returns `hf`."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, weight_std)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, bias_std)
    return hf


def assert_logits_match_hf(model, hf, ids, *, msg: str = "") -> None:
    """astrai's logits for `ids` equal the transformers model's within 1e-4 of the logit scale (fp32 parity)."""
    from astrai.models.decoder import forward

    with torch.no_grad():
        expected = hf(ids).logits
    actual = forward(model.params, model.config, ids)
    assert_close(actual, expected, atol=1e-4 * max(expected.abs().max().item(), 1.0), msg=msg)


def sentencepiece_tokenizer(corpus, *, style: str, vocab_size: int):
    """A Llama-style BPE trained on `corpus`: `▁` word marker, 256 `<0xNN>` byte-fallback tokens at ids 3..258,
    BOS added on encode. `style` "llama2": Llama 2's normalizer (prepend and replace spaces with `▁`); "metaspace":
    a Metaspace pre-tokenizer (Mistral/Gemma-style)."""
    import json

    import tokenizers
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from astrai.io.tokenizer import Tokenizer

    trainer_tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], show_progress=False)
    trainer_tok.train_from_iterator(list(corpus), trainer)
    state = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    if style == "llama2":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)]
        )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def run_ranks(cmd: list[str], *, world: int = 2, timeout: float = 240) -> None:
    """Run `cmd` as `world` gloo rank processes on 127.0.0.1 (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set,
    one thread each); kill them all past `timeout` seconds; assert every rank exited 0 (else show its output)."""
    import os
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]  # fmt: skip
    wait_ranks(procs, timeout)


def wait_ranks(procs: list, timeout: float) -> None:
    """Wait for every process (killing them all past `timeout` seconds); assert each exited 0 (else show its
    output)."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]


def valid_json(text: str, schema: dict) -> bool:
    """Whether `text` is JSON that validates against `schema` (jsonschema is the independent validator)."""
    import json

    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def grammar_takes(view, grammar, ids) -> bool:
    """Whether a compiled grammar takes the token `ids` one by one (each in its mask) and may end after them."""
    from astrai.inference.grammar import (
        accept,
        allocate_bitmask,
        bitmask_allowed,
        fill_bitmask,
        is_accepting,
        new_matcher,
    )

    matcher = new_matcher(grammar)
    for token in ids:
        mask = allocate_bitmask(1, view.vocab_size)
        fill_bitmask(matcher, mask[0])
        if not bitmask_allowed(mask, view.vocab_size)[0, token] or not accept(matcher, token):
            return False
    return is_accepting(matcher)


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in the block after `seconds`: an attack that used to hang fails instead of stalling the
    suite (SIGALRM, so the main thread only, as pytest runs tests)."""

    def expire(*_):
        raise TimeoutError(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def engine_with_added_tokens(corpus: list[str], added: list[str]):
    """An engine over a tiny random model whose locally trained vocabulary has `added` as added plain (not special)
    tokens, as real vocabularies have tool markup, so a logit_bias can make the model write one at once."""
    from astrai.inference.engine import Engine, EngineConfig
    from astrai.io.model import Model
    from astrai.io.tokenizer import Tokenizer, train_tokenizer
    from astrai.models.config import ModelConfig
    from astrai.models.decoder import init_params

    trained = train_tokenizer(corpus, vocab_size=300)
    backend = trained.backend
    backend.add_tokens(added)  # added, not special: they match text
    tok = Tokenizer(backend, special_tokens=trained.special_tokens_map, eos_token_ids=trained.eos_token_ids)
    assert all(len(tok.encode(t, add_special_tokens=False)) == 1 for t in added)
    assert tok.special_token_ids.isdisjoint(tok.encode("".join(added), add_special_tokens=False))
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      eos_token_id=(tok.eos_token_id,))  # fmt: skip
    model = Model(config=cfg, params=init_params(cfg, seed=0), tokenizer=tok, eos_token_ids=(tok.eos_token_id,))
    with Engine(model, EngineConfig(max_running=8, compile=False, kv_budget_tokens=8192)) as engine:
        yield engine


# Prepended to every `assert_compiles_for_gpu` script: `build(fn, types, consts, **options)` compiles the JIT
# function `fn` for sm_80 and sm_90 (arguments typed by `types`, "i32" when unnamed; `consts` as constexprs) and
# exits naming the target and the variant when the compiler rejects it.
AOT_PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    for arch in (80, 90):
        try:
            triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as e:
            raise SystemExit(f"{fn.__name__} for sm_{arch}, {types} {consts}: {e}")
"""


def assert_compiles_for_gpu(script: str) -> None:
    """Run `script` (it builds Triton kernels for GPU targets with `triton.compile`, e.g. by `AOT_PRELUDE`'s `build`)
    in a fresh interpreter without TRITON_INTERPRET, so the real JIT functions are compiled, not interpreted; fail
    with its stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def random_biases(params, *, seed: int = 0, std: float = 0.1):
    """`params` with every bias leaf (each name ending in `bias`: the projections' biases, MoE's routing bias)
    replaced by seeded normal(0, `std`) values in its dtype and device; the other leaves are shared, not copied.

    `init_params` makes biases zero, so a test on it cannot see a bias added twice (on every tensor-parallel rank),
    taken from the wrong shard or multiplied by an int8 scale. Raises ValueError when the tree has no bias: a caller
    that meant to test biases would silently test none.
    """
    from astrai.tree import from_named_tensors, named_tensors

    gen = torch.Generator().manual_seed(seed)
    named = named_tensors(params)
    if not any(name.endswith("bias") for name in named):
        raise ValueError("the tree has no bias leaf to fill (turn on the config's bias switches)")
    filled = {
        name: (torch.randn(t.shape, generator=gen) * std).to(t.dtype).to(t.device) if name.endswith("bias") else t
        for name, t in named.items()
    }
    return from_named_tensors(params, filled)


@contextlib.contextmanager
def cpu_kernels_off():
    """Run the block as under `ASTRAI_CPU_KERNELS=0`: the variable is set and the process's kernel library is
    swapped for a disabled one, so `supports()` answers False and int8/fp32 products take the widened or loop path;
    both are restored after. (`astrai.cpu_kernels.library` reads the variable once per process, at its first load.)
    """
    import os

    from astrai.cpu_kernels import decode_attention, library, matvec, pointwise

    saved = (os.environ.get("ASTRAI_CPU_KERNELS"), library._LIBRARY, matvec._KERNELS, decode_attention._KERNELS,
             pointwise._KERNELS)  # fmt: skip
    os.environ["ASTRAI_CPU_KERNELS"] = "0"
    library._LIBRARY = library.Library(reason="disabled by ASTRAI_CPU_KERNELS=0")
    # fresh binding caches: bound while disabled they would stay empty (and the kernels off) for the whole process
    matvec._KERNELS, decode_attention._KERNELS, pointwise._KERNELS = {}, None, {}
    try:
        yield
    finally:
        env, library._LIBRARY, matvec._KERNELS, decode_attention._KERNELS, pointwise._KERNELS = saved
        if env is None:
            os.environ.pop("ASTRAI_CPU_KERNELS", None)
        else:
            os.environ["ASTRAI_CPU_KERNELS"] = env


def random_lora(params, cfg, seed: int, std: float = 0.3):
    """`init_lora`'s A with a random, non-zero B (a fresh adapter's B = 0 would change nothing): a LoRA adapter
    tree whose effect tests can see."""
    from astrai.nn.lora import LoRAAdapter, init_lora

    g = torch.Generator().manual_seed(seed)
    return {p: LoRAAdapter(ad.lora_a, torch.randn(ad.lora_b.shape, generator=g) * std, ad.scaling)
            for p, ad in init_lora(params, cfg, seed=seed).items()}  # fmt: skip
