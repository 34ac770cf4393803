"""One module per CLI command; each exposes ``register(cli)``."""
