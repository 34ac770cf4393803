"""GPTQ and AWQ checkpoints written by gptqmodel, loaded by transformers and by llmx (issue:
"Tiny AWQ, GPTQ and compressed-tensors checkpoints load with parity against transformers'
dequantized model (1e-4 of the logit scale) and no second rounding").

    python benchmarks/prequantized_parity.py --peer-python /tmp/gq-venv/bin/python [--work DIR]
                                             [--variants gptq-sym-g32,awq-gemm-g32,...] [--keep]

tests/test_prequantized.py checks GPTQ and AWQ against packers and dequantizers re-implemented
from the libraries' code; transformers itself loads these formats only through gptqmodel (+
optimum for GPTQ), which llmx's venv does not have (their pins want a torch llmx does not use).
So this script runs in llmx's venv and hands the foreign work to a second interpreter, the "peer"
(``--peer-python``: a venv with torch, transformers (llmx's version), gptqmodel and optimum):

1. llmx's venv writes a tiny random Llama (tests/checkpoints.py: hidden 128, intermediate 256,
   2 layers, GQA 4/2, a 320-token BPE tokenizer), wide enough for groups of 32, 64 and 128;
2. the peer has gptqmodel quantize it (GPTQModel.load + quantize on calibration text + save), so
   every file is written by the real tool, in each variant of VARIANTS;
3. the peer loads each with transformers' AutoModelForCausalLM (device_map="cpu", float32; the
   quantizer picks gptqmodel's CPU kernel) and saves last-position logits for PROMPTS, twice:
   - "native": the model as transformers runs it. In float32 gptqmodel's torch kernels
     dequantize to the scales' dtype (fp16) and cast, so each weight is rounded to fp16 once;
   - "exact": the same modules, dequantized by their own dequantizer with float64 scales (no
     fp16 rounding), multiplied in float32: the checkpoint's values, what llmx should match;
   and each linear's exact weights, and the unquantized model's logits (the quantization error,
   to show the comparison can tell models apart);
4. llmx's venv runs `llmx export DIR -o ART` (default flags; a refusal is recorded and the export
   retried with --precision fp32, as the refusal says) and computes logits two ways:
   - "level 0": prefill.onnx with MatMulNBits at accuracy_level 0 (float activations, as
     tests/test_prequantized.py does): the parity number;
   - "runtime": llmx's own engine (ort-cpu backend, the artifact as exported: accuracy_level 4,
     int8 activations), for what a user gets;
   and checks for a second rounding: every linear llmx reads (its reader's float32 values and,
   where kept, its MatMulNBits blocks dequantized) against the peer's exact weights, bit for bit.

Relative differences are max |a - b| / max(1, max |reference logit|) over all prompts (the bound
tests/test_prequantized.py uses). Prints a table, writes benchmarks/results/prequantized_parity_DATE.json.
Runs alone in ~7 minutes on 2 cores (gptqmodel's quantization is ~8-17 s a variant, most of it the
peer's start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> gptqmodel QuantizeConfig keyword arguments. The checkpoint's quantization_config is what
# gptqmodel writes for these (format "gptq" = v1 zero points, stored minus one).
VARIANTS: dict[str, dict] = {
    "gptq-sym-g32": dict(bits=4, group_size=32, sym=True, desc_act=False),
    "gptq-sym-g64": dict(bits=4, group_size=64, sym=True, desc_act=False),
    "gptq-sym-g128": dict(bits=4, group_size=128, sym=True, desc_act=False),
    "gptq-asym-g32": dict(bits=4, group_size=32, sym=False, desc_act=False),
    "gptq-asym-g128": dict(bits=4, group_size=128, sym=False, desc_act=False),
    "gptq-v2-asym-g32": dict(bits=4, group_size=32, sym=False, desc_act=False, format="gptq_v2"),
    "gptq-8bit-sym-g32": dict(bits=8, group_size=32, sym=True, desc_act=False),
    # act-order: groups scattered over the inputs (g_idx not k // group), which MatMulNBits cannot hold
    "gptq-desc_act-sym-g32": dict(bits=4, group_size=32, sym=True, desc_act=True),
    "gptq-desc_act-asym-g64": dict(bits=4, group_size=64, sym=False, desc_act=True),
    # AWQ's zero point is gptqmodel's sym=False ("zero_point": true in the config)
    "awq-gemm-g32": dict(quant_method="awq", format="gemm", bits=4, group_size=32, sym=False),
    "awq-gemm-g64": dict(quant_method="awq", format="gemm", bits=4, group_size=64, sym=False),
    "awq-gemm-g128": dict(quant_method="awq", format="gemm", bits=4, group_size=128, sym=False),
}

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [
    "def wrap(text, width=70, **kwargs):",
    "The quick brown fox jumps over the lazy dog.",
    "import json\nprint(json.dumps({'a': [1, 2, 3]}, indent=4))",
    "class TextWrapper:\n    def __init__(self, width",
]
PARITY = 1e-4  # the bound, relative to the largest reference logit


# ---- the peer's side (runs under --peer-python; imports neither llmx nor its tests) --------------

def _peer_env() -> dict:
    # gptqmodel sizes its CPU pool as (cores + 1) // 2 but asks for 2 loader workers out of it: on a
    # 2-core box that is refused ("requests 2 workers but parent 'cpu' only has 1") unless set.
    return {**os.environ, "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2"),
            "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _calibration() -> list[str]:
    """Text the tokenizer was trained on (json/textwrap sources, tests/checkpoints.py), in 64 chunks."""
    import inspect
    import json as json_module
    import textwrap

    text = inspect.getsource(json_module) + inspect.getsource(textwrap)
    return [text[i:i + 400] for i in range(0, 400 * 64, 400)]


def peer_quantize(src: Path, work: Path, variants: list[str]) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    torch.manual_seed(0)
    for name in variants:
        out = work / name
        status = {"variant": name}
        try:
            start = time.time()
            model = GPTQModel.load(str(src), QuantizeConfig(**VARIANTS[name]), device="cpu")
            model.quantize(_calibration(), batch_size=8)
            model.save(str(out))
            status.update(ok=True, seconds=round(time.time() - start, 1))
        except Exception as error:  # recorded per variant: one tool failure should not hide the rest
            status.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000])
        (work / f"{name}.quantize.json").write_text(json.dumps(status))


def _quantized_modules(model):
    """(name, module) for each gptqmodel quantized linear."""
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)]


def _exact_weight(module):
    """[out, in] float64: the module's own dequantizer, fed float64 scales (no fp16 product)."""
    import torch

    scales = module.scales
    try:
        module.scales = scales.to(torch.float64)
        if hasattr(module, "awq_weight_dequantize"):  # AWQ gemm: dequantize_gemm(qweight, qzeros, scales)
            w = module.awq_weight_dequantize(device="cpu", dtype=torch.float64)
        else:  # GPTQ: scales[g_idx] * (codes - zeros[g_idx]), v1 zero points already corrected at load
            w = module.dequantize_weight()
    finally:
        module.scales = scales
    assert w.dtype == torch.float64, w.dtype
    return w.T.contiguous()  # gptqmodel's is [in, out]


