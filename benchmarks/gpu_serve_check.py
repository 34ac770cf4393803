"""`llmx serve --backend ort-cuda` on a lent GPU against `--backend ort-cpu`: the same completions.

    python3 benchmarks/gpu_serve_check.py ARTIFACT --out results.json

Starts both servers on ARTIFACT (the demo model's export, say), asks each the same greedy
completions (plain, streamed, and 8 at once), and records whether the texts agree, the
time each took and what /metrics and /health say. Run by benchmarks/gpu_run.sh serve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["def parse_args(", "import os\nimport sys\n\n", "class Config:\n    def __init__(self", "for i in range(",
           "# Read the file and", "with open(path) as f:", "return sorted(", "if __name__ == '__main__':"]


def post(url: str, body: dict, stream: bool = False) -> str:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": stream}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["text"]
        text = ""
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        return text


def serve(artifact: str, backend: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "from llmx.cli import main; main()", "serve", artifact, "--backend",
                             backend, "--port", str(port), "--max-batch", "8"],
                            stderr=open(Path(os.environ.get("OUT", "/tmp")) / f"server-{backend}.log", "w"))
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{backend} server did not become ready")


def run(artifact: str, backend: str, port: int) -> dict:
    proc = serve(artifact, backend, port)
    url = f"http://127.0.0.1:{port}"
    try:
        body = dict(max_tokens=48, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        plain = [post(url, {**body, "prompt": p}) for p in PROMPTS]
        streamed = [post(url, {**body, "prompt": p}, stream=True) for p in PROMPTS]
        sequential_s = time.perf_counter() - t
        t = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: post(url, {**body, "prompt": p}), PROMPTS))
        concurrent_s = time.perf_counter() - t
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = [line for line in r.read().decode().splitlines() if line.startswith("llmx_") and "_total" in line]
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.load(r)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"backend": backend, "plain": plain, "streamed": streamed, "together": together,
            "sequential_s": round(sequential_s, 2), "concurrent_8_s": round(concurrent_s, 2),
            "metrics": metrics[:12], "health": health}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cpu, cuda = run(args.artifact, "ort-cpu", 8031), run(args.artifact, "ort-cuda", 8032)
    same = {k: [a == b for a, b in zip(cpu[k], cuda[k])] for k in ("plain", "streamed", "together")}
    record = {"same_text_as_cpu": same, "cpu": cpu, "cuda": cuda,
              "streamed_equals_plain": [a == b for a, b in zip(cuda["plain"], cuda["streamed"])]}
    json.dump(record, open(args.out, "w"), indent=1)
    for k, v in same.items():
        print(f"{k:9s} ort-cuda == ort-cpu: {sum(v)}/{len(v)}")
    print(f"ort-cuda streamed == plain: {sum(record['streamed_equals_plain'])}/{len(PROMPTS)}")
    print(f"seconds, 16 sequential / 8 at once: cpu {cpu['sequential_s']} / {cpu['concurrent_8_s']}, "
          f"cuda {cuda['sequential_s']} / {cuda['concurrent_8_s']}; health {cuda['health']}")


if __name__ == "__main__":
    main()
