"""`astrai eval mc` against lm-eval's `hf` backend on the same tiny model: the same prompt text, the same
log-likelihood per choice (1e-4) and so the same pick per question, 0-shot and 2-shot, on 24 local questions
(lm-eval builds the task from its installed MMLU template and local JSON files; nothing is downloaded)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

import astrai
from astrai.eval import mc
from astrai.tree import tree_map
from helpers import tiny_model_dir

SUBJECTS = ("anatomy", "high_school_physics", "world_religions")
WORDS = ("the quick brown fox jumps over lazy dog hello world tiny corpus this is a 42 7 19 mass energy atom cell "
         "faith light wave field").split()  # fmt: skip


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))).capitalize() + rng.choice("?.!")


def write_questions(root: Path) -> None:
    """Per subject, 8 test and 5 dev questions as cais/mmlu JSON lines, and the same as MMLU CSV files."""
    rng = random.Random(0)
    for subject in SUBJECTS:
        for split, n in (("test", 8), ("dev", 5)):
            rows = [{"question": "  " + _sentence(rng), "subject": subject, "choices": [_sentence(rng) for _ in "ABCD"],
                     "answer": rng.randrange(4)} for _ in range(n)]  # fmt: skip
            (root / f"{subject}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (root / split).mkdir(exist_ok=True)
            lines = [[r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows]
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows(lines)


LM_EVAL = r"""
import json, sys
from pathlib import Path
import lm_eval, yaml
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

model, root, out, base_url = sys.argv[1:5]
root = Path(root)
template = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks/mmlu/default/_default_template_yaml").read_text())
tasks = []
for subject in sys.argv[5:]:
    for k in (0, 2):
        name = f"local_{subject}_{k}shot"
        files = {"test": str(root / f"{subject}_test.jsonl"), "dev": str(root / f"{subject}_dev.jsonl")}
        about = " ".join(subject.split("_"))
        cfg = dict(template, task=name, dataset_path="json", dataset_kwargs={"data_files": files}, num_fewshot=k,
                   description=f"The following are multiple choice questions (with answers) about {about}.\n\n")
        (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        tasks.append(name)
def run(lm):
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(root),
                                  include_defaults=False), log_samples=True)
    dump = {t: [{"doc_id": s["doc_id"], "context": s["arguments"][0][0],
                 "continuations": [a[1] for a in s["arguments"]], "ll": [r[0] for r in s["filtered_resps"]]}
                for s in sorted(res["samples"][t], key=lambda s: s["doc_id"])] for t in tasks}
    return {"samples": dump, "acc": {t: res["results"][t]["acc,none"] for t in tasks}}


result = run(HFLM(pretrained=model, dtype="float32", device="cpu", batch_size=8))
# the same tasks through `astrai serve`'s /v1/completions, as users point lm-eval at a vLLM server
from lm_eval.models.openai_completions import LocalCompletionsAPI
api = LocalCompletionsAPI(base_url=base_url, model="tiny", tokenizer=model, tokenizer_backend="huggingface",
                          batch_size=8, max_retries=1)
result["api"] = run(api)
Path(out).write_text(json.dumps(result))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model with large random weights (so its picks vary with the question), the data, lm-eval's run."""
    pytest.importorskip("lm_eval")
    root = tmp_path_factory.mktemp("mc")
    base = astrai.load(tiny_model_dir(root / "base"))
    # x20 on every matrix: with init-scale weights the last token ("Answer:") decides and every pick is the same
    model = attrs.evolve(base, params=tree_map(lambda t: t * 20 if t.dim() == 2 else t, base.params))
    folder = str(astrai.save(model, root / "model"))
    data = root / "data"
    data.mkdir()
    write_questions(data)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "hf_datasets"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    out = root / "lm_eval.json"
    with live_server(astrai.load(folder)) as base_url:
        proc = subprocess.run([sys.executable, "-c", LM_EVAL, folder, str(data), str(out), base_url + "/v1/completions",
                               *SUBJECTS], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, astrai.load(folder), data, json.loads(out.read_text())


@contextlib.contextmanager
def live_server(model):
    """`astrai serve`'s app on uvicorn in a thread, on a free port (what lm-eval's local-completions talks to)."""
    import uvicorn

    from astrai.inference.engine import Engine, EngineConfig
    from astrai.serve.app import build_app

    engine = Engine(model, EngineConfig(max_running=16, compile=False, kv_budget_tokens=8192))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="tiny"), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="on"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("shots", [0, 2])
