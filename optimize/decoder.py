"""The fused graph builder moved to the core (llmx/fused/), so export can write fused graphs too."""

from llmx.fused.decoder import ACTIVATIONS, build_graph, check_supported  # noqa: F401
