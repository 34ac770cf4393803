"""User-facing errors. The CLI prints them as one line and exits non-zero; the server maps
them to 4xx JSON. Raise them where the cause is known, with a message a user can act on.

Exit codes of ``llmx`` (docs/generate.md lists them): 2 when the command line is wrong (an
unknown option, a value out of range, a prompt the model cannot take: InputError, and click's
usage errors); 1 when a well-formed command could not do its work (an artifact or checkpoint
missing or corrupt, a dependency not installed: every other LlmxError); 130 when interrupted
(Ctrl-C); 128 + the signal's number when ended by SIGTERM (143) or SIGHUP (129).
"""

from __future__ import annotations

import importlib
import signal


class LlmxError(Exception):
    """Base class: anything the user can fix (bad path, bad value, unsupported model)."""

    exit_code = 1


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (``timeout``, CI cancellation, ``docker stop``, a closed
    terminal). Raised in the main thread as Ctrl-C raises KeyboardInterrupt, and like it not an
    Exception, so the same ``with``/``finally`` blocks remove temp dirs and half-written artifacts."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


class InputError(LlmxError):
    """A value given by the user is out of range or malformed."""

    exit_code = 2


class CheckpointError(LlmxError):
    """The checkpoint directory is missing, incomplete, corrupt or unsupported."""


class ArtifactError(LlmxError):
    """The artifact directory is missing, incomplete or of another kind than expected."""


class MissingDependencyError(LlmxError):
    """An optional dependency (torch, onnx, tensorrt, CUDA) is not installed here."""

    def __init__(self, package: str, purpose: str, extra: str | None = None, hint: str | None = None):
        hint = hint or (f"pip install 'llmx[{extra}]'" if extra else f"pip install {package}")
        super().__init__(f"{purpose} needs {package}, which is not installed ({hint})")


def require(module: str, purpose: str, extra: str | None = None, hint: str | None = None, name: str | None = None):
    """Import an optional dependency (onnx, onnxruntime, tensorrt, polygraphy, ray, gguf, ...)
    where it is first needed: the one door for them, so a base install never loads them and a
    missing or broken one is a single error line that says what to install (``name``: how
    people spell the package, TensorRT for ``tensorrt``)."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == package:
            raise MissingDependencyError(name or package, purpose, extra, hint) from exc
        raise LlmxError(f"{purpose}: {name or package} is installed but cannot load ({exc})") from exc
    except (ImportError, OSError) as exc:  # a wheel present but its native (CUDA) libraries missing
        raise LlmxError(f"{purpose}: {name or package} is installed but cannot load ({exc}); is the CUDA driver installed?") from exc
