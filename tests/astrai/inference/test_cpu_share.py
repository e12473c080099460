"""`EngineConfig.share_cpu_cores`: the step threads follow the cores other processes leave, and come back.

The readings are faked (other processes' load cannot be staged reliably in a unit test); the measured effect under
a real competing process is bench_shared_cores' (docs/benchmarks-history.md).
"""

import subprocess
import sys
import threading
import time

import pytest
import torch

import astrai
from astrai.inference import cpu_share, engine_cache
from astrai.inference.cpu_share import (
    TICKS_PER_S,
    CpuTimes,
    SharedCores,
    others_running_now,
    read_cpu_times,
    shared_cores,
)
from helpers import tiny_model_dir


class FakeMachine:
    """CPU readings in which other processes use `others` CPUs and this one `own`, one second per reading."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own_ticks, self.others, self.own = 0.0, 0, 0, 0.0, 2.0

    def read(self) -> CpuTimes:
        self.wall += 1.0
        self.own_ticks += int(self.own * TICKS_PER_S)
        self.busy += int((self.own + self.others) * TICKS_PER_S)
        return CpuTimes(self.wall, self.busy, self.own_ticks)


def test_the_thread_count_follows_the_cores_others_leave_and_restores():
    machine, calls, running = FakeMachine(), [], [0]
    cores = SharedCores(2, cpus=2, interval_s=10.0, first_s=0.0, read=machine.read, running=lambda: running[0],
                        set_threads=calls.append)  # fmt: skip

    def step():  # as the engine calls it; the fake readings are a second apart, so every window has ended
        cores.before_step()
        cores.after_step()

    step()  # the first step opens a window: no decision yet
    step()  # quiet: both cores
    assert calls == [] and cores.current == 2
    machine.others = 1.0  # a busy process holds a core
    step()
    assert calls == [1]
    machine.others = 0.3  # light background load: two again
    step()
    assert calls == [1, 2] and cores.switches == 2
    machine.others = 1.6  # both cores mostly taken: never below one thread
    step()
    assert calls[-1] == 1
    cores.restore()  # the call ended: the caller's thread gets its count back ...
    assert calls[-1] == 2
    read, cores._read = cores._read, lambda: None
    step()  # ... and the next call's first step runs the decided count again, before any new reading
    assert calls[-1] == 1 and cores.applied == 1
    cores._read, machine.others = read, 0.0
    cores._ended_s -= 100.0  # an idle gap: what others did meanwhile is not judged, a fresh window opens, and
    cores.before_step()  # until it ends the steps run on the cores no other thread runs on now (none here)
    assert cores.current == 2 and calls[-1] == 2 and cores._window_s == cores.first_s
    cores.after_step()
    running[0] = 1  # a busy process at the next gap: the first step (often a whole prefill) runs on one thread
    cores._ended_s -= 100.0
    cores.before_step()
    assert cores.current == 1 and calls[-1] == 1
    cores.after_step()
    running[0] = None  # /proc unreadable: every thread
    cores._ended_s -= 100.0
    cores.before_step()
    assert cores.current == 2 and calls[-1] == 2
    # the measure itself: 150 busy ticks of the machine over a second, 50 of them this process's, is one CPU
    cores._last = CpuTimes(0.0, 0, 0)
    assert cores.others(CpuTimes(1.0, int(1.5 * TICKS_PER_S), int(0.5 * TICKS_PER_S))) == pytest.approx(1.0)


def test_a_busy_process_is_seen_running_now():
    """`others_running_now` against a real competitor: a busy loop in another process counts as one running thread
    (the serial suite runs nothing else; a momentary thread is filtered by taking the fewest of the samples)."""
    before = others_running_now()
    stop = threading.Event()

    def own_work():  # this process's threads running (GIL released) are not another process's
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a

    worker = threading.Thread(target=own_work)
    worker.start()
    try:
        time.sleep(0.1)
        assert others_running_now() <= before
    finally:
        stop.set()
        worker.join()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert others_running_now() >= before + 1 >= 1
    finally:
        busy.kill()
        busy.wait()


def test_on_by_default_unless_the_environment_says_0(monkeypatch):
    from astrai.inference.engine_config import EngineConfig

    monkeypatch.delenv("ASTRAI_SHARE_CPU_CORES")  # the suite sets it to 0 (tests/conftest.py)
    assert EngineConfig().share_cpu_cores is True
    monkeypatch.setenv("ASTRAI_SHARE_CPU_CORES", "0")
    assert EngineConfig().share_cpu_cores is False
    assert EngineConfig(share_cpu_cores=True).share_cpu_cores is True


def test_readings_come_from_proc_and_the_monitor_is_off_where_it_cannot_help():
    now = read_cpu_times()
    assert now is not None and now.busy_ticks >= now.own_ticks > 0
    assert others_running_now() is not None  # this thread runs, and is not counted as another process's
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert isinstance(shared_cores(cpu, 1, True), SharedCores)
        assert shared_cores(cpu, 1, False) is None  # EngineConfig(share_cpu_cores=False)
        assert shared_cores(cpu, 2, True) is None  # tensor parallel: the other ranks would count as others
        assert shared_cores(torch.device("meta"), 1, True) is None  # not a CPU
        torch.set_num_threads(1)
        assert shared_cores(cpu, 1, True) is None  # nothing to share
    finally:
        torch.set_num_threads(threads)


def test_generate_steps_on_fewer_threads_under_load_and_gives_the_count_back(tmp_path, monkeypatch):
    """Through `astrai.generate_ids`: the steps run on one thread while the (fake) machine is busy, and the caller's
    thread has its count again after the call; with the option off, the steps keep both threads."""
    machine = FakeMachine()
    machine.others = 1.0
    monkeypatch.setattr(cpu_share, "read_cpu_times", machine.read)
    seen = []
    step = engine_cache.Engine._run_step

    def spy(self):
        seen.append(torch.get_num_threads())
        return step(self)

    monkeypatch.setattr(engine_cache.Engine, "_run_step", spy)
    monkeypatch.setattr(SharedCores, "__init__", _fast_init)
    monkeypatch.setattr(engine_cache, "SHARE_CPU_CORES", None)  # EngineConfig's default (the suite sets it off)
    monkeypatch.setenv("ASTRAI_SHARE_CPU_CORES", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = astrai.load(tiny_model_dir(tmp_path, seed=0))
        astrai.generate_ids(model, [[5, 6, 7]], max_tokens=6, stop_token_ids=[])
        assert seen[-1] == 1 and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(engine_cache, "SHARE_CPU_CORES", False)  # negative control: the option off
        astrai.generate_ids(astrai.load(tiny_model_dir(tmp_path / "b", seed=0)), [[5, 6, 7]], max_tokens=6,
                            stop_token_ids=[])  # fmt: skip
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(threads)


_init = SharedCores.__init__


def _fast_init(self, threads, **kwargs):
    """A monitor that reads every step (the engine's 0.5 s interval would outlast a tiny test generation)."""
    _init(self, threads, **{**kwargs, "cpus": 2, "first_s": 0.0, "interval_s": 10.0, "read": cpu_share.read_cpu_times,
                            "running": lambda: 0})  # fmt: skip
