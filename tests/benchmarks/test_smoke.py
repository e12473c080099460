"""Each benchmark's `--smoke` mode runs on CPU and ends with its JSON report (what CI can run of them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, tmp_path: Path, *, timeout: int, args: tuple[str, ...] = (), **env: str) -> dict:
    """Run `benchmarks/<script> --smoke [args]`; its last stdout line is the JSON report, also written to --out."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path / "out.json"), *args],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "out.json").read_text())
    return report


@pytest.mark.parametrize(
    "script",
    [
        "bench_attention.py",
        "bench_rotary.py",
        pytest.param("bench_forward.py", marks=pytest.mark.slow),  # ~22 s: transformers and astrai, eager and
        # compiled; bench_cpu_attention's smoke runs its model builder and bandwidth probe
        # ~15 s: compiles two engines; the engine's own tests (tests/astrai/inference) check what it measures
        pytest.param("bench_engine.py", marks=pytest.mark.slow),
        "bench_host.py",
        # ~11 s (two gloo ranks); tests/astrai/models/test_tp.py and inference/test_tp_engine.py check TP itself
        pytest.param("bench_tp.py", marks=pytest.mark.slow),
        "bench_packed_linear.py",
        # ~13 s; tests/cpu_kernels/test_matvec.py checks the kernel against its reference
        pytest.param("bench_matvec.py", marks=pytest.mark.slow),
        "bench_cpu_attention.py",
        "bench_cpu_ops.py",  # ~6 s: two worker processes
        # ~55 s: compiles two engines' and two bare decode steps; test_fuse_engine.py and test_param_guards.py
        # (tests/astrai/inference) check both choices themselves
        pytest.param("bench_step_layout.py", marks=pytest.mark.slow),
        pytest.param("bench_train.py", marks=pytest.mark.slow),
    ],  # ~30 s on 2 cores: compiles three train steps
)
def test_smoke_mode_reports_json(script, tmp_path):
    report = _smoke(script, tmp_path, timeout=600, TRITON_INTERPRET="1")
    if "rows" in report:  # kernel smokes compare against their references
        assert report["rows"] and all(row["ok"] for row in report["rows"])
    elif report.get("benchmark") == "bench_train":  # the three steps agreed on the losses and all were measured
        assert all(r["tok_s"] > 0 for r in report["results"]) and len(report["results"]) == 3
        ref = report["losses"]["astrai"]
        assert all(losses == pytest.approx(ref, rel=1e-4) for losses in report["losses"].values())
        assert report["goal"]["memory_ratio"] is not None and report["results"][0]["step_peak_mib"] > 0
    elif report.get("benchmark") == "bench_cpu_ops":  # both arms measured, unless this machine has no kernels
        assert report["results"] or report["skipped"] or report["ops_reason"], report
        assert all(r["cpp_median"] > 0 and r["python_median"] > 0 for r in report["results"])
    elif report.get("benchmark") == "bench_host":  # every component measured
        assert {r["component"] for r in report["results"]} == {"meta", "engine", "sampling", "detok"}
        assert all(r["us_per_step"] > 0 for r in report["results"])
    elif report.get("benchmark") == "bench_tp":  # TP=2 halves the per-rank weights and KV (outputs were equal)
        one, two = report["results"]
        assert two["param_mib_per_rank"] < 0.6 * one["param_mib_per_rank"]
        assert two["kv_bytes_per_token_per_rank"] * 2 == one["kv_bytes_per_token_per_rank"] and two["warm_tok_s"] > 0
    elif report.get("benchmark") == "bench_packed_linear":  # every layout measured at every row count
        assert [r["rows"] for r in report["results"]] == [1, 16] and report["groups"] < report["weights"]
        assert all(r[f"{k}_ms"] > 0 for r in report["results"] for k in ("f_linear", "packed", "packed_groups"))
    elif report.get("benchmark") == "bench_matvec":  # every provider measured (where this CPU has the kernel)
        assert report["read_bandwidth_gbs"] > 0
        assert all(r[f"{k}_gbs"] > 0 for r in report["results"] for k in ("f_linear", "inductor", "kernel_groups"))
        for row in report["one_graph"]:  # one row in one graph vs one call (the graphs' products agreed inside)
            assert all(row[f"{k}_gbs"] > 0 for k in ("probe", "one_call", "graph_loop", "graph_kernel"))
    elif report.get("benchmark") == "bench_cpu_attention":  # every provider measured and agreeing (asserted inside)
        assert all(r[f"{k}_us"] > 0 for r in report["results"] for k in ("ref_eager", "ref_compiled"))
        assert report["read_bandwidth_gbs"] > 0
        (mixed,) = report["mixed"]  # the eager mixed step ran both ways and agreed
        assert mixed["on_ms"] > 0 and mixed["off_ms"] > 0 and mixed["max_logit_diff"] < 1e-4
    elif report.get("benchmark") == "bench_step_layout":  # both A/Bs ran, and each arm computed the same thing
        (fused,), guards = report["fused_projections"], report["param_guards"]
        assert fused["same_tokens"] and fused["apart_ms"]["median"] > 0 and fused["fused_ms"]["median"] > 0
        assert [g["model"] for g in guards] == ["real", "narrow"]
        assert all(g["identical"] and g["all_guards_us"]["median"] > 0 and g["served_us"]["median"] > 0 for g in guards)
    elif "results" in report:  # bench_forward: both sides produced positive rates
        assert all(r["hf_decode_tok_s"] > 0 and r["astrai_compiled_decode_tok_s"] > 0 for r in report["results"])
        assert all(r["hf_static_compile_decode_tok_s"] > 0 for r in report["results"])
    else:  # bench_engine: every section measured, and the radix saved prefill work, cold and more so warm
        single = report["single"]
        assert single["engine_tok_s"] > 0 and single["hf_tok_s"] > 0 and single["hf_static_compile_tok_s"] > 0
        assert report["batch"][0]["engine_tok_s"] > 0
        cold, warm = report["prefix"]["cold"], report["prefix"]["warm"]
        assert cold["on"]["prefill_tokens"] < cold["off"]["prefill_tokens"] == warm["off"]["prefill_tokens"]
        assert warm["on"]["prefill_tokens"] < cold["on"]["prefill_tokens"]
        staggered = report["staggered"]  # both arms of (g) ran every request
        assert [r["mixed_rows"] for r in staggered["rows"]] == ["kernel", "reference"]
        assert all(r["tok_s"] > 0 and r["steps"] > report["new_tokens"] for r in staggered["rows"])


