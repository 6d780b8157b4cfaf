"""``kq serve``: an OpenAI-compatible server for a model whose experts stream through an arena.

It is ``mlx_lm.server`` (``/v1/chat/completions``, ``/v1/completions``, streamed or not, ``/v1/models``,
``/health``) serving the model :func:`kq_mlx.load` returned: one arena shared by every request. Requests
are queued and served one at a time (the arena's residency manager runs one pass at a time), so each gets
the text it would get alone. A request naming another model, or whose prompt and ``max_tokens`` do not fit
the context the memory was planned for, gets a JSON error; the server goes on with the next request.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

# Prompt caches mlx-lm's server keeps between requests (its default is 10: each is a whole KV cache).
PROMPT_CACHES = 2


@dataclass
class ServeDefaults:
    """What a request that does not say gets (mlx_lm.server's command-line defaults)."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def _server_arguments(model_id: str, host: str, port: int, defaults: ServeDefaults, kv_bytes: int):
    """The options mlx_lm.server's classes read, as its own command line would set them."""
    return argparse.Namespace(
        model=model_id, adapter_path=None, host=host, port=port, allowed_origins=["*"], draft_model=None,
        num_draft_tokens=3, trust_remote_code=False, log_level="WARNING", chat_template="",
        use_default_chat_template=False, temp=defaults.temp, top_p=defaults.top_p, top_k=defaults.top_k,
        min_p=defaults.min_p, max_tokens=defaults.max_tokens, chat_template_args={}, decode_concurrency=1,
        prompt_concurrency=1, prefill_step_size=2048, prompt_cache_size=PROMPT_CACHES,
        prompt_cache_bytes=kv_bytes * PROMPT_CACHES or None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=0, pipeline=False)


class ServerHandle:
    """A running server: :attr:`url`, :meth:`serve_forever` (until :meth:`close` or Ctrl-C), :meth:`close`."""

    def __init__(self, httpd, generator):
        self._httpd, self._generator = httpd, generator
        self._thread = None
        host, port = httpd.server_address[:2]
        self.url = f"http://{host}:{port}"

    def start(self) -> "ServerHandle":
        """Serves on a background thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kq-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self._httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Stops accepting, ends the generation thread and closes the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=30)
            self._thread = None
        self._generator.stop_and_join()
        self._httpd.server_close()


def make_server(model, tokenizer, *, model_id: str, host: str = "127.0.0.1", port: int = 8080,
                context: int | None = None, kv_bytes: int = 0,
                defaults: ServeDefaults | None = None) -> ServerHandle:
    """An mlx_lm.server serving ``model`` (from :func:`kq_mlx.load`) as ``model_id``; not started.

    Args:
        model, tokenizer: what :func:`kq_mlx.load` returned.
        model_id: the name ``/v1/models`` lists and requests give as ``model`` (``"default_model"`` and no model
            are taken too).
        host, port: where to listen (port 0: any free port, :attr:`ServerHandle.url` says which).
        context: the most tokens a request's prompt and ``max_tokens`` may take (None: no limit).
        kv_bytes: one KV cache of ``context`` tokens: the prompt caches kept between requests are bounded by it.
        defaults: sampling defaults for requests that give none.
    """
    from mlx_lm import server as mlx_server

    defaults = defaults or ServeDefaults()
    arguments = _server_arguments(model_id, host, port, defaults, kv_bytes)

    class Provider(mlx_server.ModelProvider):
        """The one loaded model, whatever the request names but another model."""

        def __init__(self):
            super().__init__(arguments)
            self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
            self.model_key, self.is_batchable = (model_id, None, None), False

        def load_default(self):
            return None

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            if model_path not in (None, "default_model", model_id):
                raise ValueError(f"model: {model_path!r} is not served here; this server serves {model_id!r}")
            if adapter_path is not None or draft_model_path not in (None, "default_model"):
                raise ValueError("adapters and draft models are not served by kq serve")
            return self.model, self.tokenizer

    class Generator(mlx_server.ResponseGenerator):
        """mlx-lm's generation loop, refusing a request longer than the planned context."""

        def _tokenize(self, tokenizer, request, args):
            tokenized = super()._tokenize(tokenizer, request, args)
            if context is not None and len(tokenized[0]) + args.max_tokens > context:
                raise ValueError(f"context: the prompt's {len(tokenized[0])} tokens and max_tokens {args.max_tokens} "
                                 f"exceed the {context} tokens this server was started for (kq serve --context)")
            return tokenized

    class Handler(mlx_server.APIHandler):
        def handle_models_request(self):
            import json
            import time

            self._set_completion_headers(200)
            self.end_headers()
            body = {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                                "owned_by": "kq"}]}
            self.wfile.write(json.dumps(body).encode())
            self.wfile.flush()

    generator = Generator(Provider(), mlx_server.LRUPromptCache(PROMPT_CACHES))
    try:
        httpd = _Server((host, port), lambda *a, **k: Handler(generator, *a, **k))
    except BaseException:
        generator.stop_and_join()
        raise
    return ServerHandle(httpd, generator)


