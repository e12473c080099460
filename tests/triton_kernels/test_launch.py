"""`TunedKernel`: autotuned kernels go through the autotuner once per key, then straight to the kernel.

On CPU the kernels run under the Triton interpreter. The tuners here keep one config per key (a prune, or
`ASTRAI_TRITON_AUTOTUNE=0`), so choosing a config runs no timing and the interpreter can run the whole path. On
CPU the four real launchers (split-KV decode, extend attention, MLA decode, the MoE grouped GEMM) also run their GPU
branch, by telling their module it is not interpreting: same blocks and grid as on a GPU, through the tuner,
checked against the plain-torch references, alone and inside a tiny model's generation (on a GPU every kernel test
takes that branch).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from astrai.triton_kernels import _launch, decode_attention, extend_attention, fused_moe, mla_decode
from astrai.triton_kernels._launch import TunedKernel
from helpers import DEVICE, TOLERANCES, assert_close
from tests.triton_kernels.test_extend_attention import make_batch


@triton.jit
def _add_block_kernel(x_ptr, out_ptr, n, TAG: tl.constexpr, BLOCK: tl.constexpr):
    """out = x + BLOCK: the output shows which config ran."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + BLOCK, mask=mask)


def _by_tag(configs: list, named_args: dict, **kwargs) -> list:
    # one config per key, so the tuner times nothing: TAG 1 takes BLOCK 16, any other TAG BLOCK 32
    return [c for c in configs if (c.kwargs["BLOCK"] == 16) == (kwargs["TAG"] == 1)]


def _tuner(pre_hook=None) -> triton.runtime.Autotuner:
    configs = [triton.Config({"BLOCK": b}, num_warps=4, pre_hook=pre_hook) for b in (16, 32)]
    return triton.autotune(configs=configs, key=["TAG"], prune_configs_by={"early_config_prune": _by_tag})(
        _add_block_kernel
    )


