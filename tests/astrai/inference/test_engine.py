"""The engine against transformers' greedy generate: continuous batching, paging, prefix hits, chunked
prefill, preemption, n > 1, logprobs, aborts, and no KV leaks."""

import asyncio
import threading
import time

import pytest
import torch

import astrai
from astrai.cpu_kernels import matvec as cpu_matvec
from astrai.inference.engine import Engine, EngineBusyError, EngineConfig, EngineDeadError
from astrai.inference.errors import EngineInputError
from astrai.inference.graphs import GraphCaptureError
from astrai.inference.params import SamplingParams
from astrai.ops import linear as ops_linear
from astrai.ops.linear import kernel_rows
from helpers import DEVICE, save_hf, tiny_hf_model, tiny_model_dir

NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model("qwen2", max_position_embeddings=512)
    # on a GPU machine the engine runs the Triton kernels (and CUDA graphs); the reference stays on the CPU
    return hf, astrai.load(save_hf(hf, tmp_path_factory.mktemp("m")), device=DEVICE)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 256, (40,), generator=gen).tolist()  # a shared "system prompt"
    out = []
    for i, n in enumerate([3, 17, 1, 33, 8, 50, 21, 2, 64, 5, 40, 11, 29, 7, 16, 45]):
        tail = torch.randint(1, 256, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


@pytest.fixture(scope="module")
def reference(pair, prompts):
    hf, _ = pair
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)  # fmt: skip
            refs.append(out[0, len(p) :].tolist())
    return refs


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _assert_idle_and_clean(engine):
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_pages_used == 0
    engine.pool.check()
    if engine.radix is not None:
        engine.radix.check()
        engine.radix.reset()
    assert engine.pool.num_free == engine.pool.num_pages - 1


@pytest.mark.parametrize(
    ("page_size", "prefix_cache", "step_tokens"),
    [(16, True, 2048), (1, True, 64), (16, False, 32), (4, True, 16)],
    ids=["page16-radix", "page1-radix-chunked", "page16-noradix-chunked", "page4-tiny-budget"],
)
def test_greedy_equals_transformers_with_staggered_arrivals(pair, prompts, reference, page_size, prefix_cache,
                                                            step_tokens):  # fmt: skip
    _, model = pair
    cfg = EngineConfig(page_size=page_size, prefix_cache=prefix_cache, max_step_tokens=step_tokens, max_running=16,
                       compile=False, kv_budget_tokens=4096)  # fmt: skip
    with Engine(model, cfg) as engine:
        handles = [engine.submit(p, GREEDY) for p in prompts[:6]]
        time.sleep(0.05)  # let a few steps run before the rest arrive
        handles += [engine.submit(p, GREEDY) for p in prompts[6:11]]
        handles[0].result()
        handles += [engine.submit(p, GREEDY) for p in prompts[11:]]
        results = [h.result() for h in handles]
        assert [list(r.outputs[0].token_ids) for r in results] == reference
        assert all(r.outputs[0].finish_reason == "length" for r in results)
        if prefix_cache:
            assert engine.radix.hit_tokens > 0  # the shared system prompt was reused
        _assert_idle_and_clean(engine)


def test_shared_prefix_computes_only_the_suffix(pair, prompts, reference):
    _, model = pair
    with Engine(model, EngineConfig(page_size=8, compile=False, kv_budget_tokens=2048)) as engine:
        first = engine.generate([prompts[0]], GREEDY)[0]
        before = engine.scheduler.stats.prefill_tokens
        second = engine.generate([prompts[3]], GREEDY)[0]  # shares the 40-token prefix
        computed = engine.scheduler.stats.prefill_tokens - before
        assert second.cached_tokens == 40  # five full pages of 8
        assert computed == len(prompts[3]) - 40
        assert list(first.outputs[0].token_ids) == reference[0]
        assert list(second.outputs[0].token_ids) == reference[3]
        _assert_idle_and_clean(engine)