def _native_weight(module):
    """[out, in]: what the kernel multiplies by in float32 (its dequantizer in the scales' dtype)."""
    import torch

    if hasattr(module, "awq_weight_dequantize"):
        w = module.awq_weight_dequantize(device="cpu", dtype=torch.float32)
    else:
        w = module.dequantize_weight().to(torch.float32)
    return w.T.contiguous()


def peer_logits(checkpoint: Path, ids: list[list[int]], out: Path, quantized: bool) -> None:
    import numpy as np
    import torch
    import transformers

    status: dict = {"checkpoint": str(checkpoint)}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map="cpu",
                                                                  dtype=torch.float32).eval()
        arrays = {}
        with torch.no_grad():
            arrays["native"] = np.stack([model(torch.tensor([x])).logits[0, -1].float().numpy() for x in ids])
            if quantized:
                modules = _quantized_modules(model)
                status["kernel"] = sorted({type(m).__name__ for _, m in modules})
                status["quantized_linears"] = len(modules)
                fp16_rounding = 0.0
                for name, module in modules:
                    exact = _exact_weight(module)
                    native = _native_weight(module).to(torch.float64)
                    fp16_rounding = max(fp16_rounding, float((native - exact).abs().max() / exact.abs().max()))
                    arrays[f"w:{name}.weight"] = exact.numpy()
                    weight = exact.to(torch.float32)
                    bias = module.bias
                    # The same module, multiplying by its exact values instead of the fp16-rounded ones.
                    module.forward = (lambda x, w=weight, b=bias: torch.nn.functional.linear(x, w, b))
                status["native_weight_rel_rounding"] = fp16_rounding
                arrays["exact"] = np.stack([model(torch.tensor([x])).logits[0, -1].float().numpy() for x in ids])
        np.savez(out, **arrays)
        status["ok"] = True
    except Exception as error:
        import traceback

        status.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000],
                      traceback=traceback.format_exc()[-3000:])
    out.with_suffix(".json").write_text(json.dumps(status))