def test_packed_linear_int8_smoke_reports_json(tmp_path):
    """bench_packed_linear --int8: the kernel, the widened weight and the float packs measured at 1 and 32 rows."""
    report = _smoke("bench_packed_linear.py", tmp_path, timeout=120, args=("--int8",))
    assert report["int8"] and [r["rows"] for r in report["results"]] == [1, 32]
    assert all(r[f"{k}_ms"] > 0 for r in report["results"] for k in ("int8_kernel", "int8_widened", "float_packed"))


def test_launch_smoke_reports_json(tmp_path):
    """bench_launch: both attention ops timed through the tuner's lookup and from the remembered config."""
    report = _smoke("bench_launch.py", tmp_path, timeout=120)
    assert [r["op"] for r in report["results"]] == ["decode_attention", "extend_attention"]
    assert all(r["tuner_us"] > 0 and r["remembered_us"] > 0 for r in report["results"])


@pytest.mark.slow  # ~12 s: compiles the decode step
def test_step_bound_smoke_reports_json(tmp_path):
    """bench_step_bound: astrai's compiled step and the whole-step prototype both timed, with roofline fractions
    (or the run says why the prototype cannot run here)."""
    report = _smoke("bench_step_bound.py", tmp_path, timeout=300)
    if report.get("skipped"):
        return
    assert [r["arm"] for r in report["results"]] == ["astrai compiled", "whole-step prototype"]
    assert all(r["ms"] > 0 and 0 < r["roofline"] < 1.5 for r in report["results"])


def test_serve_smoke_reports_json(tmp_path):
    """bench_serve: the HTTP run (client in its own process) and the engine run both produced every token."""
    report = _smoke("bench_serve.py", tmp_path, timeout=300)
    expected = report["requests"] * report["new_tokens"]
    assert [(r["errors"], r["tokens"]) for r in report["results"]] == [(0, expected)] * 2
    assert report["client"] == "separate process" and all(r["output_tok_s"] > 0 for r in report["results"])


