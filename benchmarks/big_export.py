"""Exporting a big checkpoint: peak RSS and wall time of `llmx export`.

    python benchmarks/big_export.py [--shape smollm-135m|tinyllama-1.1b|qwen3-4b|llama3.1-8b] [--graphs fused]
                                    [--precision fp32|fp16|bf16|w8|w4] [--work DIR] [--keep] [--gguf Q8_0]
                                    [--layers N]

``--shape`` picks the checkpoint (default the TinyLlama-1.1B shape below; qwen3-4b: 36 layers,
hidden 2560, q/k norms, tied head, vocab 151936; llama3.1-8b: 32 layers, hidden 4096, 8 KV
heads, intermediate 14336, vocab 128256, llama3 RoPE scaling). ``--graphs``/``--precision`` are
passed to `llmx export` (fused: the streamed export, which never loads the model).

Builds a TinyLlama-1.1B-shaped Llama checkpoint with random bf16 weights (hidden 2048, 22
layers, 32 heads, 4 KV heads, intermediate 5632, vocab 32000, untied head), written shard by
shard so the full model never sits in memory, then runs `llmx export` on it in a child
process. The child's RSS is sampled every 0.2 s and attributed to the phase named by the last
line the export logged; the peak also comes from the kernel (getrusage of the child). Export
cost depends on shapes, not on weight values, so random weights measure what the real
checkpoint would. Goal (issue 14): peak RSS under 2x the fp32 weight size. ``--gguf TYPE``
writes the checkpoint as a llama.cpp-style GGUF of that type and exports the GGUF instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from smollm_shape import SMOLLM_135M, TINYLLAMA_1_1B as TINYLLAMA_1B, write_tokenizer  # noqa: E402

LAYERS_PER_SHARD = 2
QWEN3_4B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                hidden_act="silu")
LLAMA31_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}, hidden_act="silu")
SHAPES = {"smollm-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", **SMOLLM_135M),
          "tinyllama-1.1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                                 **TINYLLAMA_1B),
          "qwen3-4b": QWEN3_4B, "llama3.1-8b": LLAMA31_8B,
          # not a real model: a seconds-long smoke test of the benchmark scripts themselves
          "tiny": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False, hidden_act="silu")}
SHAPE = SHAPES["tinyllama-1.1b"]  # set by --shape


def _layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    c = SHAPE
    h, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = head_dim * c["num_attention_heads"], head_dim * c["num_key_value_heads"]
    p = f"model.layers.{i}."
    norms = ({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
             if c["model_type"] == "qwen3" else {})
    return {**norms,
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }


def _shards() -> list[dict[str, tuple[int, ...]]]:
    c = SHAPE
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    shards = [{"model.embed_tokens.weight": (v, h)}]
    for start in range(0, n, LAYERS_PER_SHARD):
        shard: dict[str, tuple[int, ...]] = {}
        for i in range(start, min(start + LAYERS_PER_SHARD, n)):
            shard.update(_layer_shapes(i))
        shards.append(shard)
    shards.append({"model.norm.weight": (h,), **({} if c.get("tie_word_embeddings") else {"lm_head.weight": (v, h)})})
    return shards


def build_checkpoint(directory: Path, seed: int = 0) -> tuple[Path, int]:
    """Write the sharded bf16 checkpoint (once); returns (directory, parameter count)."""
    import torch
    from safetensors.torch import save_file

    shards = _shards()
    params = sum(int(torch.Size(s).numel()) for shard in shards for s in shard.values())
    if (directory / "model.safetensors.index.json").is_file():
        return directory, params
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: _random(shape, generator) for key, shape in shard.items()}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"torch_dtype": "bfloat16", **SHAPE}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, SHAPE["vocab_size"])
    return directory, params


def _random(shape: tuple[int, ...], generator):
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


class RssSampler:
    """Samples a process tree's RSS and remembers the peak per phase (the last logged line)."""

    def __init__(self, pid: int, interval: float = 0.2):
        import psutil

        self.process = psutil.Process(pid)
        self.interval = interval
        self.phase = "starting"
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        import psutil

        try:
            procs = [self.process, *self.process.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            rss = self._rss()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)


