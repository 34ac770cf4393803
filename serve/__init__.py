"""Serve: an OpenAI-compatible HTTP server over the runtime. No torch."""
