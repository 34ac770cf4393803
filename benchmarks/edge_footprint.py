"""Edge footprint: install size of `llmx[cpu,serve]` (no torch) and the server's memory.

    python benchmarks/edge_footprint.py --artifact ./emb [--artifact ./art] [--venv /tmp/edge-venv]

Creates (or reuses) a virtual environment with only the edge extras, reports its site-packages
size with the largest packages, then serves each artifact from it and reports the server's RSS
after loading and after 50 requests. Prints a markdown table; writes
benchmarks/results/edge_footprint.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def make_venv(venv: Path) -> Path:
    if not (venv / "bin" / "llmx").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                        f"{ROOT}[cpu,serve]"], check=True)
    return next((venv / "lib").glob("python3*/site-packages"))


def serve_and_measure(venv: Path, artifact: Path) -> dict:
    proc = subprocess.Popen([str(venv / "bin" / "llmx"), "serve", str(artifact), "--port", "0", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError("server exited")
            if m := re.search(r"on (http://\S+)/v1", line):
                url = m.group(1)
        rss_loaded = psutil.Process(proc.pid).memory_info().rss
        kind = json.loads((artifact / "llmx.json").read_text())["kind"]
        start = time.perf_counter()
        for i in range(50):
            if kind == "encoder":
                r = requests.post(url + "/v1/embeddings", json={"input": [f"sentence number {i}", "another one"]}, timeout=60)
            else:
                r = requests.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 16}, timeout=60)
            r.raise_for_status()
        elapsed = time.perf_counter() - start
        return {"artifact": artifact.name, "kind": kind, "artifact_mb": round(dir_size(artifact) / 2**20, 1),
                "rss_loaded_mb": round(rss_loaded / 2**20, 1),
                "rss_after_50_requests_mb": round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1),
                "requests_per_s": round(50 / elapsed, 1)}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", action="append", type=Path, required=True)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/llmx-edge-venv"))
    args = ap.parse_args()
    site = make_venv(args.venv)
    packages = sorted(((dir_size(p), p.name) for p in site.iterdir() if p.is_dir() and not p.name.endswith("-info")), reverse=True)
    total = dir_size(site)
    servers = [serve_and_measure(args.venv, a) for a in args.artifact]
    result = {"install": "pip install 'llmx[cpu,serve]'", "site_packages_mb": round(total / 2**20, 1),
              "largest": {name: round(size / 2**20, 1) for size, name in packages[:8]}, "servers": servers}
    print(f"edge install (`{result['install']}`): site-packages {result['site_packages_mb']} MiB; largest: "
          + ", ".join(f"{k} {v}" for k, v in result["largest"].items()))
    print("\n| artifact | kind | artifact MiB | server RSS loaded | RSS after 50 requests | requests/s |\n|---|---|---|---|---|---|")
    for s in servers:
        print(f"| {s['artifact']} | {s['kind']} | {s['artifact_mb']} | {s['rss_loaded_mb']} | {s['rss_after_50_requests_mb']} | {s['requests_per_s']} |")
    out = ROOT / "benchmarks" / "results" / "edge_footprint.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
