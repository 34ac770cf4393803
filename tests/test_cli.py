"""The CLI on good and bad input: one clear error line, a non-zero exit, nothing left behind."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmx.cli import main


def run(args: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one error line: last on stderr (progress lines may precede it), single-line."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one final error line, got: {err!r}"
    return errors[0]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def optimize_with_model_field(artifact: Path, field: str, value, tmp_path: Path, capsys) -> tuple[int, str]:
    """`llmx optimize` on a copy of ``artifact`` whose manifest sets model.<field> to ``value``
    (a feature the fused builder may not have): exit code and the error line."""
    src = tmp_path / "changed"
    shutil.copytree(artifact, src)
    manifest = json.loads((src / "llmx.json").read_text())
    manifest["model"][field] = value
    (src / "llmx.json").write_text(json.dumps(manifest))
    code, _, err = run(["optimize", str(src), "-o", str(tmp_path / "out")], capsys)
    return code, error_line(err) if code else ""


@pytest.fixture
def ckpt_copy(store, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(store.checkpoint("llama"), dst)
    return dst


def test_export_missing_directory(tmp_path, capsys):
    code, _, err = run(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "does not exist" in error_line(err)
    assert leftovers(tmp_path) == []


def test_export_unsupported_architecture_names_supported_ones(ckpt_copy, tmp_path, capsys):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg.update(model_type="falcon", architectures=["FalconForCausalLM"])
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(["export", str(ckpt_copy), "-o", str(tmp_path / "out")], capsys)
    line = error_line(err)
    assert code != 0 and "falcon" in line and "llama" in line and "gpt2" in line
    assert not (tmp_path / "out").exists()


def test_export_corrupt_weights(ckpt_copy, tmp_path, capsys):
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00" * 100)
    code, _, err = run(["export", str(ckpt_copy), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "cannot read weights" in error_line(err)
    assert leftovers(tmp_path) == ["ckpt"]


def test_export_missing_weights(ckpt_copy, tmp_path, capsys):
    (ckpt_copy / "model.safetensors").unlink()
    code, _, err = run(["export", str(ckpt_copy), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "has no weights" in error_line(err)


def test_export_weights_missing_a_tensor(ckpt_copy, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(ckpt_copy / "model.safetensors"))
    code, _, err = run(["export", str(ckpt_copy), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "up_proj" in error_line(err)
    assert leftovers(tmp_path) == ["ckpt"]


def test_export_shape_mismatch(ckpt_copy, tmp_path, capsys):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(["export", str(ckpt_copy), "-o", str(tmp_path / "out")], capsys)
    assert code != 0 and "shape" in error_line(err)


def test_export_refuses_to_overwrite_without_force(store, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(out)], capsys)
    assert code != 0 and "already exists" in error_line(err)
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(out), "--force"], capsys)
    assert code != 0 and "not an llmx artifact" in error_line(err)
    assert (out / "keep.txt").read_text() == "mine"


def test_export_failure_midway_leaves_nothing(store, tmp_path, capsys, monkeypatch):
    import llmx.export.verify as verify

    def broken(*args, **kwargs):
        raise verify.VerificationError("verification failed: prefill output 0 differs from PyTorch by 1 (allowed 1e-4)")

    monkeypatch.setattr(verify, "verify_export", broken)
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(tmp_path / "out"), "--verify"], capsys)
    assert code != 0 and "verification failed" in error_line(err)
    assert leftovers(tmp_path) == []


def test_export_verify_and_force_replace(store, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(["export", str(store.checkpoint("gpt2")), "-o", str(out), "--verify"], capsys)
    assert code == 0, err
    assert "verified" in err
    code, _, err = run(["export", str(store.checkpoint("llama")), "-o", str(out), "--force"], capsys)
    assert code == 0, err
    assert json.loads((out / "llmx.json").read_text())["model"]["family"] == "llama"
    assert leftovers(tmp_path) == ["out"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_generate_bad_sampling_values(llama_artifact, args, words, capsys):
    code, out, err = run(["generate", str(llama_artifact), "def", *args], capsys)
    assert code != 0 and words in error_line(err) and out == ""


def test_generate_prompt_longer_than_the_model(llama_artifact, capsys):
    code, _, err = run(["generate", str(llama_artifact), "x = 1\n" * 300], capsys)
    assert code == 2 and "maximum context length is" in error_line(err)


def test_generate_on_a_non_artifact(tmp_path, capsys):
    code, _, err = run(["generate", str(tmp_path), "hi"], capsys)
    assert code != 0 and "not an llmx artifact" in error_line(err)


def test_generate_streams_and_json_agrees(llama_artifact, capsys):
    args = ["generate", str(llama_artifact), "def f(x):", "--max-new-tokens", "12", "--temperature", "0.7", "--seed", "1"]
    code, streamed, err = run(args, capsys)
    assert code == 0 and "12 tokens" in err
    code, out, _ = run([*args, "--json"], capsys)
    result = json.loads(out)
    assert result["completion_tokens"] == 12 and streamed == result["text"] + "\n"


def test_inspect_check_detects_tampering(store, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(store.artifact("llama"), art)
    code, out, _ = run(["inspect", str(art), "--check"], capsys)
    assert code == 0 and "decode.onnx" in out and "checksums" in out
    with open(art / "weights.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\x01\x02\x03")
    code, _, err = run(["inspect", str(art), "--check"], capsys)
    assert code != 0 and "weights.bin" in error_line(err)


def test_console_script_runs_in_a_real_process(llama_artifact):
    exe = Path(sys.executable).parent / "llmx"
    # Greedy and past EOS: sampled without a seed, an early EOS made the count flaky.
    proc = subprocess.run([str(exe), "generate", str(llama_artifact), "x", "--max-new-tokens", "3", "--temperature", "0",
                           "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["completion_tokens"] == 3
    proc = subprocess.run([str(exe), "generate", "/no/such/dir", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["inspect"], ["generate"], ["bench"]])
def test_a_gguf_file_where_an_artifact_belongs_says_to_export_it(tmp_path, capsys, command):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    args = [command[0], str(gguf)] + (["x"] if command[0] == "generate" else [])
    code, _, err = run(args, capsys)
    line = error_line(err)
    assert code == 1 and "is a GGUF file" in line and f"llmx export {gguf} -o DIR" in line
    code, _, err = run(["inspect", str(tmp_path)], capsys)  # a directory without a manifest, as before
    assert code == 1 and "not an llmx artifact" in error_line(err)


def test_inspect_groups_fallback_names_by_layer(store, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(store.artifact("llama"), art)
    manifest = json.loads((art / "llmx.json").read_text())
    projections = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    names = [f"model.layers.{i}.{p}.weight" for i in (*range(12), 14, 15) for p in projections] + ["lm_head.weight"]
    manifest["precision"]["fallback"] = names
    (art / "llmx.json").write_text(json.dumps(manifest))
    code, out, _ = run(["inspect", str(art)], capsys)
    assert code == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  fallback"))
    block = [lines[start], *itertools.takewhile(lambda line: line.startswith("    "), lines[start + 1 :])]
    assert block[0].startswith("  fallback (71 MatMuls in higher precision): ")
    assert all(len(line) <= 100 for line in block) and len(block) <= 4
    shown = " ".join(block)
    for p in projections:
        assert f"model.layers.{{0-11,14-15}}.{p}.weight" in shown
    assert "lm_head.weight" in shown and "fallback=" not in out