class _Server(ThreadingHTTPServer):
    """A threading HTTP server that can end its open connections: :meth:`server_close` shuts every socket a
    handler still holds (a client's idle keep-alive connection), then joins the handlers' threads."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, *args, **kwargs):
        self._open, self._open_lock = set(), threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def server_close(self):
        import socket

        with self._open_lock:
            still_open = list(self._open)
        for request in still_open:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed by its handler meanwhile
                pass
        super().server_close()


def model_id_of(path) -> str:
    """The name a served model directory goes by: its directory's name."""
    return Path(path).resolve().name


def add_options(parser) -> None:
    """``kq serve``'s options (``func`` runs it)."""
    from kq.model_options import add_model_options

    add_model_options(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="the port (0: any free one, printed)")
    parser.add_argument("--max-tokens", type=int, default=512, help="a request's max_tokens where it gives none")
    parser.add_argument("--temp", type=float, default=0.0, help="a request's temperature where it gives none")
    parser.add_argument("--top-p", type=float, default=1.0, help="a request's top_p where it gives none")
    parser.add_argument("--top-k", type=int, default=0, help="a request's top_k where it gives none (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="a request's min_p where it gives none (0: off)")
    parser.add_argument("--stop-after", type=float, metavar="SECONDS",
                        help="stop serving after this many seconds (default: until Ctrl-C or SIGTERM)")
    parser.set_defaults(func=run)


def run(args) -> int:
    """Loads the model, serves it until Ctrl-C, SIGTERM or ``--stop-after``; prints where it listens."""
    import os
    import signal
    import sys

    from kq.model_options import load_model
    from kq_mlx.load import stream_of

    if args.stop_after is not None and not args.stop_after > 0:
        print("kq serve: --stop-after: must be a number of seconds > 0", file=sys.stderr)
        return 2
    loaded = load_model("serve", args)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    stream = stream_of(model)
    plan = stream.plan
    defaults = ServeDefaults(args.max_tokens, args.temp, args.top_p, args.top_k, args.min_p)
    try:
        handle = make_server(model, tokenizer, model_id=model_id_of(args.model), host=args.host, port=args.port,
                             context=args.context, kv_bytes=plan.kv_cache, defaults=defaults)
    except OSError as error:
        print(f"kq serve: --host/--port: cannot listen on {args.host}:{args.port} ({error})", file=sys.stderr)
        stream.close()
        return 2
    print(f"kq serve: {model_id_of(args.model)} at {handle.url}/v1 (OpenAI API); arena {plan.slots} of "
          f"{plan.num_experts} experts x {plan.num_layers} MoE layers, rule {stream.rule}; requests served one at a "
          f"time", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    handle.start()
    try:
        stop.wait(args.stop_after)
    except KeyboardInterrupt:
        pass
    handle.close()
    stream.close()
    print("kq serve: stopped", flush=True)
    sys.stderr.flush()
    # MLX can abort in its own teardown at exit after generating on a thread other than the main one (seen with
    # mlx-lm's own stream_generate on a thread, MLX 0.32.4): everything is closed, so leave without it.
    os._exit(0)
