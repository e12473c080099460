"""astrai's decode on a CPU it shares with another program: OpenMP wait and thread settings, quiet and contended.

Each OpenMP parallel region of a decode step (inductor's loops, oneDNN's products, astrai's C kernels; ~150 per step)
ends in a barrier. GNU OpenMP (torch's libgomp) makes a thread that reaches a barrier early spin for
`GOMP_SPINCOUNT` iterations (300,000 by default, about 10 ms on the development VM) before it sleeps. On a quiet
machine the spin catches the next region in microseconds; when another process holds a core, the thread the
barrier waits for is descheduled, and the spinning thread keeps the core it would need, so every barrier can cost
a scheduler time slice.

astrai answers with a short spin (`astrai.openmp`) and by running its steps on the cores other programs leave
(`EngineConfig.share_cpu_cores`, `astrai.inference.cpu_share`). This script starts one astrai worker
(`cpu_peer_worker.py`, `generate_ids`) per arm in `--arms`: a GOMP_SPINCOUNT value ("default" for libgomp's own,
"passive" for OMP_WAIT_POLICY=PASSIVE), with ":fixed" for share_cpu_cores=False; then runs, round by round in
rotated order: a batch-1 decode and a `--batch`-request batch, quiet and with a busy-loop process
holding a core (`bench_cpu_peers.Competitor`). Reported: output tok/s (median, min-max), each setting's quiet rate
over the default's, and its contended rate as a fraction of its own quiet rate. Prints rich tables and the JSON
report as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _common import console, emit, table
from bench_cpu_peers import Competitor, Worker, build_folder, prompts
from bench_forward import memory_bandwidth_gbs

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bench_shared_cores.json"


def env_of(arm: str, threads: int) -> dict[str, str]:
    """The environment a worker starts with for one arm (`SPIN` or `SPIN:fixed`)."""
    spin = arm.split(":")[0]
    env = {"OMP_NUM_THREADS": str(threads)}
    if spin == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:  # "default": libgomp's own when OMP_WAIT_POLICY is unset, named so that astrai keeps it
        env["GOMP_SPINCOUNT"] = "300000" if spin == "default" else spin
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--arms",
        nargs="+",
        default=["default:fixed", "10000:fixed", "10000"],
        help="SPIN (a GOMP_SPINCOUNT, default, passive), with :fixed for share_cpu_cores=False",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=HERE.parent / "runs" / "cpu_peers")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 round, 8 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.rounds, args.prompt, args.new, args.batch = "chat-small", 1, 8, 8, 4
        args.work = args.work.with_name(args.work.name + "_smoke")
    folder = args.work / args.model
    build_folder(folder, args.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    workers = {}
    for arm in args.arms:
        fixed = ["--fixed-threads"] if arm.endswith(":fixed") else []
        with console.status(f"starting astrai: {arm}"):
            argv = ["astrai", str(folder), "--dtype", args.dtype, "--threads", str(args.threads), *fixed]
            workers[arm] = Worker(f"astrai {arm}", sys.executable, argv, env_of(arm, args.threads))
    jobs = [(f"{kind}{' (contended)' if busy else ''}", n, busy) for busy in (False, True)
            for kind, n in (("single", 1), ("batch", args.batch))]  # fmt: skip
    samples = []
    try:
        for r in range(-1, args.rounds):  # round -1: untimed (compiles; the larger batch first)
            bandwidth = memory_bandwidth_gbs()
            order = args.arms[r % len(args.arms) :] + args.arms[: r % len(args.arms)]
            console.print(f"round {r + 1}/{args.rounds}: read bandwidth {bandwidth:.1f} GB/s")
            for name, n, busy in sorted(jobs, key=lambda j: -j[1]) if r < 0 else jobs:
                if r < 0 and busy:
                    continue
                for arm in order:
                    batch = prompts(n, args.prompt, vocab, seed=1000 * (r + 1) + 10 * n + busy)
                    if busy:
                        with Competitor():
                            got = workers[arm].generate(batch, args.new)
                    else:
                        got = workers[arm].generate(batch, args.new)
                    if r >= 0:
                        samples.append(dict(round=r, arm=arm, workload=name, requests=n, bandwidth_gbs=bandwidth,
                                            tok_s=n * args.new / got["seconds"]))  # fmt: skip
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for arm in args.arms:
        for name, _, busy in jobs:
            runs = [s for s in samples if s["arm"] == arm and s["workload"] == name]
            rates = [s["tok_s"] for s in runs]
            row = dict(arm=arm, workload=name, tok_s=statistics.median(rates), tok_s_min=min(rates),
                       tok_s_max=max(rates))  # fmt: skip
            pair = {s["round"]: s["tok_s"] for s in samples if s["arm"] == args.arms[0]
                    and s["workload"] == name}  # fmt: skip
            row["vs_first"] = statistics.median(s["tok_s"] / pair[s["round"]] for s in runs)
            if busy:
                quiet = {s["round"]: s["tok_s"] for s in samples if s["arm"] == arm
                         and s["workload"] == name.split()[0]}  # fmt: skip
                row["of_quiet"] = statistics.median(s["tok_s"] / quiet[s["round"]] for s in runs)
            rows.append(row)
    console.print(table(f"astrai {args.dtype}, {args.threads} threads: output tok/s by arm "
                        f"(vs_first: over {args.arms[0]}, round by round)", rows,
                        [("arm", ""), ("workload", ""), ("tok_s", ".1f"), ("tok_s_min", ".1f"), ("tok_s_max", ".1f"),
                         ("vs_first", ".2f"), ("of_quiet", ".2f")]))  # fmt: skip
    emit(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows, samples=samples), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
