"""Grammar engines for constrained decoding (issue 14): llguidance vs xgrammar at a ~150k-token vocabulary.

Both engines get the same tokenizer view: a byte-level BPE trained here on a generated multilingual corpus
(latin/cyrillic/greek/CJK/arabic words, numbers, JSON punctuation and indentation), cached in --cache, with each
token's bytes from `astrai.io.token_bytes.TokenBytes`. Each engine runs in its own process (clean RSS, import
time). Measured, as the median over --repeats runs with the min..max spread:
  import      `import <engine>` (what the dependency costs at startup; xgrammar imports torch/transformers)
  view        the engine's tokenizer view built from the token bytes (llguidance `LLTokenizer`; xgrammar
              `TokenizerInfo` + `GrammarCompiler`); `token_bytes_s` is the shared TokenBytes pass
  compile     per JSON schema (small object; nested object with enums/arrays; a ~30-field tool-call parameters
              schema): cold = schema -> matcher -> first bitmask; warm = the same with the engine's cache
              (xgrammar's compiler cache; llguidance has none, so warm = `deep_copy` of a compiled matcher)
  mask        per-token bitmask fill into a preallocated int32 [1, ceil(V/32)] tensor while a valid document
              (json.dumps of an instance, BPE-encoded) is consumed token by token; median and p99 over all steps
  memory      RSS growth of the worker from after the imports to after the view and every schema's matcher
  robustness  random walks (a uniformly random allowed token per step) on the nested schema: every finished
              output must json.loads and validate (jsonschema when installed)
Prints rich tables, then the JSON report as the last stdout line. `--smoke` uses a 4k vocabulary (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import console, emit, table

RESULTS = Path(__file__).resolve().parent / "results" / "bench_grammar.json"
ENGINES = ("llguidance", "xgrammar")

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "role": {"enum": ["admin", "user", "guest"]},
                "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
            },
            "required": ["name", "role", "scores"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "status", "tags", "owner", "items"],
    "additionalProperties": False,
}


def _tool_schema() -> dict:
    """A tool-call parameters schema with 30 fields of mixed types (like a CRM `create_ticket` function)."""
    kinds = [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["low", "medium", "high", "urgent"]},
        {"type": "array", "items": {"type": "string"}},
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}, "required": ["k", "v"]},
    ]
    props = {f"field_{i:02d}": {**kinds[i % len(kinds)], "description": f"parameter {i}"} for i in range(30)}
    return {"type": "object", "properties": props, "required": list(props)[::2], "additionalProperties": False}


TOOL = _tool_schema()
SAMPLE = {"name": "Ada Lovelace", "age": 36, "ok": True}
NESTED_SAMPLE = {
    "id": 4242,
    "status": "pending",
    "tags": ["blue", "fast", "中文"],
    "owner": {"name": "Grace", "role": "admin", "scores": [1.5, -2, 3.25e2]},
    "items": [{"sku": "AB-12", "qty": 3}, {"sku": "ZZ", "qty": 10}],
}


def _tool_sample() -> dict:
    values = ["some text, ünïcödé", 17, 2.5, False, "urgent", ["x", "y z"], "ABC-1234", {"k": "key", "v": 9}]
    return {name: values[i % len(values)] for i, name in enumerate(TOOL["properties"])}


SCHEMAS = {"small": (SMALL, SAMPLE), "nested": (NESTED, NESTED_SAMPLE), "tool_30": (TOOL, _tool_sample())}


# ---- the vocabulary ------------------------------------------------------------------------------------------
def _corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    cons, vow = "bcdfghjklmnprstvwz", "aeiou"

    def script(lo: int, hi: int, n: int) -> str:
        return "".join(chr(rng.randint(lo, hi)) for _ in range(n))

    def word() -> str:
        r = rng.random()
        if r < 0.55:
            syllables = rng.randint(1, 6)
            w = "".join(
                rng.choice(cons) + rng.choice(vow) + rng.choice(["", "", rng.choice(cons)]) for _ in range(syllables)
            )
            return w.capitalize() if rng.random() < 0.15 else w
        if r < 0.65:
            return script(0x430, 0x44F, rng.randint(2, 8))  # cyrillic
        if r < 0.71:
            return script(0x3B1, 0x3C9, rng.randint(2, 7))  # greek
        if r < 0.80:
            return script(0x4E00, 0x5FFF, rng.randint(1, 4))  # CJK
        if r < 0.84:
            return script(0x627, 0x64A, rng.randint(2, 6))  # arabic
        if r < 0.92:
            return str(rng.randint(0, 10 ** rng.randint(1, 7)))
        return rng.choice(['{"', '": "', '", "', '"}', '": [', '], "', '": {', "}, {", '": true', '": null', "\n    ",
                           '\n  "', '":', '",', "\t", "},\n", "]}", '":"', '","'])  # fmt: skip

    return [" ".join(word() for _ in range(rng.randint(5, 20))) for _ in range(lines)]


def build_tokenizer(vocab: int, cache: Path):
    """The byte-level BPE with `vocab` tokens: trained once (about a minute at 150k on 2 cores), then loaded."""
    from astrai.io.tokenizer import Tokenizer, train_tokenizer

    folder = cache / f"bpe_{vocab}"
    if not (folder / "tokenizer.json").exists():
        t0 = time.perf_counter()
        train_tokenizer(_corpus(max(2000, vocab)), vocab_size=vocab).save(folder)
        console.print(f"trained the {vocab}-token BPE in {time.perf_counter() - t0:.1f} s -> {folder}")
    return Tokenizer.from_dir(folder)


# ---- one engine, in its own process ----------------------------------------------------------------------------
def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _stats(xs: list[float], scale: float = 1e3) -> dict:
    xs = sorted(x * scale for x in xs)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "p99": p99, "n": len(xs)}


class _Llg:
    """llguidance: LLTokenizer over TokenizerWrapper(token bytes); one LLMatcher per document."""

    def __init__(self, tok, token_bytes: list[bytes], vocab: int) -> None:
        import llguidance

        self.llg = llguidance
        specials = sorted(tok.special_token_ids)

        class _View:
            tokens, eos_token_id, bos_token_id, special_token_ids = token_bytes, tok.eos_token_ids[0], None, specials

            def __call__(self, text):
                if isinstance(text, bytes):
                    raise TypeError("str only")
                return tok.encode(text, add_special_tokens=False)

        self.view = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_View()), n_vocab=vocab, eos_token=list(tok.eos_token_ids)
        )

    def compile(self, schema: dict, *, warm):
        if warm is not None:
            return warm.deep_copy()
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        m = self.llg.LLMatcher(self.view, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    @staticmethod
    def fill(m, row) -> None:
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.consume_token(token)

    @staticmethod
    def done(m) -> bool:
        return m.is_stopped()

    @staticmethod
    def reset(m) -> None:
        m.reset()


class _Xgr:
    """xgrammar: TokenizerInfo(RAW token bytes, special tokens empty) + GrammarCompiler (cache on)."""

    def __init__(self, tok, token_bytes: list[bytes], vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab_bytes = [b"" if i in tok.special_token_ids else b for i, b in enumerate(token_bytes)]
        info = xgrammar.TokenizerInfo(vocab_bytes, xgrammar.VocabType.RAW, vocab_size=vocab,
                                      stop_token_ids=list(tok.eos_token_ids))  # fmt: skip
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=True)

    def compile(self, schema: dict, *, warm):
        if warm is None:
            self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True))

    @staticmethod
    def fill(m, row) -> None:
        m.fill_next_token_bitmask(row.view(1, -1), 0)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def done(m) -> bool:
        return m.is_terminated()

    @staticmethod
    def reset(m) -> None:
        m.reset()


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _allowed(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def worker(engine: str, folder: Path, repeats: int, steps: int, walks: int) -> dict:
    t0 = time.perf_counter()
    __import__(engine)
    import_s = time.perf_counter() - t0
    import torch

    from astrai.io.token_bytes import TokenBytes
    from astrai.io.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    vocab = tok.vocab_size
    t0 = time.perf_counter()
    token_bytes = [TokenBytes(tok).bytes(i) for i in range(vocab)]  # noqa: B023
    bytes_s = time.perf_counter() - t0
    rss0 = _rss_mib()
    cls = _Llg if engine == "llguidance" else _Xgr
    view_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        impl = cls(tok, token_bytes, vocab)
        view_times.append(time.perf_counter() - t0)
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    out: dict = {"engine": engine, "version": _version(engine), "vocab": vocab, "import_s": import_s,
                 "token_bytes_s": bytes_s, "view_ms": _stats(view_times), "schemas": {}}  # fmt: skip
    keep = []
    for name, (schema, sample) in SCHEMAS.items():
        ids = tok.encode(json.dumps(sample, ensure_ascii=False), add_special_tokens=False)
        cold, warm = [], []
        pristine = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = impl.compile(schema, warm=None)
            impl.fill(m, row)
            cold.append(time.perf_counter() - t0)
            pristine = impl.compile(schema, warm=None) if pristine is None else pristine
            t0 = time.perf_counter()
            m = impl.compile(schema, warm=pristine)
            impl.fill(m, row)
            warm.append(time.perf_counter() - t0)
        keep.append(pristine)
        mask_times = []
        while len(mask_times) < steps:
            m = impl.compile(schema, warm=pristine)
            for t in ids:
                t0 = time.perf_counter()
                impl.fill(m, row)
                mask_times.append(time.perf_counter() - t0)
                assert _allowed(row, t), f"{engine}/{name}: token {t} of the valid document was masked"
                assert impl.accept(m, t)
            impl.fill(m, row)
            assert all(_allowed(row, e) for e in tok.eos_token_ids), f"{engine}/{name}: EOS not allowed at the end"
        out["schemas"][name] = {"doc_tokens": len(ids), "compile_cold_ms": _stats(cold),
                                "compile_warm_ms": _stats(warm), "mask_ms": _stats(mask_times)}  # fmt: skip
    out["rss_growth_mib"] = _rss_mib() - rss0
    out["robustness"] = _walks(impl, tok, row, walks)
    return out


def _walks(impl, tok, row, walks: int, max_steps: int = 400) -> dict:
    """Random walks on NESTED: each finished output must parse and validate; unfinished ones hit `max_steps`."""
    import torch

    try:
        import jsonschema
    except ImportError:  # validation is then json.loads only
        jsonschema = None
    gen = torch.Generator().manual_seed(0)
    bits = torch.arange(32, dtype=torch.int32)
    counts = {"walks": walks, "finished": 0, "valid": 0, "invalid": 0}
    pristine = impl.compile(NESTED, warm=None)
    for _ in range(walks):
        m, ids = impl.compile(NESTED, warm=pristine), []
        for _ in range(max_steps):
            impl.fill(m, row)
            allowed = (((row.unsqueeze(1) >> bits) & 1).flatten()[: tok.vocab_size]).nonzero().flatten()
            t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            if t in tok.eos_token_ids:
                break
            ids.append(t)
            assert impl.accept(m, t)
        else:
            continue
        counts["finished"] += 1
        try:
            value = json.loads(tok.decode(ids))
            if jsonschema is not None:
                jsonschema.validate(value, NESTED)
            counts["valid"] += 1
        except Exception:  # noqa: BLE001
            counts["invalid"] += 1
    return counts


# ---- driver ----------------------------------------------------------------------------------------------------
def _machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def _deps() -> dict:
    from importlib.metadata import PackageNotFoundError, distribution

    out = {}
    for name in ENGINES:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            out[name] = None
            continue
        size = sum((f.size or 0) for f in dist.files or ())
        out[name] = {"version": dist.version, "requires": dist.requires or [], "installed_mib": size / 2**20}
    return out


def run(args: argparse.Namespace) -> dict:
    tok = build_tokenizer(args.vocab, args.cache)
    folder = args.cache / f"bpe_{args.vocab}"
    deps = _deps()
    results = []
    for engine in args.engines:
        if deps.get(engine) is None:
            console.print(f"[yellow]{engine} is not installed: skipped")
            continue
        cmd = [sys.executable, __file__, "--worker", engine, "--folder", str(folder), "--repeats", str(args.repeats),
               "--steps", str(args.steps), "--walks", str(args.walks)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return dict(benchmark="bench_grammar", machine=_machine(), vocab=tok.vocab_size, repeats=args.repeats,
                steps=args.steps, dependencies=deps, results=results,
                command="python benchmarks/bench_grammar.py" + (" --smoke" if args.smoke else ""))  # fmt: skip


def _rows(report: dict) -> tuple[list[dict], list[dict]]:
    per_schema, per_engine = [], []
    for r in report["results"]:
        dep = report["dependencies"][r["engine"]]
        per_engine.append({"engine": f"{r['engine']} {r['version']}", "import_ms": r["import_s"] * 1e3,
                           "view_ms": r["view_ms"]["median"], "view_spread": _spread(r["view_ms"]),
                           "token_bytes_ms": r["token_bytes_s"] * 1e3, "rss_mib": r["rss_growth_mib"],
                           "installed_mib": dep["installed_mib"], "requires": len(dep["requires"]),
                           "walks_valid": f"{r['robustness']['valid']}/{r['robustness']['finished']}"})  # fmt: skip
        for name, s in r["schemas"].items():
            per_schema.append({"engine": r["engine"], "schema": name, "doc_tokens": s["doc_tokens"],
                               "cold_ms": s["compile_cold_ms"]["median"], "cold_spread": _spread(s["compile_cold_ms"]),
                               "warm_ms": s["compile_warm_ms"]["median"], "mask_us": s["mask_ms"]["median"] * 1e3,
                               "mask_p99_us": s["mask_ms"]["p99"] * 1e3, "steps": s["mask_ms"]["n"]})  # fmt: skip
    return per_engine, per_schema


def _spread(s: dict) -> str:
    return f"{s['min']:.2f}..{s['max']:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each compile / view build (median shown)")
    parser.add_argument("--steps", type=int, default=600, help="mask steps per schema (the document, repeated)")
    parser.add_argument("--walks", type=int, default=20, help="random walks of the robustness check")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "astrai_bench_grammar")
    parser.add_argument("--smoke", action="store_true", help="4k vocabulary, few repeats (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.folder, args.repeats, args.steps, args.walks)))
        return 0
    if args.smoke:
        args.vocab, args.repeats, args.steps, args.walks = 4000, 2, 50, 3
    report = run(args)
    per_engine, per_schema = _rows(report)
    m = report["machine"]
    console.print(f"{m['cpu']}, {m['cores']} cores; vocabulary {report['vocab']} tokens")
    console.print(table("tokenizer view, import, memory, dependency weight", per_engine,
                        [("engine", ""), ("import_ms", ".0f"), ("token_bytes_ms", ".0f"), ("view_ms", ".1f"),
                         ("view_spread", ""), ("rss_mib", ".1f"), ("installed_mib", ".1f"), ("requires", ""),
                         ("walks_valid", "")]))  # fmt: skip
    console.print(table("JSON-schema compile (ms, to first mask) and per-token mask (µs)", per_schema,
                        [("engine", ""), ("schema", ""), ("doc_tokens", ""), ("cold_ms", ".2f"), ("cold_spread", ""),
                         ("warm_ms", ".3f"), ("mask_us", ".1f"), ("mask_p99_us", ".1f"), ("steps", "")]))  # fmt: skip
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