def write_gguf(ckpt: Path, out: Path, qtype: str) -> Path:
    """The checkpoint as a llama.cpp-style GGUF (q/k rows permuted, 2-D weights in ``qtype``), tensor by tensor."""
    if out.is_file():
        return out
    import gguf
    import numpy as np
    from safetensors import safe_open

    sys.path.insert(0, str(HERE.parent / "tests"))
    from gguf_files import _add_tokenizer, gguf_name, permute  # the tests' writer: one definition of the layout

    c = TINYLLAMA_1B
    writer = gguf.GGUFWriter(str(out), "llama", use_temp_file=True)
    for add, value in ((writer.add_block_count, c["num_hidden_layers"]), (writer.add_context_length, c["max_position_embeddings"]),
                       (writer.add_embedding_length, c["hidden_size"]), (writer.add_feed_forward_length, c["intermediate_size"]),
                       (writer.add_head_count, c["num_attention_heads"]), (writer.add_head_count_kv, c["num_key_value_heads"]),
                       (writer.add_layer_norm_rms_eps, c["rms_norm_eps"]), (writer.add_rope_freq_base, c["rope_theta"])):
        add(value)
    _add_tokenizer(writer, ckpt)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                array = f.get_tensor(name).float().numpy()
                ours = gguf_name(name)
                if ".attn_q." in ours or ".attn_k." in ours:
                    array = permute(array, c["num_attention_heads"] if ".attn_q." in ours else c["num_key_value_heads"])
                if array.ndim == 2:
                    writer.add_tensor(ours, gguf.quants.quantize(array, quant), raw_dtype=quant)
                else:
                    writer.add_tensor(ours, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def run_export(ckpt: Path, out: Path, flags: list[str]) -> dict:
    llmx = Path(sys.executable).with_name("llmx")
    cmd = ["nice", "-n", "10", str(llmx), "export", str(ckpt), "-o", str(out), "--force", *flags]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    sampler = RssSampler(child.pid)
    sampler.thread.start()
    phases: list[tuple[str, float]] = []
    for line in child.stderr:
        line = line.rstrip()
        print(f"  [{time.perf_counter() - start:7.1f}s] {line}", flush=True)
        phases.append((line, time.perf_counter() - start))
        sampler.phase = line
    rc = child.wait()
    sampler.stop.set()
    sampler.thread.join()
    wall = time.perf_counter() - start
    if rc != 0:
        raise SystemExit(f"llmx export failed with exit code {rc}")
    peak_kernel = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    return {"wall_s": round(wall, 1), "peak_rss_bytes": peak_kernel,
            "phases": [{"log": p, "started_s": round(t, 1), "peak_rss_bytes": sampler.peaks.get(p, 0)}
                       for p, t in phases]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmx-big-export"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and artifact")
    parser.add_argument("--gguf", metavar="TYPE", help="export a GGUF of the checkpoint instead (Q8_0, Q4_0, F32, ...)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--graphs", choices=["portable", "fused"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "w8", "w4"])
    parser.add_argument("--layers", type=int, help="a shorter stack of the shape's widths (a quick proxy: memory "
                                                   "per layer and the vocabulary's tensors are the real ones)")
    args = parser.parse_args()
    global SHAPE
    SHAPE = SHAPES[args.shape] if args.layers is None else {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    flags = [*(["--graphs", args.graphs] if args.graphs else []), "--precision", args.precision]
    t0 = time.perf_counter()
    name = args.shape if args.layers is None else f"{args.shape}-{args.layers}l"
    ckpt, params = build_checkpoint(args.work / f"ckpt-{name}")
    source = write_gguf(ckpt, args.work / f"tinyllama-{args.gguf}.gguf", args.gguf) if args.gguf else ckpt
    build_s = time.perf_counter() - t0
    fp32_bytes = params * 4
    print(f"checkpoint: {params / 1e9:.3f}B parameters, fp32 {fp32_bytes / 2**30:.2f} GiB (built in {build_s:.0f}s)")
    result = run_export(source, args.work / "art", [] if args.gguf else flags)
    artifact_bytes = sum(p.stat().st_size for p in (args.work / "art").rglob("*") if p.is_file())
    gib = 2**30
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "shape": name, "config": SHAPE, "parameters": params, "checkpoint_dtype": "bfloat16",
        "export_flags": [] if args.gguf else flags,
        "source": f"gguf {args.gguf}" if args.gguf else "safetensors",
        "fp32_weight_bytes": fp32_bytes, "artifact_bytes": artifact_bytes,
        "peak_rss_over_fp32": round(result["peak_rss_bytes"] / fp32_bytes, 2), **result,
    }
    print(f"\n| phase (last log line) | from s | peak RSS GiB |\n|---|---|---|")
    for phase in result["phases"]:
        print(f"| {phase['log'][:70]} | {phase['started_s']} | {phase['peak_rss_bytes'] / gib:.2f} |")
    print(f"\n| params | fp32 weights GiB | peak RSS GiB | peak / fp32 | wall s | artifact GiB |\n|---|---|---|---|---|---|")
    print(f"| {params / 1e9:.3f}B | {fp32_bytes / gib:.2f} | {result['peak_rss_bytes'] / gib:.2f} "
          f"| {record['peak_rss_over_fp32']} | {result['wall_s']} | {artifact_bytes / gib:.2f} |")
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    label = f"_gguf_{args.gguf}" if args.gguf else f"_{name}_{args.graphs or 'default'}_{args.precision}"
    path = results / f"big_export{label}_{datetime.now(timezone.utc):%Y-%m-%d_%H%M}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")
    if not args.keep:
        shutil.rmtree(args.work / "art", ignore_errors=True)
        shutil.rmtree(args.work / f"ckpt-{name}", ignore_errors=True)


if __name__ == "__main__":
    main()