def test_kv_exhaustion_preempts_and_every_request_still_matches(pair, prompts, reference):
    _, model = pair
    # 96 tokens of KV for requests of up to ~120 tokens each: far too little to run them together
    cfg = EngineConfig(page_size=4, kv_budget_tokens=128, max_running=8, compile=False, prefix_cache=False)
    fitting = [i for i, p in enumerate(prompts) if len(p) + NEW <= 124]
    with Engine(model, cfg) as engine:
        results = engine.generate([prompts[i] for i in fitting], GREEDY)
        assert [list(r.outputs[0].token_ids) for r in results] == [reference[i] for i in fitting]
        assert engine.stats().preemptions > 0
        _assert_idle_and_clean(engine)


def test_n_samples_share_the_prompt_and_logprobs_match(pair, prompts):
    hf, model = pair
    prompt = prompts[5]
    with Engine(model, EngineConfig(page_size=4, compile=False, kv_budget_tokens=2048)) as engine:
        greedy = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, n=2, ignore_eos=True,
                                                          logprobs=True, top_logprobs=3))[0]  # fmt: skip
        a, b = greedy.outputs
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        # the second sequence reused the first one's prompt pages
        assert engine.radix.hit_tokens >= (len(prompt) - 1) // 4 * 4
        with torch.no_grad():
            full = torch.tensor([prompt + list(a.token_ids)])
            logp = hf(full).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        expected = logp.gather(-1, torch.tensor(a.token_ids)[:, None])[:, 0]
        assert a.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        top = [[t for t, _ in row] for row in a.top_logprobs]
        assert top == logp.topk(3).indices.tolist()
        sampled = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5))[0]
        assert len(sampled.outputs) == 3 and [o.index for o in sampled.outputs] == [0, 1, 2]
        _assert_idle_and_clean(engine)


def test_seeded_sampling_is_reproducible_across_batches(pair, prompts):
    _, model = pair
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    with Engine(model, EngineConfig(compile=False)) as engine:
        alone = engine.generate([prompts[1]], params)[0].outputs[0].token_ids
        others = [SamplingParams(max_tokens=10, seed=1), params, SamplingParams(max_tokens=10)]
        crowd = engine.generate([prompts[4], prompts[1], prompts[7]], others)
        assert crowd[1].outputs[0].token_ids == alone
        other = engine.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=12))
        assert other[0].outputs[0].token_ids != alone


def test_abort_mid_stream_frees_kv(pair, prompts):
    _, model = pair
    with Engine(model, EngineConfig(compile=False)) as engine:
        stream = engine.stream(prompts[8], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        got = [next(stream) for _ in range(3)]
        assert all(d.token_ids for d in got)
        stream.close()  # the consumer goes away: the request is aborted
        for _ in range(100):
            if engine.stats().running == 0:
                break
            time.sleep(0.01)
        _assert_idle_and_clean(engine)


def test_async_stream_matches_generate(pair, prompts, reference):
    _, model = pair

    async def collect(engine):
        return [d async for d in engine.astream(prompts[2], GREEDY)]

    with Engine(model, EngineConfig(compile=False)) as engine:
        deltas = asyncio.run(collect(engine))
    assert [t for d in deltas for t in d.token_ids] == reference[2]
    assert deltas[-1].finish_reason == "length"


def test_stop_strings_and_eos_through_the_tokenizer(tmp_path):
    model = astrai.load(tiny_model_dir(tmp_path / "m"), device=DEVICE)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Engine(model, EngineConfig(compile=False)) as engine:
        free = engine.generate(["hello world"], params)[0].outputs[0]
        assert free.text == model.tokenizer.decode(free.token_ids)
        stop = free.text[5:9]  # a stop string that likely spans several tokens
        cut = engine.generate(["hello world"], SamplingParams(max_tokens=24, temperature=0, stop=(stop,),
                                                              ignore_eos=True))[0].outputs[0]  # fmt: skip
        assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
        streamed = list(engine.stream("hello world", SamplingParams(max_tokens=24, temperature=0, stop=(stop,),
                                                                    ignore_eos=True)))  # fmt: skip
        assert "".join(d.text for d in streamed) == cut.text and streamed[-1].finish_reason == "stop"
        eos = free.token_ids[3]
        ended = engine.generate(["hello world"], SamplingParams(max_tokens=24, temperature=0,
                                                                stop_token_ids=(eos,)))[0].outputs[0]  # fmt: skip
        assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]