def run_peer(peer_python: str, work: Path, *args: str, timeout: int = 3600) -> None:
    command = [peer_python, str(Path(__file__).resolve()), "--peer", *args]
    # In ``work``: gptqmodel writes a logs/ folder into the current directory.
    done = subprocess.run(command, env=_peer_env(), capture_output=True, text=True, timeout=timeout, cwd=work)
    if done.returncode != 0:  # the per-variant JSON carries tool errors; this is the peer itself failing
        raise SystemExit(f"peer failed ({' '.join(command)}):\n{done.stderr[-4000:]}")


# ---- llmx's side ---------------------------------------------------------------------------------

def make_base(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_checkpoint

    if not (path / "model.safetensors").exists():
        make_checkpoint(path, "llama", **SHAPE)
    return path


def encode_prompts(base: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    # As llmx's tokenizer and transformers' both encode it (the post-processor adds <s>).
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in PROMPTS]


def llmx_export(checkpoint: Path, artifact: Path) -> dict:
    """`llmx export` with default flags; on a refusal, again with --precision fp32 as it advises."""
    llmx = str(Path(sys.executable).with_name("llmx"))
    record: dict = {}
    for flags in ([], ["--precision", "fp32"]):
        start = time.time()
        done = subprocess.run([llmx, "export", str(checkpoint), "-o", str(artifact), "--force", *flags],
                              capture_output=True, text=True)
        attempt = {"flags": flags, "rc": done.returncode, "seconds": round(time.time() - start, 1)}
        if done.returncode != 0:
            attempt["error"] = (done.stderr.strip().splitlines() or [""])[-1]
            record.setdefault("refused", attempt)
            continue
        manifest = json.loads((artifact / "llmx.json").read_text())
        precision = manifest["precision"]
        record.update(exported=attempt, prequantized=manifest.get("extras", {}).get("prequantized"),
                      precision={k: precision.get(k) for k in ("weights", "scheme", "symmetric", "block_size",
                                                               "accuracy_level")})
        return record
    return record


def llmx_logits(artifact: Path, ids: list[list[int]]) -> dict:
    import numpy as np
    import onnxruntime as ort

    from llmx.artifact.onnx_files import load_graph
    from llmx.runtime.engine import Engine

    model = load_graph(artifact / "prefill.onnx", with_weights=True)
    for node in model.graph.node:  # float activations: the kernel computes (q - z) * scale exactly
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = 0
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    level0 = []
    for x in ids:
        feeds = {"input_ids": np.array([x]), "attention_mask": np.ones((1, len(x)), np.int64),
                 "position_ids": np.arange(len(x))[None]}
        level0.append(session.run(["logits"], feeds)[0][0, -1])

    engine = Engine.load(artifact)
    runtime = []
    for x in ids:
        cache = engine.backend.new_cache(1, len(x) + 1)
        # copied: a one-prompt prefill runs the decode graph and returns a view of its bound output
        # buffer, which the next call overwrites
        runtime.append(engine.backend.prefill(cache, [0], [x])[0].copy())
    return {"level0": np.stack(level0), "runtime": np.stack(runtime)}


def second_rounding(checkpoint: Path, exact: dict) -> dict:
    """llmx's values for every quantized linear against the peer's exact ones, bit for bit: the reader
    (float32, what --precision fp32 uses) and, where kept, the MatMulNBits blocks."""
    import numpy as np

    from llmx.export.checkpoint import open_checkpoint
    from llmx.export.gguf_blocks import dequantize
    from llmx.export.prequantized import prequantized_checkpoint

    ckpt = prequantized_checkpoint(open_checkpoint(checkpoint))
    reader_worst, blocks_worst, blocks_checked, blocks_refused = 0.0, 0.0, 0, 0
    for name, w in exact.items():
        ours = ckpt.reader[name].numpy().astype(np.float64)
        reader_worst = max(reader_worst, float(np.abs(ours - w.astype(np.float32)).max()))
        if ckpt.stored_blocks is None:
            continue
        try:
            blocks = ckpt.stored_blocks([name])
        except Exception:  # refused for blocks, as the export says
            blocks_refused += 1
            continue
        if blocks is not None:
            blocks_checked += 1
            values = dequantize(blocks)
            if blocks.input_order is not None:  # act-order: columns sorted by group; back to input order
                values = values[:, np.argsort(blocks.input_order)]
            blocks_worst = max(blocks_worst, float(np.abs(values - w.astype(np.float32)).max()))
    return {"linears": len(exact), "reader_max_abs_diff": reader_worst, "blocks_checked": blocks_checked,
            "blocks_refused": blocks_refused, "blocks_max_abs_diff": blocks_worst}


def rel(a, b) -> float:
    import numpy as np

    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


def measure(name: str, work: Path, ids: list[list[int]], original, peer_python: str) -> dict:
    import numpy as np

    checkpoint, artifact = work / name, work / f"art-{name}"
    row: dict = {"variant": name, "gptqmodel_config": VARIANTS[name]}
    row["quantize"] = json.loads((work / f"{name}.quantize.json").read_text())
    if not row["quantize"]["ok"]:
        return row
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    row["quantization_config"] = {k: v for k, v in config.items() if k != "meta"}

    run_peer(peer_python, work, "logits", str(checkpoint), json.dumps(ids), str(work / f"{name}.npz"), "1")
    row["transformers"] = json.loads((work / f"{name}.json").read_text())
    row["llmx"] = llmx_export(checkpoint, artifact)
    if not row["transformers"]["ok"] or "exported" not in row["llmx"]:
        return row
    theirs = np.load(work / f"{name}.npz")
    ours = llmx_logits(artifact, ids)
    exact = {k.removeprefix("w:"): theirs[k] for k in theirs.files if k.startswith("w:")}
    row["second_rounding"] = second_rounding(checkpoint, exact)
    row["rel"] = {
        "level0_vs_exact": rel(ours["level0"], theirs["exact"]),
        "level0_vs_native": rel(ours["level0"], theirs["native"]),
        "runtime_vs_native": rel(ours["runtime"], theirs["native"]),
        "native_vs_exact": rel(theirs["native"], theirs["exact"]),
        "quantization_error": rel(theirs["exact"], original),  # vs the unquantized model
    }
    row["argmax_agree"] = {"level0_vs_native": int((ours["level0"].argmax(-1) == theirs["native"].argmax(-1)).sum()),
                           "runtime_vs_native": int((ours["runtime"].argmax(-1) == theirs["native"].argmax(-1)).sum()),
                           "of": len(ids)}
    row["parity"] = row["rel"]["level0_vs_exact"] <= PARITY
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'variant':24} {'llmx export':28} {'2nd round':9} {'L0/exact':>9} {'L0/native':>9} "
            f"{'rt/native':>9} {'nat/exact':>9} {'quant err':>9} parity")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r["quantize"]["ok"]:
            lines.append(f"{r['variant']:24} gptqmodel failed: {r['quantize']['error'][:90]}")
            continue
        if not r.get("transformers", {}).get("ok", False):
            lines.append(f"{r['variant']:24} transformers failed: {r.get('transformers', {}).get('error', '')[:90]}")
            continue
        x = r["llmx"]
        if "exported" not in x:
            lines.append(f"{r['variant']:24} llmx refused even fp32: {x.get('refused', {}).get('error', '')[:90]}")
            continue
        pq = x.get("prequantized") or {}
        how = (f"kept {pq.get('kept_in_their_blocks')}/{pq.get('quantized_linears')} blocks"
               if pq.get("kept_in_their_blocks") else f"fp32 ({pq.get('dequantized_to_float32')} deq.)")
        if "refused" in x:
            how = "refused; " + how
        s = r["second_rounding"]
        exact_values = s["reader_max_abs_diff"] == 0 and s["blocks_max_abs_diff"] == 0
        q = r["rel"]
        lines.append(f"{r['variant']:24} {how:28} {'none' if exact_values else 'YES':9} "
                     f"{q['level0_vs_exact']:9.1e} {q['level0_vs_native']:9.1e} {q['runtime_vs_native']:9.1e} "
                     f"{q['native_vs_exact']:9.1e} {q['quantization_error']:9.1e} {'ok' if r['parity'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":  # the peer's entry (see run_peer)
        role, *args = sys.argv[2:]
        if role == "quantize":
            peer_quantize(Path(args[0]), Path(args[1]), args[2].split(","))
        else:
            peer_logits(Path(args[0]), json.loads(args[1]), Path(args[2]), quantized=args[3] == "1")
        return

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", required=True, help="python of a venv with transformers, gptqmodel, optimum")
    parser.add_argument("--work", type=Path, default=Path("/tmp/prequantized-parity"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints, artifacts)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    import shutil

    import numpy as np

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    base = make_base(work / "base")
    ids = encode_prompts(base)
    versions = subprocess.run([args.peer_python, "-c", "import importlib.metadata as m; import json; print(json.dumps("
                               "{p: m.version(p) for p in ('torch', 'transformers', 'gptqmodel', 'optimum')}))"],
                              capture_output=True, text=True, check=True).stdout

    start = time.time()
    todo = [v for v in variants if not (work / f"{v}.quantize.json").exists()]
    if todo:
        run_peer(args.peer_python, work, "quantize", str(base), str(work), ",".join(todo))
    print(f"gptqmodel quantized {len(todo)} variants in {time.time() - start:.0f} s", flush=True)

    run_peer(args.peer_python, work, "logits", str(base), json.dumps(ids), str(work / "base.npz"), "0")
    original = np.load(work / "base.npz")["native"]
    rows = []
    for name in variants:
        rows.append(measure(name, work, ids, original, args.peer_python))
        print(f"  {name}: done", flush=True)

    print(table(rows))
    print("\nL0/exact: llmx (MatMulNBits at accuracy_level 0, float activations) vs transformers' model with the\n"
          "checkpoint's exact values; L0/native: vs transformers as it runs (gptqmodel's float32 path dequantizes\n"
          "in fp16: nat/exact); rt/native: llmx's engine as exported (accuracy_level 4, int8 activations);\n"
          "quant err: transformers' quantized model vs the unquantized one. Relative to max |logit|;\n"
          f"parity: L0/exact <= {PARITY:g}. 2nd round: llmx's values differ from the checkpoint's anywhere.")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H%M")
    result = HERE / "results" / f"prequantized_parity_{stamp}.json"
    result.parent.mkdir(exist_ok=True)
    result.write_text(json.dumps({"peer": json.loads(versions), "shape": SHAPE, "prompts": PROMPTS, "token_ids": ids,
                                  "parity_bound": PARITY, "rows": rows}, indent=2) + "\n")
    print(f"wrote {result.relative_to(ROOT)}")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
