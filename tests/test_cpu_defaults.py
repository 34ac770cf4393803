"""The CPU defaults (issue 17): thread count and spinning from the cores actually free, and one
session's packed weights for a single prompt's prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from llmx.errors import InputError
from llmx.artifact import Artifact
from llmx.runtime import cpu_plan
from llmx.runtime.cpu_plan import cpu_times, idle_per_cpu, plan_threads, sample_idle
from llmx.runtime.onnx_backend import OrtBackend

# /proc/stat lines: user nice system idle iowait irq softirq steal
BEFORE = """cpu  2000 0 1000 9000 100 0 0 0 0 0
cpu0 1000 0 500 4500 50 0 0 0 0 0
cpu1 1000 0 500 4500 50 0 0 0 0 0
intr 12345
"""


def after(busy0: int, busy1: int, ticks: int = 100) -> str:
    """/proc/stat ``ticks`` jiffies later, cpu0 and cpu1 busy for ``busy0``/``busy1`` of them."""
    rows = []
    for n, busy in ((0, busy0), (1, busy1)):
        rows.append(f"cpu{n} {1000 + busy} 0 500 {4500 + ticks - busy} 50 0 0 0 0 0")
    return "cpu  0 0 0 0 0 0 0 0 0 0\n" + "\n".join(rows) + "\nintr 12345\n"


def test_proc_stat_is_read_per_cpu():
    assert cpu_times(BEFORE) == {0: (4550, 6050), 1: (4550, 6050)}
    assert idle_per_cpu(BEFORE, after(100, 0), {0, 1}) == {0: 0.0, 1: 1.0}
    assert idle_per_cpu(BEFORE, after(25, 50), {1}) == {1: 0.5}  # only the CPUs this process may use


@pytest.mark.parametrize("busy, threads, spin", [
    ((0, 0), 2, True),      # quiet: a core per thread, and they spin while a graph runs
    ((100, 0), 1, False),   # a neighbour burning one core
    ((50, 50), 1, False),   # the same neighbour, moved between cores by the scheduler
    ((10, 5), 2, True),     # a little background work still leaves two cores
    ((100, 100), 1, False), # everything busy: one thread, never spinning
])
def test_threads_and_spin_follow_the_free_cores(busy, threads, spin):
    idle = idle_per_cpu(BEFORE, after(*busy), {0, 1})
    plan = plan_threads(cpus={0, 1}, idle=idle, physical=2, env={})
    assert (plan.threads, plan.spin) == (threads, spin)
    assert plan.source == "free cores"


def test_explicit_choices_win_and_an_oversubscribed_pool_does_not_spin():
    busy = idle_per_cpu(BEFORE, after(100, 0), {0, 1})
    assert (plan_threads(2, cpus={0, 1}, idle=busy, physical=2, env={}).spin) is False
    assert (plan_threads(2, True, cpus={0, 1}, idle=busy, physical=2, env={}).spin) is True
    quiet = idle_per_cpu(BEFORE, after(0, 0), {0, 1})
    assert plan_threads(None, False, cpus={0, 1}, idle=quiet, physical=2, env={}).spin is False
    env = {"LLMX_THREADS": "1", "LLMX_SPIN": "1"}
    plan = plan_threads(cpus={0, 1}, idle=quiet, physical=2, env=env)
    assert (plan.threads, plan.spin, plan.source) == (1, True, "LLMX_THREADS")
    assert plan_threads(3, cpus={0, 1}, idle=quiet, physical=2, env=env).threads == 3  # the flag beats the env


@pytest.mark.parametrize("env, words", [
    ({"LLMX_THREADS": "abc"}, "LLMX_THREADS must be a whole number of threads, at least 1, got 'abc'"),
    ({"LLMX_THREADS": "0"}, "LLMX_THREADS must be a whole number of threads, at least 1, got '0'"),
    ({"LLMX_SPIN": "true"}, "LLMX_SPIN must be 0 or 1, got 'true'"),
])
def test_a_bad_environment_value_is_one_clear_error(env, words):
    with pytest.raises(InputError) as caught:
        plan_threads(cpus={0, 1}, idle={0: 1.0, 1: 1.0}, physical=2, env=env)
    assert str(caught.value) == words


def test_affinity_and_physical_cores_bound_the_threads():
    idle = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert plan_threads(cpus={0, 1, 2, 3}, idle=idle, physical=2, env={}).threads == 2  # no SMT siblings
    assert plan_threads(cpus={3}, idle={3: 1.0}, physical=8, env={}).threads == 1  # taskset -c 3


def test_sampling_reads_proc_stat_twice_and_survives_its_absence():
    readings = iter([BEFORE, after(100, 0)])
    assert sample_idle({0, 1}, 0.0, read=lambda: next(readings), sleep=lambda s: None) == {0: 0.0, 1: 1.0}

    def missing():
        raise FileNotFoundError("/proc/stat")

    assert sample_idle({0, 1}, 0.0, read=missing, sleep=lambda s: None) is None
    plan = plan_threads(cpus={0, 1}, idle=None, physical=2, env={"LLMX_SPIN": "0", "LLMX_THREADS": "2"})
    assert (plan.threads, plan.spin) == (2, False)


def _options(session) -> dict:
    opts = session.get_session_options()

    def entry(key):
        try:
            return opts.get_session_config_entry(key)
        except RuntimeError:  # never set
            return None

    return {"threads": opts.intra_op_num_threads, "spin": entry("session.intra_op.allow_spinning"),
            "stop": entry("session.force_spinning_stop")}


@pytest.mark.parametrize("idle, expected", [
    ({0: 1.0, 1: 1.0}, {"threads": 2, "spin": "1", "stop": "1"}),
    ({0: 0.0, 1: 1.0}, {"threads": 1, "spin": "0", "stop": None}),
])
def test_the_backend_sessions_get_the_plan(llama_artifact, monkeypatch, idle, expected):
    monkeypatch.setattr(cpu_plan, "sample_idle", lambda cpus, *a, **k: {c: idle.get(c, 0.0) for c in cpus})
    monkeypatch.setattr(cpu_plan, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(cpu_plan, "physical_cores", lambda: 2)
    monkeypatch.delenv("LLMX_THREADS", raising=False)
    monkeypatch.delenv("LLMX_SPIN", raising=False)
    backend = OrtBackend(Artifact.open(llama_artifact), lazy_prefill=False)
    for session in backend.sessions.values():
        assert _options(session) == expected


def _generate(backend: OrtBackend, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    cache = backend.new_cache(len(prompts), max(map(len, prompts)) + steps)
    out = [backend.prefill(cache, list(range(len(prompts))), prompts).copy()]
    for _ in range(steps):
        out.append(backend.decode(cache, out[-1].argmax(-1)[:, None])[:, -1].copy())
    return out


def test_one_prompt_is_prefilled_by_the_decode_session_with_the_same_logits(llama_artifact):
    artifact = Artifact.open(llama_artifact)
    lazy = OrtBackend(artifact, threads=1)
    eager = OrtBackend(artifact, threads=1, lazy_prefill=False)
    assert set(lazy.sessions) == {"decode"} and set(eager.sessions) == {"prefill", "decode"}
    prompt = [[1, 5, 9, 14, 3, 7, 2]]
    for a, b in zip(_generate(lazy, prompt, 6), _generate(eager, prompt, 6)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert set(lazy.sessions) == {"decode"}  # still one session: one packed copy of the weights
    # A batch of prompts needs the prefill graph (padding): it loads then, and agrees with the eager backend.
    batch = [[1, 5, 9, 14, 3], [4, 8, 2]]
    for a, b in zip(_generate(lazy, batch, 4), _generate(eager, batch, 4)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert set(lazy.sessions) == {"prefill", "decode"}


def test_one_prompt_prefill_refuses_an_empty_prompt(llama_artifact):
    from llmx.errors import InputError

    backend = OrtBackend(Artifact.open(llama_artifact), threads=1)
    with pytest.raises(InputError, match="at least one token"):
        backend.prefill(backend.new_cache(1, 4), [0], [[]])


def test_the_environment_can_load_the_prefill_session_eagerly(llama_artifact, monkeypatch):
    monkeypatch.setenv("LLMX_PREFILL_SESSION", "eager")
    assert set(OrtBackend(Artifact.open(llama_artifact), threads=1).sessions) == {"prefill", "decode"}