def test_bad_requests_are_rejected_with_clear_errors(pair):
    _, model = pair
    with Engine(model, EngineConfig(compile=False, max_waiting=2)) as engine:
        # each error is an EngineInputError (a ValueError) naming the request field at fault in `param`
        for prompt, params, message, param in [
            ([1] * 500, SamplingParams(max_tokens=20), "500 tokens and max_tokens is 20: 520 tokens, more than the",
             "max_tokens"),
            ([], SamplingParams(), "empty", "prompt"),
            ([1, 300], SamplingParams(), r"outside \[0, 256\)", "prompt"),
            ([1, 2], SamplingParams(temperature=-1), "temperature", "temperature"),
            ([1, 2], SamplingParams(stop_token_ids=(999,)), "stop_token_ids", "stop_token_ids"),
            ([1, 2], SamplingParams(n=3), r"n=3 is more sequences than the engine's whole waiting queue "
             r"\(max_waiting=2\)", "n"),
        ]:  # fmt: skip
            with pytest.raises(EngineInputError, match=message) as info:
                engine.submit(prompt, params)
            assert info.value.param == param
        with engine._cv:  # hold the engine thread so the queue fills
            engine.submit([1, 2], SamplingParams(max_tokens=2))
            engine.submit([1, 2], SamplingParams(max_tokens=2))
            with pytest.raises(EngineBusyError):
                engine.submit([1, 2], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("background", [True, False], ids=["thread", "foreground"])
def test_a_background_engine_releases_the_callers_idle_openmp_threads(
    pair, prompts, reference, background, monkeypatch
):
    # libgomp cuts every waiting thread's spin while its threads outnumber the CPUs, so the pool of the thread that
    # loaded the model would slow a background engine's steps ~1.8x on 2 cores (astrai.openmp.release_idle_threads)
    import astrai.inference.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "release_idle_threads", lambda: calls.append(threading.get_ident()))
    _, model = pair
    with Engine(model, EngineConfig(compile=False, kv_budget_tokens=2048, background=background)) as engine:
        started = len(calls)
        results = engine.generate(prompts[:2], GREEDY)
    assert [list(r.outputs[0].token_ids) for r in results] == reference[:2]
    # at start and before each blocking wait, from the caller's thread; a foreground engine steps on that thread
    assert (started, len(calls)) == ((1, 2) if background else (0, 0))
    assert set(calls) <= {threading.get_ident()}


@pytest.mark.parametrize("background", [True, False], ids=["thread", "foreground"])
def test_compiled_decode_equals_eager(pair, prompts, reference, background, monkeypatch):
    _, model = pair
    # the tiny model's weights are below `SMALL_WEIGHT_BYTES`, which keep inductor's loop; this test is about the
    # kernels' wiring (the size rule has its own test in tests/astrai/ops/test_packed_linear.py)
    monkeypatch.setattr(ops_linear, "SMALL_WEIGHT_BYTES", 0)
    # on an AVX-512 CPU the few-row decode steps run the hand-written matvec kernel (q/k/v with biases grouped;
    # fp32 from 4 rows takes oneDNN's packed GEMM instead, `ops.linear.REDUCE_ROWS`), and every decode step the
    # decode attention kernel: the profiler sees their ops' calls (C++ kernels where `ops.cpp` builds, else the
    # Python ones) and the rows of each
    kernels = DEVICE == "cpu" and cpu_matvec.supports(torch.float32)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the engine's thread too
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                experimental_config=every_thread) as profile:  # fmt: skip
        with Engine(model, EngineConfig(compile=True, kv_budget_tokens=2048, background=background)) as engine:
            results = engine.generate(prompts[:5], GREEDY)
            alone = engine.generate(prompts[:1], GREEDY)  # batch-1 decode steps
            if DEVICE == "cuda":  # the compiled step was captured and replayed as CUDA graphs
                assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    assert [list(r.outputs[0].token_ids) for r in results] == reference[:5]
    assert list(alone[0].outputs[0].token_ids) == reference[0]
    if kernels:
        # (calls on fake tensors while compiling record no shapes)
        calls = [e for e in profile.events() if e.name.startswith("astrai::") and e.input_shapes and e.input_shapes[0]]
        rows = {name: [e.input_shapes[0][0] for e in calls if e.name == f"astrai::{name}"]
                for name in ("cpu_matvec", "cpu_decode_attention", "packed_linear_cat")}  # fmt: skip
        bound = kernel_rows(torch.float32)  # the row kernel to 3 rows, its blocked form (gemm_f32.c) to 32
        assert set(rows["cpu_matvec"]) <= set(range(1, bound + 1))
        assert 1 in rows["cpu_matvec"]  # one row takes the kernel (ops.linear.MIN_KERNEL_ROWS)
        assert 5 in rows["cpu_decode_attention"]  # the five requests decode together
        assert 5 in (rows["cpu_matvec"] if bound >= 5 else rows["packed_linear_cat"])  # q/k/v of the five rows


