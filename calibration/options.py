"""What ``llmx calibrate`` is asked to do: the scheme, its recipe, the search, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from llmx.artifact.manifest import Precision
from llmx.calibration.search import SearchSpace
from llmx.calibration.static import METHODS
from llmx.calibration.weight_only import check_block_size
from llmx.errors import InputError
from llmx.quant_blocks import UNSEARCHED_BLOCK_SIZE, weight_only_precision

SCHEMES = ("w8a8", "w8", "w4")
KV_CACHE_DTYPES = ("float32", "int8")


@dataclass
class CalibrationOptions:
    scheme: str | None  # None: weights untouched (only an int8 KV cache)
    method: str = "percentile"  # w8a8: how activation ranges are chosen (best of the three on real text)
    smoothquant: float | None = None  # w8a8: SmoothQuant alpha (None: off)
    per_channel: bool = True  # w8a8: weight scales per output channel (else per tensor)
    block_size: int | None = None  # w8/w4: input channels per scale; None: searched, else UNSEARCHED_BLOCK_SIZE
    symmetric: bool = True  # w8/w4: no zero points
    samples: int = 32  # calibration windows
    seq_len: int = 256  # tokens per window
    eval_samples: int = 16  # evaluation windows
    threads: int | None = None
    kv_cache: str = "float32"  # "int8": static per-channel int8 KV cache (kv_int8.py)
    awq: bool = False  # w4/w8: AWQ-style activation-aware scales before rounding (awq.py)
    fallback: tuple[str, ...] = ()  # weight names of MatMuls kept in higher precision (see weight_only/static)
    search: SearchSpace | None = None  # None: exactly this recipe; else search.py picks one meeting a target
    # Run the fp32 graphs a layer at a time (layered.py): None decides by whether they fit in memory.
    layered: bool | None = None

    def validate(self) -> "CalibrationOptions":
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise InputError(f"--kv-cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache!r}")
        if self.scheme is None and self.kv_cache == "float32":
            raise InputError(f"--scheme is required ({', '.join(SCHEMES)}) unless --kv-cache int8 is the only change")
        if self.scheme is None:
            return self
        if self.layered and self.scheme not in ("w8", "w4"):
            raise InputError("layer-by-layer calibration applies to weight-only schemes (w8, w4): w8a8's range "
                             "calibrators run the whole fp32 graph")
        if self.layered and self.kv_cache == "int8":
            raise InputError("--kv-cache int8 calibrates on the whole fp32 prefill graph: not layer by layer")
        if self.scheme not in SCHEMES:
            raise InputError(f"scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.smoothquant is not None and not 0.0 <= self.smoothquant <= 1.0:
            raise InputError(f"--smoothquant alpha must be in [0, 1], got {self.smoothquant}")
        if self.search is not None and self.search.target is not None and not 0 < self.search.target < 10:
            raise InputError(f"--target must be a perplexity ratio (e.g. 1.02) or a cosine floor (e.g. 0.99), "
                             f"got {self.search.target}")
        if self.awq and self.scheme == "w8a8":
            raise InputError("--awq applies to weight-only schemes (w8, w4); w8a8 has SmoothQuant")
        if self.smoothquant is not None and self.awq:
            raise InputError("--smoothquant and --awq both rescale channels before rounding; give one of them")
        if self.scheme != "w8a8" and self.block_size is not None:
            check_block_size(self.block_size)
        return self

    @property
    def label(self) -> str:
        """What the report calls the quantized artifact: the scheme, plus "kv8" for an int8 cache."""
        parts = [self.scheme] if self.scheme else []
        return "+".join(parts + (["kv8"] if self.kv_cache == "int8" else []))

    def precision(self) -> Precision:
        """The manifest's ``precision`` section for this scheme."""
        # "fallback": the MatMuls (weight names) kept in fp32 (w8a8, w8) or at 8 bits (w4).
        if self.scheme == "w8a8":
            return Precision(weights="int8", activations="int8", scheme=self.scheme, method=self.method,
                             smoothquant=self.smoothquant, per_channel=self.per_channel, symmetric=True,
                             fallback=list(self.fallback))
        return weight_only_precision(self.scheme, self.block_size, self.symmetric, self.awq, self.fallback,
                                     self.smoothquant)
