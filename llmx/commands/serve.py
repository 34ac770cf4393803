import logging
import signal
import socket
import threading

import click

from llmx.commands.options import backend_options, check_speculative_options, speculative_options
from llmx.errors import InputError, require


def _listen(host: str, port: int) -> socket.socket:
    """Bind here, not in werkzeug, whose bind errors exit the process with their own text."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def register(cli: click.Group) -> None:
    @cli.command("serve")
    @click.argument("artifact", type=click.Path(path_type=str))
    @click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0 exposes it to the network).")
    @click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
    @click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences decoded together.")
    @click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
                  help="Sequences that may wait for a batch row; past it requests get 429 with Retry-After.")
    @click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True,
                  help="Prompt tokens prefilled per scheduler turn while streams decode (4 chunks when none do); longer prompts are split so decoding never stalls.")
    @click.option("--api-key", envvar="LLMX_API_KEY", default=None,
                  help="Require 'Authorization: Bearer KEY' on /v1/* (or set LLMX_API_KEY).")
    @click.option("--model-name", default=None, help="Name clients pass as 'model' (default: the artifact directory's name).")
    @click.option("--max-body-kb", type=click.IntRange(min=1), default=1024, show_default=True, help="Largest request body accepted.")
    @click.option("--quiet", is_flag=True, help="No per-request access log lines.")
    @click.option("--spin/--no-spin", default=None,
                  help="Let ONNX Runtime's threads busy-wait while a graph runs (default: when each thread has a free "
                       "core at start-up; env LLMX_SPIN=0|1).")
    @click.option("--prefix-cache-mb", type=click.IntRange(min=0), default=None,
                  help="KV memory for reusing shared prompt prefixes across requests, reserved at start-up (0 turns "
                       "it off; default: the KV of --max-batch full-context sequences, at most 256).")
    @click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
                  help="On SIGTERM/SIGINT: seconds running requests may take to finish (queued ones end at once).")
    @click.option("--http-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
                  help="Seconds a connection may stay silent, and a request body may take to arrive.")
    @click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True,
                  help="Connections served at once (one thread each); more get 503 with Retry-After.")
    @click.option("--tool-call-format", type=click.Choice(["hermes", "llama3_json", "mistral", "generic"]), default=None,
                  help="How the model writes tool calls (default: read from its chat template; generic, "
                       "tools described in the system message, where the template has no tool format).")
    @click.option("--stream-interval-ms", type=click.FloatRange(min=0), default=10.0, show_default=True,
                  help="A stream's new text is sent at most this often (its first token and its end at once); "
                       "0 sends every token as it comes. Matters only for models stepping faster than it.")
    @click.option("--reasoning-format", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
                  help="auto: a thinking template's reasoning (<think>...</think> and the like) comes back as "
                       "reasoning_content, apart from content; none: left in content.")
    @speculative_options
    @backend_options
    @click.pass_context
    def serve(ctx, artifact, host, port, max_batch, max_queue, prefill_chunk, api_key, model_name, max_body_kb, quiet, spin,
              prefix_cache_mb, drain_timeout, http_timeout, max_connections, tool_call_format, stream_interval_ms,
              reasoning_format, speculative, draft, num_draft_tokens, backend, threads, low_memory):
        """Serve ARTIFACT over an OpenAI-compatible HTTP API.

        
        Decoder artifacts: /v1/completions, /v1/chat/completions (streaming or not).
        Encoder artifacts: /v1/embeddings. Both: /v1/models, /health, /ready, /metrics.

        \b
        One engine per process; requests are batched continuously. SIGTERM or Ctrl-C drains:
        new requests get 503, queued ones end with an error, running ones get --drain-timeout
        seconds, then the process exits 0. For many clients run the same app under gunicorn
        (docs/serving.md): gunicorn 'llmx.serve:create_app("./art")' -c deploy/gunicorn.conf.py
        """
        require("flask", "llmx serve", "serve")
        from llmx.serve import create_app
        from llmx.serve.http_server import make_server

        check_speculative_options(ctx, speculative)
        listener = _listen(host, port)  # a busy port fails before the model loads
        try:
            app = create_app(artifact, model_name=model_name, max_batch=max_batch, max_queue=max_queue,
                             prefill_chunk=prefill_chunk, api_key=api_key, max_body_bytes=max_body_kb * 1024,
                             backend=backend, threads=threads, spin=spin, low_memory=low_memory,
                             prefix_cache_mb=prefix_cache_mb, speculative=speculative, draft=draft,
                             num_draft_tokens=num_draft_tokens, tool_call_format=tool_call_format,
                             reasoning_format=reasoning_format, stream_interval_ms=stream_interval_ms)
            service = app.extensions["llmx"]
            service.wait_loaded()  # a model that cannot load is one error line here, not a 503 later
        except BaseException:
            listener.close()
            raise
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("werkzeug").setLevel(logging.WARNING if quiet else logging.INFO)
        server = make_server(host, port, app, timeout=http_timeout, max_connections=max_connections,
                             fd=listener.fileno())  # werkzeug dups the fd
        listener.close()
        auth = "API key required" if service.api_key else "no API key"
        click.echo(f"serving {service.model_name} on http://{host}:{server.socket.getsockname()[1]}/v1 "
                   f"(max batch {max_batch}, queue {max_queue}, {auth}); Ctrl-C stops", err=True)
        _drain_on_signals(server, service, drain_timeout)
        try:
            server.serve_forever()
        finally:
            server.server_close()
            if hasattr(service.worker, "stop"):  # the scheduler; the embedding batcher's thread is a daemon
                service.worker.stop()


def _drain_on_signals(server, service, timeout: float) -> None:
    """SIGTERM/SIGINT start a drain in a thread (serve_forever keeps answering, with 503s for new
    work); when it is over the server stops and ``llmx serve`` exits 0. A second signal ends at once."""

    def drain_then_stop():
        try:
            clean = service.drain(timeout)
            click.echo("drained" if clean else f"drain timeout ({timeout:g} s): running requests were ended", err=True)
        finally:
            server.shutdown()

    def on_signal(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        click.echo(f"{signal.Signals(signum).name}: draining (up to {timeout:g} s; again to stop now)", err=True)
        threading.Thread(target=drain_then_stop, name="llmx-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