def test_decode_buffers_pad_batches_to_buckets_without_stale_rows(pair, prompts, reference):
    """The CUDA-graph input rows (captured on CUDA, called directly elsewhere): batches padded up to buckets, a
    smaller batch reusing rows a larger one left behind, block tables narrower than the buffers."""
    _, model = pair
    cfg = EngineConfig(page_size=4, max_running=16, compile=False, kv_budget_tokens=4096, background=False,
                       max_step_tokens=48)  # fmt: skip
    with Engine(model, cfg) as engine:
        runner = engine.runner
        if runner.graphs is None:
            runner.graphs = runner.make_decode_graphs(capture=False)
        graphs, run, steps = runner.graphs, runner.graphs.run, []

        def record(tokens, meta):
            steps.append((tokens.shape[0], int((meta.seq_lens > 0).sum())))
            return run(tokens, meta)

        graphs.run = record
        handles = [engine.submit(p, GREEDY) for p in prompts[:7]]
        for _ in range(6):
            engine.step()
        handles += [engine.submit(p, GREEDY) for p in prompts[7:12]]
        handles[0].result()
        handles += [engine.submit(p, GREEDY) for p in prompts[12:]]
        results = [h.result() for h in handles]
        assert [list(r.outputs[0].token_ids) for r in results] == reference
        assert len({rows for rows, _ in steps}) >= 3  # several buckets
        assert any(real < rows for rows, real in steps)  # padded batches
        assert [rows for rows, _ in steps] != sorted(rows for rows, _ in steps)  # and smaller after larger
        if DEVICE == "cuda":  # every bucket up to max_running was captured at start
            assert set(graphs.graphs) == {1, 2, 4, 8, 16}
        with pytest.raises(ValueError, match="exceeds the buffers"):
            run(torch.zeros(64, dtype=torch.long), runner._host_meta([], decode=True, rows=64, width=2)[1])
        _assert_idle_and_clean(engine)


@pytest.mark.gpu
def test_cuda_decode_without_graphs_equals_transformers(pair, prompts, reference):
    _, model = pair
    cfg = EngineConfig(compile=True, cuda_graphs=False, kv_budget_tokens=2048, background=False)
    with Engine(model, cfg) as engine:
        assert engine.runner.graphs is None
        results = engine.generate(prompts[:6], GREEDY)
    assert [list(r.outputs[0].token_ids) for r in results] == reference[:6]


def test_foreground_engine_steps_on_the_calling_thread(pair, prompts, reference):
    _, model = pair
    with Engine(model, EngineConfig(compile=False, background=False, max_step_tokens=32, max_running=8)) as engine:
        assert engine._thread is None
        results = engine.generate(prompts[:4], GREEDY)
        assert [list(r.outputs[0].token_ids) for r in results] == reference[:4]
        stream = engine.stream(prompts[5], GREEDY)
        first = next(stream)
        assert first.token_ids == (reference[5][0],)
        stream.close()  # aborts at once: no step needed to release the KV
        _assert_idle_and_clean(engine)
        assert not engine.step()


def test_foreground_abort_before_any_step_never_runs_the_request(pair, prompts):
    _, model = pair
    with Engine(model, EngineConfig(compile=False, background=False)) as engine:
        handle = engine.submit(prompts[0], GREEDY)
        handle.abort()  # still in the engine's inbox: it must not reach the scheduler afterwards
        done = handle.result()
        assert done.outputs[0].finish_reason == "abort" and done.outputs[0].token_ids == ()
        assert not engine.step()
        _assert_idle_and_clean(engine)


