"""weights.bin's writer (llmx/artifact/onnx_files.WeightsFile): what a background write gives,
and an export ended mid-stream (Ctrl-C, SIGTERM) that never waits on the writer's queue."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llmx.artifact.onnx_files import WeightsFile


def tensors() -> list[bytes]:
    rng = np.random.default_rng(0)
    sizes = [10, 3000, 70_000, 1 << 20, 5 << 20, 200, (1 << 20) + 3]  # both alignments, queued and written at once
    return [rng.standard_normal(n // 4 + 1, dtype=np.float32).tobytes()[:n] for n in sizes]


@pytest.mark.parametrize("background", [False, True])
def test_each_tensor_lands_at_its_offset(background, tmp_path):
    with WeightsFile(tmp_path, background=background) as data:
        placed = [data.append(raw) for raw in tensors()]
    written = (tmp_path / "weights.bin").read_bytes()
    for raw, (offset, length) in zip(tensors(), placed):
        assert written[offset:offset + length] == raw
        assert offset % (65536 if length >= 1 << 20 else 64) == 0
    assert len(written) == placed[-1][0] + placed[-1][1]


def test_the_background_and_foreground_files_are_the_same(tmp_path):
    for background in (False, True):
        (tmp_path / str(background)).mkdir()
        with WeightsFile(tmp_path / str(background), background=background) as data:
            for raw in tensors():
                data.append(raw)
    assert (tmp_path / "False" / "weights.bin").read_bytes() == (tmp_path / "True" / "weights.bin").read_bytes()


class Ended(BaseException):
    """What a signal raises in the main thread (llmx.errors.Terminated, KeyboardInterrupt)."""


def test_an_export_ended_mid_stream_closes_without_waiting_on_the_queue(tmp_path):
    # A signal's exception can land in Queue.put after it took the queue's lock and before the
    # `with` that releases it was entered: the lock stays held, so a put or join on the way out
    # would wait forever (an export that SIGHUP left hanging in CI).
    done = threading.Event()

    def export():
        try:
            with WeightsFile(tmp_path, background=True) as data:
                data.append(b"x" * 4096)
                data._queue.mutex.acquire()
                raise Ended
        except Ended:
            done.set()

    thread = threading.Thread(target=export, daemon=True)
    thread.start()
    assert done.wait(10), "closing weights.bin waited on a queue whose lock the signal left held"
