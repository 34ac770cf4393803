"""Hugging Face Hub ids as checkpoints: ``llmx export ORG/NAME[@REVISION][:QUANT]``.

A CHECKPOINT that is not a local path but has a hub id's shape is fetched with
``huggingface_hub`` into its cache (``HF_HUB_CACHE``/``HF_HOME``, resumable, ``HF_TOKEN`` for
gated and private repos) and export reads the snapshot there. Only the files export reads are
fetched: a transformers repo's config, tokenizer and chat-template files, the sentence-transformers
configs and the one set of weights ``open_checkpoint`` would read (safetensors before
pytorch_model*.bin); a GGUF repo's one chosen .gguf file. Offline (``HF_HUB_OFFLINE=1``, or the
Hub unreachable) the cache alone answers.

The GGUF choice follows llama.cpp's ``-hf repo[:quant]`` (common/download.cpp,
``find_best_model``): the first file part of a model .gguf (not mmproj, imatrix, mtp-, eagle3-,
dflash-, dspark-) whose path matches ``QUANT[.-]`` case-insensitively; without QUANT, Q4_K_M,
then Q8_0, then the repo's one model file. Where llama.cpp would take the first of several
matches in listing order, llmx refuses and lists them; split files (``-00001-of-00003.gguf``) are
refused, as llmx reads single-file GGUFs.

``huggingface_hub`` is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmx.errors import CheckpointError, LlmxError

# ORG/NAME[@REVISION][:QUANT]: the Hub's repo names (letters, digits, - _ .), a revision (branch,
# tag, commit, refs/pr/N) and a quant tag (Q4_K_M, UD-Q4_K_XL, ...).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s:@]+))?"
                    r"(?::(?P<quant>[A-Za-z0-9][\w.-]*))?")

# What export reads besides the weights (export/tokenizer.py, export/encoder.py, open_checkpoint).
METADATA_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "modules.json", "sentence_bert_config.json",
)
# open_checkpoint's weights, safetensors first: (index or single file, read the index for its shards).
WEIGHTS = (("model.safetensors.index.json", True), ("model.safetensors", False),
           ("pytorch_model.bin.index.json", True), ("pytorch_model.bin", False))

# llama.cpp's -hf default when no quant is named, in order (common/download.cpp find_best_model).
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # gguf_filename_is_model
SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)  # get_gguf_split_info


class NoGGUFMatch(CheckpointError):
    """No .gguf file of the repo (or of the cache, offline) matches the quant asked for."""


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse_hub_id(src: str) -> HubId | None:
    """``src`` as ORG/NAME[@REVISION][:QUANT], or None if it has not that shape (a .gguf name is a file)."""
    m = HUB_ID.fullmatch(src)
    if m is None or ".." in m["repo"] or m["repo"].lower().endswith(".gguf"):
        return None
    return HubId(m["repo"], m["revision"], m["quant"])


def resolve_checkpoint(src: str, log: Callable[[str], None] = lambda msg: None) -> Path:
    """The local checkpoint ``src`` names: itself if it exists (or is no hub id: export then says it
    does not exist), else the Hugging Face cache's snapshot of the hub id (a directory, or the
    chosen .gguf file), fetched if need be. CheckpointError (one line) when it cannot."""
    path = Path(src)
    if path.exists():
        return path
    hub = parse_hub_id(src)
    if hub is None:
        return path
    try:
        return _resolve(hub, log)
    except LlmxError:
        raise
    except Exception as exc:  # whatever huggingface_hub or its HTTP client raised: one line, never a traceback
        # (a gated repo lists its files to anyone: its refusal comes with the download)
        raise (_hub_answer(hub, exc) or _one_line(hub, exc)) from exc


# -- choosing the files ------------------------------------------------------------------------


def is_gguf_model(path: str) -> bool:
    """A model's .gguf (not a projector, imatrix or draft model), as llama.cpp's gguf_filename_is_model."""
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(word in name for word in NOT_MODEL)


def gguf_split(path: str) -> tuple[str, int, int]:
    """(prefix, index, count) of a .gguf file name: ``x-00001-of-00003.gguf`` is part 1 of 3."""
    stem = path.removesuffix(".gguf")
    m = SPLIT.match(stem)
    return (m[1], int(m[2]), int(m[3])) if m else (stem, 1, 1)


def choose_gguf(files: list[str], quant: str | None, repo: str = "the repo") -> str:
    """The one .gguf among ``files`` (repo paths) that ``repo:quant`` names, by llama.cpp's rule;
    CheckpointError listing the candidates when none or several match, or when it is split."""
    models = [f for f in sorted(files) if is_gguf_model(f) and gguf_split(f)[1] == 1]  # a split file by its part 1
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + "[.-]", re.IGNORECASE)
        found = [f for f in models if pattern.search(f)]
        if len(found) > 1:
            raise CheckpointError(f"{repo}:{tag} matches {len(found)} GGUF files ({_short(found)}); "
                                  f"name one by more of its file name ({repo}:<longer tag>)")
        if found:
            return _refuse_split(found[0], f"{repo}:{tag}")
    if quant:
        raise NoGGUFMatch(f"{repo} has no GGUF file for quant {quant}; it has: {_short(models) or 'none'}")
    if len(models) == 1:
        return _refuse_split(models[0], repo)
    raise NoGGUFMatch(f"{repo} has {len(models)} GGUF files and none is Q4_K_M or Q8_0; name one as "
                      f"{repo}:QUANT ({_short(models)})")


def _refuse_split(chosen: str, name: str) -> str:
    """``chosen``, unless it is the first part of a split GGUF (llmx reads one file)."""
    count = gguf_split(chosen)[2]
    if count > 1:
        raise CheckpointError(f"{name} is split into {count} files ({chosen.rsplit('/', 1)[-1]}, ...); llmx reads "
                              "single-file GGUFs: join them with llama.cpp's `llama-gguf-split --merge "
                              f"{chosen.rsplit('/', 1)[-1]} merged.gguf` and export merged.gguf")
    return chosen


def _short(paths: list[str], most: int = 8) -> str:
    names = [p.rsplit("/", 1)[-1] for p in paths]
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def _has_weights(files: set[str]) -> bool:
    return any(name in files for name, _ in WEIGHTS)


def _transformers_files(files: set[str], fetch: Callable[[list[str]], Path]) -> tuple[Path, list[str]]:
    """Fetch what export reads of a transformers repo: metadata first, then the weights its index
    and modules.json name. (the snapshot folder, the files fetched)"""
    wanted = [f for f in METADATA_FILES if f in files]
    weights = next(((name, indexed) for name, indexed in WEIGHTS if name in files))
    if weights[1]:
        wanted.append(weights[0])
    folder = fetch(wanted)
    if weights[1]:
        try:
            extra = sorted(set(json.loads((folder / weights[0]).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{folder / weights[0]} is malformed or missing: {exc}") from exc
    else:
        extra = [weights[0]]
    if "modules.json" in files:  # sentence-transformers: each module's config (the Pooling one is read)
        try:
            modules = json.loads((folder / "modules.json").read_text())
            extra += [f"{m['path']}/config.json" for m in modules
                      if isinstance(m, dict) and m.get("path") and f"{m['path']}/config.json" in files]
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{folder / 'modules.json'} is malformed or missing: {exc}") from exc
    fetch(extra)
    return folder, wanted + extra


# -- fetching --------------------------------------------------------------------------------


def _resolve(hub: HubId, log: Callable[[str], None]) -> Path:
    from huggingface_hub import constants

    online, reason = not constants.HF_HUB_OFFLINE, "offline (HF_HUB_OFFLINE=1)"
    if online:
        log(f"looking up {hub} on the Hugging Face Hub")
        try:
            files = _remote_listing(hub)
        except Exception as exc:  # unreachable, or the Hub's own error: the cache may still answer
            if (error := _hub_answer(hub, exc)) is not None:
                raise error from exc
            online, reason = False, f"the Hub is unreachable ({_first_line(exc)})"
    if online:
        from huggingface_hub import snapshot_download

        snapshot: list[Path] = []

        def fetch(names: list[str]) -> Path:
            # The first call names the revision (the cache records refs/<branch or tag> for offline
            # use later); the next ones its commit, the folder's name, so all come from one commit.
            if names:
                revision = snapshot[0].name if snapshot else hub.revision
                snapshot[:] = [Path(snapshot_download(hub.repo, revision=revision, allow_patterns=names))]
            return snapshot[0]

        where = "into the Hugging Face cache"
    else:
        folder = _cached_snapshot(hub, reason)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

        def fetch(names: list[str]) -> Path:
            return folder

        where = f"from the Hugging Face cache, {reason}"
    chosen, result = _choose(hub, set(files), fetch, online, reason)
    folder = fetch([])
    missing = [f for f in chosen if not (folder / f).is_file()]
    if missing:
        what = (f"{_short(missing)} did not arrive in" if online else
                f"{reason} and {_short(missing)} {'is' if len(missing) == 1 else 'are'} not in")
        raise CheckpointError(f"cannot download {hub}: {what} the Hugging Face cache "
                              f"(HF_HUB_CACHE={constants.HF_HUB_CACHE})")
    log(f"fetched {hub.repo}@{hub.revision or 'main'} (commit {folder.name[:12]}) {where}: {_short(chosen, 12)}")
    return result


def _choose(hub: HubId, files: set[str], fetch, online: bool, reason: str) -> tuple[list[str], Path]:
    """(the files export needs, the path to export: the snapshot folder or the .gguf in it)."""
    from huggingface_hub import constants

    if not hub.quant and "config.json" in files and _has_weights(files):
        folder, chosen = _transformers_files(files, fetch)
        return chosen, folder
    if hub.quant or any(is_gguf_model(f) for f in files):
        try:
            name = choose_gguf(sorted(files), hub.quant, hub.repo)
        except NoGGUFMatch as exc:
            if online:
                raise
            cached = [f for f in sorted(files) if is_gguf_model(f)]
            raise CheckpointError(f"cannot download {hub}: {reason} and not in the Hugging Face cache "
                                  f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}; cached GGUF files: "
                                  f"{_short(cached) or 'none'})") from exc
        return [name], fetch([name]) / name
    if not online:
        raise CheckpointError(f"cannot download {hub}: {reason} and not in the Hugging Face cache "
                              f"(HF_HUB_CACHE={constants.HF_HUB_CACHE})")
    raise CheckpointError(f"{hub.repo} has neither config.json with weights (model.safetensors, pytorch_model.bin) "
                          "nor a .gguf file: not a checkpoint llmx exports")


def _remote_listing(hub: HubId) -> list[str]:
    """The repo's files at the revision (one API call)."""
    from huggingface_hub import HfApi

    return [s.rfilename for s in HfApi().model_info(hub.repo, revision=hub.revision).siblings or []]