def test_a_stalled_scheduler_fails_requests_instead_of_spinning(pair, prompts, monkeypatch):
    _, model = pair
    with Engine(model, EngineConfig(compile=False, background=False)) as engine:
        monkeypatch.setattr(engine.scheduler, "_admit", lambda budget: [])  # a bug that never admits anything
        handle = engine.submit(prompts[0], GREEDY)
        with pytest.raises(RuntimeError, match="cannot admit request"):
            handle.result()  # before: step() returned True forever with an empty plan
        with pytest.raises(EngineDeadError, match="cannot admit request"):
            handle.result()  # the request was failed, not left waiting
        with pytest.raises(EngineDeadError):
            engine.submit(prompts[1], GREEDY)


def test_failed_graph_capture_names_the_way_out(pair, monkeypatch):
    _, model = pair
    with Engine(model, EngineConfig(compile=False, max_running=4, background=False)) as engine:
        graphs = engine.runner.make_decode_graphs(capture=True)

        def out_of_memory(rows):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(graphs, "_capture", out_of_memory)
        with pytest.raises(GraphCaptureError, match=r"batch 4 failed.*lower kv_memory_fraction.*cuda_graphs=False"):
            graphs.capture_all([1, 2, 4])


def test_admission_counts_sequences_not_requests(pair):
    """Issue 18: an n > 1 request takes n places of max_waiting; it is busy only while those places are taken."""
    _, model = pair
    with Engine(model, EngineConfig(compile=False, max_waiting=4, kv_budget_tokens=512)) as engine:
        with engine._cv:  # hold the engine thread so nothing leaves the queue
            handles = [engine.submit([1, 2], SamplingParams(max_tokens=2, n=3))]
            with pytest.raises(EngineBusyError, match="3 sequences are already waiting .* no room for n=2"):
                engine.submit([1, 2], SamplingParams(max_tokens=2, n=2))
            handles.append(engine.submit([1, 2], SamplingParams(max_tokens=2)))  # the fourth place
            assert engine.stats().waiting == 4
            with pytest.raises(EngineBusyError):
                engine.submit([1, 2], SamplingParams(max_tokens=2))
        assert [len(h.result().outputs) for h in handles] == [3, 1]
        handles = [engine.submit([1, 2], SamplingParams(max_tokens=2, n=4))]  # the whole queue, once it is free
        assert len(handles[0].result().outputs) == 4
        _assert_idle_and_clean(engine)


def test_underflowing_sampling_values_are_greedy_or_named(pair, prompts, reference):
    """Issue 18: temperatures 1e-39 / 1e-45 are 0 or subnormal in float32 (they drew token 0 forever); now they are
    greedy, with transformers' greedy tokens and logprobs that agree; repetition_penalty 5e-324 is refused."""
    _, model = pair
    with Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=2048)) as engine:
        for t in (1e-39, 1e-45):
            params = SamplingParams(max_tokens=NEW, temperature=t, ignore_eos=True, top_logprobs=1)
            outs = [c.outputs[0] for c in engine.generate(prompts[:3], params)]
            assert [list(o.token_ids) for o in outs] == reference[:3]
            for o in outs:  # the chosen token is the raw top-1 (no penalties here), and its logprob too
                assert [top[0][0] for top in o.top_logprobs] == list(o.token_ids)
                assert list(o.logprobs) == pytest.approx([top[0][1] for top in o.top_logprobs])
        with pytest.raises(EngineInputError, match=r"repetition_penalty must be \[1e-06, 1000000.0\], got 5e-324") as e:
            engine.submit(prompts[0], SamplingParams(repetition_penalty=5e-324))
        assert e.value.param == "repetition_penalty"
        _assert_idle_and_clean(engine)


def test_repetition_penalty_matches_transformers_generate(pair, prompts, reference):
    """The penalty path end to end (the engine hands the sampler incremental token arrays) vs transformers."""
    hf, model = pair
    params = SamplingParams(max_tokens=NEW, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    with Engine(model, EngineConfig(compile=False, background=False, max_step_tokens=64)) as engine:
        ours = [list(c.outputs[0].token_ids) for c in engine.generate(prompts[:6], params)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, repetition_penalty=1.8,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts[:6]]  # fmt: skip
    assert ours == expected
    assert ours != reference[:6]  # the penalty changed the greedy continuations
