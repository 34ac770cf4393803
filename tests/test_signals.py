"""SIGTERM (``timeout``, CI cancellation, ``docker stop``) and SIGHUP end a stage as Ctrl-C does:
its temp folders and its half-written artifact are removed, and it exits 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import llmx

LLMX = str(Path(sys.executable).parent / "llmx")
DEMO_MODEL = Path(llmx.__file__).parent / "demo_model"


def run_until(args: list[str], ready, tmp_path: Path, signum: int) -> tuple[subprocess.CompletedProcess, Path]:
    """Start ``llmx ARGS`` with its own empty TMPDIR, send ``signum`` once ``ready(tmpdir)`` holds,
    and return the finished process and that TMPDIR."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    # torch keeps its compile cache in TMPDIR/torchinductor_USER across runs, by design: elsewhere.
    env = dict(os.environ, TMPDIR=str(tmpdir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen([LLMX, *args], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.monotonic() + 300
            while not ready(tmpdir):
                assert proc.poll() is None, f"llmx ended before it was mid-run: {stderr.read_text()}"
                assert time.monotonic() < deadline, "llmx never got mid-run"
                time.sleep(0.05)
            proc.send_signal(signum)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, "", stderr.read_text()), tmpdir


def staging(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.*.tmp"))


def assert_left_nothing(proc, tmpdir: Path, out: Path, signum: int) -> None:
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"terminated ({name})", proc.stderr
    assert sorted(p.name for p in tmpdir.iterdir()) == []
    assert sorted(p.name for p in out.parent.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_export_ended_by_a_signal_leaves_nothing(tmp_path, signum):
    out = tmp_path / "out" / "art"
    out.parent.mkdir()

    def tracing(tmpdir: Path) -> bool:  # the artifact is being staged (its weights are streaming)
        return any((staged / "weights.bin").exists() for staged in staging(out))

    proc, tmpdir = run_until(["export", str(DEMO_MODEL), "-o", str(out)], tracing, tmp_path, signum)
    assert_left_nothing(proc, tmpdir, out, signum)


@pytest.mark.slow
def test_calibrate_ended_by_sigterm_leaves_nothing(llama_artifact, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text((Path(llmx.__file__).parent / "cli.py").read_text() * 4)
    out = tmp_path / "out" / "art-w8"
    out.parent.mkdir()

    def calibrating(tmpdir: Path) -> bool:
        return bool(staging(out)) and any(tmpdir.glob("llmx-calibrate-*/*"))

    args = ["calibrate", str(llama_artifact), "--data", str(data), "--scheme", "w8", "-o", str(out)]
    proc, tmpdir = run_until(args, calibrating, tmp_path, signal.SIGTERM)
    assert_left_nothing(proc, tmpdir, out, signal.SIGTERM)


def test_a_signal_in_process_ends_main_and_puts_the_handlers_back(monkeypatch, tmp_path, capsys):
    import llmx.commands.inspect as inspect_command
    from llmx.cli import main

    def hang_up(directory):
        signal.raise_signal(signal.SIGHUP)
        raise AssertionError("SIGHUP did not end the command")

    monkeypatch.setattr(inspect_command, "load_manifest", hang_up)
    before = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        main(["inspect", str(tmp_path)])
    assert ended.value.code == 129
    assert capsys.readouterr().err.splitlines() == ["terminated (SIGHUP)"]
    assert (signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)) == before
