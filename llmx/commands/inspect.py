import json
import re
import textwrap
from pathlib import Path

import click

from llmx.artifact.paths import artifact_file
from llmx.errors import ArtifactError
from llmx.artifact.manifest import MANIFEST_NAME, load_manifest, verify_checksums


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _compact(names: list[str]) -> list[str]:
    """Names that differ only in their layer number, once each: model.layers.{0-2,5}.mlp.up_proj.weight."""
    layers: dict[str, list[str]] = {}
    for name in names:
        match = re.search(r"(?<=\.)\d+(?=\.)", name)
        key = name if match is None else name[: match.start()] + "{}" + name[match.end() :]
        layers.setdefault(key, []).append(match.group() if match else "")
    return [key.replace("{}", found[0] if len(found) == 1 else _ranges(found)) for key, found in layers.items()]


def _ranges(numbers: list[str]) -> str:
    ints, spans = sorted(set(map(int, numbers))), []
    for n in ints:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return "{" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) + "}"


def _echo_list(label: str, items: list[str]) -> None:
    click.echo(textwrap.fill(", ".join(items), width=100, break_long_words=False, break_on_hyphens=False,
                             initial_indent=f"  {label}: ", subsequent_indent="    "))


def register(cli: click.Group) -> None:
    @cli.command("inspect")
    @click.argument("artifact", type=click.Path(path_type=Path))
    @click.option("--json", "as_json", is_flag=True, help="Print the manifest and file sizes as JSON.")
    @click.option("--check", is_flag=True, help="Verify every file's sha256 against the manifest.")
    def inspect(artifact: Path, as_json: bool, check: bool) -> None:
        """Show what an artifact holds: model, graphs and their IO, files, precision, lineage.

        ARTIFACT is the artifact directory or its manifest (ART/llmx.json)."""
        if artifact.name == MANIFEST_NAME and artifact.is_file():
            artifact = artifact.parent
        manifest = load_manifest(artifact)
        paths = {rel: artifact_file(artifact, rel, "checksums key") for rel in manifest.checksums}
        sizes = {rel: path.stat().st_size for rel, path in paths.items() if path.is_file()}
        bad = verify_checksums(artifact, manifest) if check else []
        if as_json:
            data = json.loads(manifest.to_json())
            data["file_sizes"] = sizes
            if check:
                data["checksum_failures"] = bad
            click.echo(json.dumps(data, indent=2))
        else:
            m = manifest.model
            click.echo(f"{artifact}: {manifest.kind}, {m.family}, schema {manifest.schema_version}, llmx {manifest.llmx_version}")
            dims = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings")
            click.echo("  model: " + ", ".join(f"{k}={getattr(m, k)}" for k in dims))
            precision = manifest.precision.to_dict()
            click.echo("  precision: " + ", ".join(f"{k}={v}" for k, v in precision.items()
                                                   if v is not None and k not in ("data", "fallback")))
            if manifest.precision.fallback:
                # A searched w4 artifact can keep dozens of MatMuls back; one per layer pattern reads.
                names = manifest.precision.fallback
                _echo_list(f"fallback ({len(names)} MatMuls in higher precision)", _compact(names))
            if manifest.kv is not None:
                click.echo(f"  kv cache: {manifest.kv.dtype}, {manifest.kv.num_layers} layers x {manifest.kv.num_kv_heads} heads x {manifest.kv.head_dim}")
            for name, g in manifest.graphs.items():
                click.echo(f"  graph {name}: {g.file} (opset {g.opset}, {g.ops} ops)")
                for kind, tensors in (("in", g.inputs), ("out", g.outputs)):
                    shown = tensors if len(tensors) <= 6 else [*tensors[:4], None, tensors[-1]]
                    for t in shown:
                        click.echo("      ..." if t is None else f"    {kind:3} {t.name}: {t.dtype}[{', '.join(map(str, t.shape))}]")
            _echo_list("files", [f"{rel} {_size(n)}" for rel, n in sizes.items()])
            if manifest.tensorrt is not None:
                trt, limits = manifest.tensorrt, manifest.tensorrt.limits
                click.echo(f"  tensorrt {trt.version}: {trt.precision} {trt.layout} engines ({', '.join(e.file for e in trt.engines.values())}) "
                           f"for {trt.device.name}, max batch {limits.max_batch}, max seq {limits.max_seq_len}")
            click.echo("  lineage: " + " -> ".join(s.stage for s in manifest.lineage))
        if bad:
            raise ArtifactError(f"checksum mismatch in {len(bad)} file(s): {', '.join(bad)}")
        if check and not as_json:
            click.echo(f"  checksums: {len(manifest.checksums)} files OK")