def _cached_snapshot(hub: HubId, reason: str) -> Path:
    """The cache's snapshot folder for the revision (a branch or tag through refs/, or a commit)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:  # allow_patterns=[]: locate the folder only; which files it holds is checked after choosing them
        folder = Path(snapshot_download(hub.repo, revision=hub.revision, local_files_only=True, allow_patterns=[]))
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise CheckpointError(f"cannot download {hub}: {reason} and not in the Hugging Face cache "
                              f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}); nor is it a local path") from exc
    return folder


def _hub_answer(hub: HubId, exc: Exception) -> CheckpointError | None:
    """The Hub's definite answer (not found, gated, private) as one line; None when it did not
    answer (offline, unreachable, a server error), where the cache may still serve."""
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    token = "set HF_TOKEN (or run `hf auth login`) to a token with access"
    if isinstance(exc, GatedRepoError):
        return CheckpointError(f"{hub.repo} is gated: accept its licence on https://huggingface.co/{hub.repo} "
                               f"and {token}")
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(f"{hub.repo} has no revision {hub.revision!r} on the Hugging Face Hub")
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(f"{hub.repo} is neither a local path nor a repo on the Hugging Face Hub "
                               f"(if it is private, {token})")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return CheckpointError(f"the Hugging Face Hub refused {hub.repo} ({status}): {token}, and accept its "
                                   "licence on its page if it is gated")
        return None if status is None or status >= 500 else CheckpointError(
            f"cannot download {hub.repo}: the Hugging Face Hub answered {status} ({_first_line(exc)})")
    return None if _is_network_error(exc) else _one_line(hub, exc)


def _is_network_error(exc: Exception) -> bool:
    """Offline mode, a refused connection, DNS, a timeout (requests' and httpx's errors alike), or
    huggingface_hub's "not in the cache and the Hub cannot be asked"."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (ConnectionError, TimeoutError)) or bool(names & {
        "ConnectionError", "Timeout", "TransportError", "TimeoutException", "NetworkError", "ProxyError",
        "LocalEntryNotFoundError"})


def _one_line(hub: HubId, exc: Exception) -> CheckpointError:
    from huggingface_hub import constants

    if _is_network_error(exc):
        return CheckpointError(f"cannot download {hub}: the Hub is unreachable and it is not (all) in the Hugging "
                               f"Face cache (HF_HUB_CACHE={constants.HF_HUB_CACHE}): {_first_line(exc)}")
    return CheckpointError(f"cannot download {hub}: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