@pytest.mark.slow  # ~11 s; in CI tests/astrai/serve (test_hostile_http, the APIs' disconnect tests) make these attacks
def test_soak_smoke_reports_json(tmp_path):
    """bench_soak: streams, disconnects and bad requests mixed; 0 server errors and every KV page free after."""
    report = _smoke("bench_soak.py", tmp_path, timeout=300)
    assert report["ok"] and report["server_errors"] == 0 and report["final_request_ok"]
    assert report["kv"]["used_after"] == 0 and report["kv"]["free_after_reset"] == report["kv"]["pages_total"]
    by = {row["action"]: row for row in report["actions"]}
    assert by["stream"]["ok"] > 0 and by["bad"]["4xx"] > 0 and by["bad"]["5xx"] == 0
    assert {"big_reply", "long_prompt", "embed", "salted", "slow_reader", "framing", "health"} <= set(by)
    assert report["health"]["probes"] > 0 and report["peak_rss_mib"] >= report["rss_end_mib"] > 0


@pytest.mark.slow  # ~13 s; tests/astrai/models' MoE parity tests check the model it measures
def test_moe_smoke_reports_json(tmp_path):
    """bench_moe: the logits check passed, every variant and shape has a positive rate, the KV table is filled."""
    report = _smoke("bench_moe.py", tmp_path, timeout=600)
    check = report["logits_check"]
    assert check["ok"] and check["max_abs_diff"] <= check["tolerance"]
    variants = {"astrai", "astrai_compiled", "hf_eager", "hf_eager_loop"}
    assert {r["variant"] for r in report["prefill"]} == variants and len(report["prefill"]) == 2 * len(variants)
    assert all(r["tok_s"] > 0 for r in report["prefill"])
    by = {(r["model"], r["layout"].split()[0]): r["bytes_per_token"] for r in report["kv_bytes"]}
    assert by[("deepseek-v3", "MLA")] == 61 * 576 * 2 and by[("llama3.1-8b", "GQA")] == 2 * 8 * 128 * 32 * 2


def test_grammar_smoke_reports_json(tmp_path):
    """bench_grammar: every installed engine compiled each schema, kept every valid document's token in its mask."""
    report = _smoke("bench_grammar.py", tmp_path, timeout=300)
    assert report["results"] and report["machine"]["cores"] > 0
    for r in report["results"]:
        assert set(r["schemas"]) == {"small", "nested", "tool_30"} and r["view_ms"]["median"] > 0
        assert all(s["mask_ms"]["n"] >= 50 and s["compile_cold_ms"]["median"] > 0 for s in r["schemas"].values())
        assert r["robustness"]["invalid"] == 0


def test_throughput_smoke_reports_json(tmp_path):
    """bench_throughput: astrai and the transformers baseline ran the workload, under its lower bound, side by side."""
    report = _smoke("bench_throughput.py", tmp_path, timeout=120)
    assert report["output_tokens"] > 0 and report["machine"]["read_gbs"] > 0 and report["bound"]["bound_s"] > 0
    assert set(report["results"]) == {"astrai", "eager"} and report["timed_compiles"]["astrai"] == 0
    for result in report["results"].values():
        assert 0 < result["of_bound"]["max"] < 1 and result["output_tok_s"]["min"] > 0
    astrai = report["results"]["astrai"]
    assert 0 < astrai["ttft_p50"]["median"] <= astrai["ttft_p99"]["median"] and astrai["itl_p90"]["median"] > 0
    assert report["results"]["eager"]["astrai_over_this"]["median"] > 0


@pytest.mark.slow  # ~24 s: compiles two engines; tests/astrai/models/test_quantize.py checks int8 compiled and eager
def test_quant_smoke_reports_json(tmp_path):
    """bench_quant: fp32 and int8 (bf16 too outside smoke) ran through astrai.generate_ids; int8 reads a quarter
    of fp32's bytes.

    The quality part needs a trained model (`runs/quickstart/model`): pointed at a missing folder, it is skipped
    and the report says so (an empty list)."""
    args = ("--quality-model", str(tmp_path / "missing"), "--step-rows", "2", "--rounds", "1")
    report = _smoke("bench_quant.py", tmp_path, timeout=300, args=args)
    rows = {r["weights"]: r for r in report["speed"]}
    assert set(rows) >= {"float32", "float32 + int8"}
    assert all(r["tok_s"] > 0 for r in rows.values()) and report["quality"] == []
    assert rows["float32 + int8"]["decode_mib"] < 0.3 * rows["float32"]["decode_mib"]
    assert 0 <= report["int8_greedy_tokens_before_divergence"] <= report["new_tokens"]
    steps = {r["weights"]: r for r in report["steps"]}
    assert set(steps) == {"float32", "float32 + int8", "bfloat16", "bfloat16 + int8"}
    assert all(r["rows"] == 2 and r["step_ms"] > 0 for r in steps.values()) and steps["float32"]["vs_fp32"] == 1.0