def test_mc_matches_lm_eval_hf(setup, shots):
    folder, model, data, ref = setup
    picks = []
    for subject in SUBJECTS:
        cfg = mc.Config(model=folder, data=data / f"{subject}_test.jsonl", dev=data / f"{subject}_dev.jsonl",
                        num_fewshot=shots, batch_size=5)  # fmt: skip
        report = mc.evaluate(cfg, model)
        theirs = ref["samples"][f"local_{subject}_{shots}shot"]
        assert len(report.samples) == len(theirs) == 8
        questions = mc.read_questions(cfg.data)
        dev = mc.read_questions(cfg.dev)[:shots]
        for q, ours, them in zip(questions, report.samples, theirs, strict=True):
            assert mc.context(q, dev) == them["context"]  # the prompt, character for character
            assert them["continuations"] == [" A", " B", " C", " D"]
            assert ours["loglikelihoods"] == pytest.approx(them["ll"], abs=1e-4)
            lm_pick = "ABCD"[max(range(4), key=lambda i: (them["ll"][i], -i))]
            assert ours["pred"] == lm_pick
            picks.append(ours["pred"])
        assert report.groups[subject]["acc"] == pytest.approx(ref["acc"][f"local_{subject}_{shots}shot"])
    assert len(set(picks)) >= 2, f"the model picks one letter for every question ({picks}): a weak comparison"


@pytest.mark.parametrize("shots", [0, 2])
def test_lm_eval_against_astrai_serve_matches_its_hf_backend(setup, shots):
    # lm-eval's local-completions model (echo + logprobs requests, prompt lists) pointed at the live server
    _, _, _, ref = setup
    for subject in SUBJECTS:
        task = f"local_{subject}_{shots}shot"
        assert ref["api"]["acc"][task] == pytest.approx(ref["acc"][task])
        for served, hf in zip(ref["api"]["samples"][task], ref["samples"][task], strict=True):
            assert served["context"] == hf["context"]
            assert served["ll"] == pytest.approx(hf["ll"], abs=1e-4)


def test_csv_folder_with_sibling_dev_gives_the_same_scores(setup):
    folder, model, data, _ = setup
    by_jsonl = [s for subject in SUBJECTS for s in mc.evaluate(mc.Config(
        model=folder, data=data / f"{subject}_test.jsonl", dev=data / f"{subject}_dev.jsonl", num_fewshot=2),
        model).samples]  # fmt: skip
    report = mc.evaluate(mc.Config(model=folder, data=data / "test", num_fewshot=2), model)
    flat = [ll for s in report.samples for ll in s["loglikelihoods"]]
    assert flat == pytest.approx([ll for s in by_jsonl for ll in s["loglikelihoods"]], rel=1e-6)
    assert len(flat) == 4 * 24
    assert set(report.groups) == set(SUBJECTS)
    accs = [report.groups[s]["acc"] for s in SUBJECTS]
    assert report.metrics["acc_macro"] == pytest.approx(sum(accs) / 3)
    assert report.metrics["acc"] == pytest.approx(sum(s["correct"] for s in report.samples) / 24)


def test_prompt_format():
    q = mc.Question("  What is 2+2? ", ("3", "4", "5", "6"), 1, "high_school_math", "x:1")
    shot = mc.Question("1+1?", ("2", "3", "4", "5"), 0, "high_school_math", "x:2")
    assert mc.context(q, [shot]) == (
        "The following are multiple choice questions (with answers) about high school math.\n\n"
        "1+1?\nA. 2\nB. 3\nC. 4\nD. 5\nAnswer: A\n\n"
        "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    )


def test_bad_rows_name_their_line(tmp_path):
    (tmp_path / "x_test.csv").write_text("q,a,b,c,d,A\nq2,a,b,c,d,E\n")
    with pytest.raises(mc.DataError, match=r"x_test.csv:2: answer 'E'|x_test.csv:2: answer must be"):
        mc.read_questions(tmp_path / "x_test.csv")
    (tmp_path / "q.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n\n{"question": "q"}\n')
    with pytest.raises(mc.DataError, match=r"q.jsonl:3: missing field 'choices', 'answer'"):
        mc.read_questions(tmp_path / "q.jsonl")