def _count_runs(monkeypatch: pytest.MonkeyPatch, tuner) -> list[int]:
    """Count the autotuner's `run` calls (its `__getitem__` goes through the attribute)."""
    calls, run = [0], tuner.run

    def counted(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(tuner, "run", counted)
    return calls


def _launch_add(kernel: TunedKernel, n: int, tag: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.arange(n, dtype=dtype, device=DEVICE)
    out = torch.zeros_like(x)
    kernel.launch(lambda meta: (triton.cdiv(n, meta["BLOCK"]),), (x, out, n), {"TAG": tag})
    return out - x


def test_tunes_once_per_key_and_reuses_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = TunedKernel(_tuner())
    runs = _count_runs(monkeypatch, kernel.autotuner)
    for _ in range(3):
        assert (_launch_add(kernel, 50, tag=1) == 16).all()
    assert runs[0] == 1
    # a new key (TAG 2) is tuned, and gets its own config: a launcher that kept one config for every key would add
    # 16 here
    for _ in range(2):
        assert (_launch_add(kernel, 70, tag=2) == 32).all()
    assert runs[0] == 2
    assert (_launch_add(kernel, 50, tag=1, dtype=torch.float64) == 16).all()  # dtypes are part of the key
    assert runs[0] == 3
    assert (_launch_add(kernel, 90, tag=1) == 16).all()
    assert runs[0] == 3


def test_keys_are_the_autotuners() -> None:
    kernel = TunedKernel(_tuner())
    _launch_add(kernel, 50, tag=1)
    _launch_add(kernel, 50, tag=2, dtype=torch.float64)
    ours = {tuple(str(v) if isinstance(v, torch.dtype) else v for v in key) for key in kernel.chosen()}
    assert ours == set(kernel.autotuner.cache)
    assert ours == {(1, "torch.float32", "torch.float32"), (2, "torch.float64", "torch.float64")}


def test_switched_off_every_launch_goes_through_the_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "CACHE_CONFIGS", False)
    kernel = TunedKernel(_tuner())
    runs = _count_runs(monkeypatch, kernel.autotuner)
    for _ in range(3):
        assert (_launch_add(kernel, 50, tag=1) == 16).all()
    assert runs[0] == 3 and not kernel.chosen()


@pytest.mark.parametrize(("value", "off"), [("0", True), (" OFF", True), ("false", True), ("no", True),
                                            ("1", False), ("", False), ("on", False), ("yes", False)])  # fmt: skip
def test_the_switch_reads_like_the_other_switches(value: str, off: bool) -> None:
    assert _launch.switched_off(value) is off


def test_configs_with_a_pre_hook_always_go_through_the_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    hooked = []
    kernel = TunedKernel(_tuner(pre_hook=lambda args: hooked.append(args["n"])))
    runs = _count_runs(monkeypatch, kernel.autotuner)
    for n in (10, 20, 30):
        assert (_launch_add(kernel, n, tag=1) == 16).all()
    assert runs[0] == 3 and hooked == [10, 20, 30] and not kernel.chosen()


@pytest.fixture
def gpu_branch(monkeypatch: pytest.MonkeyPatch):
    """The launchers' GPU branch under the interpreter: one config per key, the tuners' memory emptied."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernel tests run this branch")
    monkeypatch.setenv("ASTRAI_TRITON_AUTOTUNE", "0")
    tuned = ((decode_attention, "_decode_stage1_tuned"), (extend_attention, "_extend_attention_tuned"),
             (fused_moe, "_moe_gemm_tuned"), (mla_decode, "_mla_stage1_tuned"))  # fmt: skip
    for module, name in tuned:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, "interpreting", lambda: False)
        monkeypatch.setattr(kernel, "_configs", {})
        monkeypatch.setattr(kernel.autotuner, "cache", {})


def test_decode_attention_through_the_tuned_launch(gpu_branch, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = decode_attention._decode_stage1_tuned
    runs = _count_runs(monkeypatch, kernel.autotuner)
    pages, page_size = torch.randperm(12).view(3, 4).to(torch.int32), 16
    k_cache, v_cache = torch.randn(2, 12 * page_size, 2, 32).unbind(0)
    for lens in ([5, 40, 17], [64, 1, 33]):
        q, seq_lens = torch.randn(3, 4, 32), torch.tensor(lens, dtype=torch.int32)
        args = (q, k_cache, v_cache, pages, seq_lens)
        out = decode_attention._decode_attention(*args, page_size, 0.2, 0, 1)
        ref = decode_attention.decode_attention_ref(*args, page_size=page_size, scale=0.2)
        assert_close(out, ref, atol=TOLERANCES[torch.float32][0], msg=f"lens {lens}")
    assert runs[0] == 1 and len(kernel.chosen()) == 1


def test_extend_attention_through_the_tuned_launch(gpu_branch, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = extend_attention._extend_attention_tuned
    runs = _count_runs(monkeypatch, kernel.autotuner)
    for q_lens, prefixes in (([3, 9], [0, 5]), ([7, 2], [16, 0])):
        batch = make_batch(q_lens, prefixes, 4, 2, 32, 16, torch.float32)
        out = extend_attention.extend_attention(**batch, scale=0.2)
        ref = extend_attention.extend_attention_ref(**batch, scale=0.2)
        assert_close(out, ref, atol=TOLERANCES[torch.float32][0], msg=f"q_lens {q_lens}")
    assert runs[0] == 1 and len(kernel.chosen()) == 1


def test_host_helpers_match_triton() -> None:
    """The launchers' plain-Python `cdiv` and `next_power_of_2` agree with Triton's constexpr functions."""
    from astrai.triton_kernels._common import cdiv, next_power_of_2

    for n in range(-3, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_generation_through_the_gpu_branch_equals_torch(gpu_branch, tmp_path, monkeypatch) -> None:
    """A tiny model's greedy generation with the attention kernels on their GPU branch (tuned launch) matches the
    torch backend; each tuner chose once per key, not once per layer or step."""
    import astrai
    from astrai.inference.generate import generate_ids
    from helpers import save_hf, tiny_hf_model

    model = astrai.load(save_hf(tiny_hf_model("qwen3", head_dim=16, num_hidden_layers=2), tmp_path))
    prompts = [[3, 4, 5, 6, 7], [9] * 11, [100, 101]]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")
    reference = generate_ids(model, prompts, max_tokens=6, stop_token_ids=[])
    kernels = (decode_attention._decode_stage1_tuned, extend_attention._extend_attention_tuned)
    runs = [_count_runs(monkeypatch, kernel.autotuner) for kernel in kernels]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert generate_ids(model, prompts, max_tokens=6, stop_token_ids=[]) == reference
    for kernel, count in zip(kernels, runs, strict=True):
        assert count[0] == len(kernel.chosen()) >= 1


def test_moe_generation_through_the_gpu_branch_equals_torch(gpu_branch, tmp_path, monkeypatch) -> None:
    """The fused experts' grouped GEMM on its GPU branch (GPU tiles, tuned launch) in a MoE model's generation."""
    import astrai
    from astrai.inference.generate import generate_ids
    from helpers import save_hf, tiny_hf_model

    hf = tiny_hf_model("qwen3_moe", head_dim=16, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16)  # fmt: skip
    model = astrai.load(save_hf(hf, tmp_path))
    prompts = [[3, 4, 5, 6, 7], [9] * 11]
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "torch")
    reference = generate_ids(model, prompts, max_tokens=5, stop_token_ids=[])
    runs = _count_runs(monkeypatch, fused_moe._moe_gemm_tuned.autotuner)
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", "triton")
    assert generate_ids(model, prompts, max_tokens=5, stop_token_ids=[]) == reference
    assert runs[0] == len(fused_moe._moe_gemm_tuned.chosen()) >= 1


def test_mla_decode_through_the_tuned_launch(gpu_branch, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = mla_decode._mla_stage1_tuned
    runs = _count_runs(monkeypatch, kernel.autotuner)
    rank, rope_dim, page_size = 32, 16, 16
    pages = torch.randperm(12).view(3, 4).to(torch.int32)
    cache = torch.randn(12 * page_size, rank + rope_dim)
    for lens in ([5, 40, 17], [64, 1, 0]):
        q, seq_lens = torch.randn(3, 4, rank + rope_dim), torch.tensor(lens, dtype=torch.int32)
        kw = dict(kv_lora_rank=rank, page_size=page_size, scale=0.15)
        out = mla_decode.mla_decode(q, cache, pages, seq_lens, **kw)
        ref = mla_decode.mla_decode_ref(q, cache, pages, seq_lens, **kw)
        assert_close(out, ref, atol=TOLERANCES[torch.float32][0], msg=f"lens {lens}")
    assert runs[0] == 1 and len(kernel.chosen()) == 1