@pytest.mark.slow  # ~20 s: compiles an engine and transformers' static-cache generate
def test_notebook_smoke_reports_json(tmp_path):
    """bench_notebook: transformers eager and static cache + compile, then astrai's cached compiled and eager
    engines and the engine per call, each with a rate and its ratio to both transformers paths."""
    report = _smoke("bench_notebook.py", tmp_path, timeout=300)
    paths = [r["path"] for r in report["rows"]]
    assert paths[:2] == ["transformers generate (eager)", "transformers generate (static cache + compile)"]
    assert paths[2] == "astrai cached, compiled" and len(paths) == 5
    assert all(r["tok_s"] > 0 and r["vs_hf"] > 0 and r["vs_hf_static_compile"] > 0 for r in report["rows"])
    assert report["rows"][2]["cold_first_call_s"] > 0 and report["tokens_checked"] == report["new_tokens"]


def test_structured_smoke_reports_json(tmp_path):
    """bench_structured: both modes ran the same number of tokens; the mask time was measured."""
    report = _smoke("bench_structured.py", tmp_path, timeout=300)
    free, schema = report["rows"]
    assert (free["mode"], schema["mode"]) == ("free", "json_schema")
    assert free["tokens"] == schema["tokens"] > 0 and schema["vs_free"] > 0
    assert report["masks"]["masks"] > 0 and report["masks"]["single_us_p50"] > 0


@pytest.mark.slow  # ~35 s on 2 cores: compiles the decode step
def test_profile_step_smoke_measures_both_step_kinds(tmp_path):
    """profile_step: a decode step and a mixed step through the compiled and the eager prefill were timed and
    profiled; the prefill's GEMMs were found, and the eager step runs more operators than the compiled one.
    `--tuner-launch-at` adds each mixed step with the autotuned kernels launched through the tuner (the same
    computation on CPU, where no Triton kernel runs)."""
    args = ("--trace-dir", str(tmp_path / "traces"), "--tuner-launch-at", "16")
    report = _smoke("profile_step.py", tmp_path, timeout=600, args=args)
    decode, compiled, compiled_tuner, eager, eager_tuner = report["rows"]
    assert [(r["step"], r["prefill"], r["launch"]) for r in report["rows"]] == [
        ("decode", "-", "cached"), ("mixed", "compiled", "cached"), ("mixed", "compiled", "tuner"),
        ("mixed", "eager", "cached"), ("mixed", "eager", "tuner")]  # fmt: skip
    assert compiled_tuner["launches"] == compiled["launches"] and eager_tuner["launches"] == eager["launches"]
    assert all(r["ms"] > 0 for r in report["rows"])
    for mixed in (compiled, eager):
        assert mixed["gemm_ms"] > 0 and mixed["x_gemm"] >= 1 and mixed["launches"] > decode["launches"] > 0
    assert eager["launches"] > compiled["launches"]
    # CPU: the engine serves the checkpoint layout by default (fused projections are on by default on CUDA only)
    assert report["fused_projections"] is False and report["kernels_per_decode_step"] == decode["launches"]
    assert all(Path(row["trace"]).is_file() and row["top"] for row in report["rows"])


@pytest.mark.slow  # four compiled engines; tests/astrai/inference/test_speculative_engine.py checks the identity in CI
def test_spec_smoke_reports_json(tmp_path):
    """bench_spec: the random-weight workloads ran, the outputs were identical, and the repeat and prefix-draft
    workloads accepted guesses (the edit workloads train a model: not in a smoke run)."""
    report = _smoke("bench_spec.py", tmp_path, timeout=600)
    assert report["identical"] and {r["workload"] for r in report["results"]} == {"repeat", "nothing", "prefix-draft"}
    by = {r["workload"]: r for r in report["results"]}
    assert by["repeat"]["acceptance"] > 0 and by["prefix-draft"]["acceptance"] > 0
    assert all(r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in by.values())


@pytest.mark.slow  # ~15 s: ten eager engines; tests/astrai/inference/test_multi_lora*.py check the outputs
def test_lora_smoke_reports_json(tmp_path):
    """bench_lora: every arm (the base, 1/4/8 adapters, the plain engine, the naive merged engines) produced
    tokens in every round, the ratios are taken from them, and the profiled decode steps were measured."""
    report = _smoke("bench_lora.py", tmp_path, timeout=300, args=("--profile", "1"))
    assert [r["arm"] for r in report["results"]] == ["base", "lora1", "lora4", "lora8", "plain", "naive"]
    assert all(len(r["runs"]) == report["rounds"] and min(r["runs"]) > 0 for r in report["results"])
    ratios = {r["ratio"]: r for r in report["ratios"]}
    assert ratios["lora8_vs_base"]["goal"] == 0.70 and ratios["lora8_vs_naive"]["met"] is not None
    assert report["lora_stats"]["loaded"] == 8 and report["bandwidth_gbs"]["median"] > 0
    assert all(p["ms_per_step"] > 0 and p["ops"] for p in report["profile"].values())


@pytest.mark.slow  # ~20 s: five `astrai serve` processes and two router processes; tests/astrai/serve/test_router.py
# and test_replicas.py check the router recipe and the replicas themselves
def test_replicas_smoke_reports_json(tmp_path):
    """bench_replicas: every arm (two workers behind sglang-router cache_aware and round_robin, one engine, astrai's
    data-parallel front) answered every request through HTTP, and each replica's prefix-cache counters moved."""
    pytest.importorskip("sglang_router", reason="bench_replicas runs the real sglang-router process")
    report = _smoke("bench_replicas.py", tmp_path, timeout=300)
    assert [r["arm"] for r in report["results"]] == ["cache_aware", "round_robin", "one_engine", "dp_front"]
    for arm, (run,) in report["runs"].items():
        assert run["errors"] == 0 and run["tokens"] == report["requests"] * report["new_tokens"], arm
        assert sum(r["requests"] for r in run["replicas"]) == report["requests"], arm
        assert all(r["queried_tokens"] > 0 and 0 <= r["hit_rate"] <= 1 for r in run["replicas"]), arm
        assert len(run["replicas"]) == (1 if arm == "one_engine" else 2) and run["ttft_p50"] > 0
    assert {r["ratio"] for r in report["ratios"]} >= set(report["goals"]) and report["bandwidth_gbs"]["median"] > 0


@pytest.mark.slow  # ~60 s: three astrai workers compile their engines; the peers are never installed in CI
def test_cpu_peers_smoke_runs_astrai_alone_when_no_peer_is_installed(tmp_path):
    report = _smoke("bench_cpu_peers.py", tmp_path, timeout=600,
                    args=("--workloads", "single", "batch", "--work", str(tmp_path / "work")),
                    ASTRAI_LLAMA_PYTHON="", ASTRAI_VLLM_PYTHON="")  # fmt: skip
    assert report["peers"] == {"llama": None, "vllm": None}
    kinds = {(r["workload"], r["weights"], r["engine"]) for r in report["rows"]}
    assert kinds == {("single", w, "astrai") for w in ("float32", "bfloat16", "int8")} | {
        ("batch", w, "astrai") for w in ("float32", "bfloat16")}  # fmt: skip
    assert all(r["tok_s"] > 0 for r in report["rows"]) and all(0 < r["roofline"] for r in report["rows"][:3])
    assert all(r["agree_tokens"] == 8 for r in report["rows"] if r["weights"] == "float32" and r["requests"] == 1)


@pytest.mark.slow  # ~40 s: two astrai workers, quiet and beside a busy process
def test_shared_cores_smoke_measures_every_arm_quiet_and_contended(tmp_path):
    report = _smoke("bench_shared_cores.py", tmp_path, timeout=600,
                    args=("--arms", "default:fixed", "10000", "--work", str(tmp_path / "work")))  # fmt: skip
    assert {(r["arm"], r["workload"]) for r in report["rows"]} == {
        (a, w) for a in ("default:fixed", "10000") for w in ("single", "batch", "single (contended)",
                                                              "batch (contended)")}  # fmt: skip
    assert all(r["tok_s"] > 0 for r in report["rows"])
    assert all(r["of_quiet"] > 0 for r in report["rows"] if "contended" in r["workload"])


@pytest.mark.slow  # ~60 s: four engines compile their decode steps
def test_engine_thread_smoke_measures_every_arm(tmp_path):
    report = _smoke("bench_engine_thread.py", tmp_path, timeout=900)
    assert {r["arm"] for r in report["rows"]} == {"foreground", "background", "background-kept",
                                                  "foreground-beside-pool"}  # fmt: skip
    assert all(r["tok_s"] > 0 for r in report["rows"])
