"""`samctl serve`: an OpenAI-compatible HTTP server with Predicted Outputs (samctl/server.py).

This module turns flags into Sessions (one per --sam store, all on one engine) and runs the app
under uvicorn; fastapi and uvicorn (the `serve` extra) are imported only here, when it runs.
"""
from __future__ import annotations

import errno
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from samctl.config import SessionConfig
from samctl.index.errors import UserError
from samctl.index.store import missing_store
from samctl.options import MAX_BATCH_SIZE, check_count, session_options
from samctl.plan import EMBEDDED_MODEL_ID, plan


def _stores(specs: tuple[str, ...]) -> dict[str, str]:
    """--sam NAME=STORE (or STORE, named after its file) -> {name: path}, in the order given."""
    stores: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not name or not path:
            raise UserError(f"--sam {spec!r}: give NAME=STORE, e.g. --sam docs=docs.sam")
        if name in stores:
            raise UserError(f"--sam names the store {name!r} twice: give each store its own NAME")
        if not Path(path).exists():
            raise missing_store(path)
        stores[name] = path
    return stores


@click.command("serve")
@session_options(exclude=("chat",), raw=("store",),
                 store={"multiple": True, "metavar": "NAME=STORE", "type": str, "default": (), "show_default": False,
                        "help": "A datastore the requests may name (`store` in the body); repeat for several. The "
                                "first is the default."},
                 method={"help": "Default drafting method (a request may name another in `method`)."},
                 max_new_tokens={"default": 1024, "help": "Longest answer when a request sets no max_tokens."})
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any free one).")
@click.option("--api-key", metavar="KEY", envvar="SAMCTL_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every request but /health (also $SAMCTL_API_KEY).")
@click.option("--served-model-name", metavar="NAME", help="The model id clients send (default: --model as given; 'default' for the embedded model).")
@click.option("--batch-size", type=int, default=None,
              help="Requests generating at once on the batched engine (default: 8 on a CPU, 32 on a GPU); 1: one "
                   "at a time. SDSAT's methods (they draft with the target's own forward) run one request at a time "
                   "between batch steps.")
def serve(config: SessionConfig, store: tuple[str, ...], host: str, port: int, api_key: str | None,
          served_model_name: str | None, batch_size: int | None) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with Predicted Outputs.

    POST /v1/chat/completions and /v1/completions (streaming too), GET /v1/models, /health (503
    until the engine can serve: its batched verify cost is read from the cache or measured, in
    seconds, once per model and batch size) and /metrics. A request's `prediction` is drafted
    from; usage reports accepted and rejected prediction tokens. Up to --batch-size requests
    generate at once on the batched engine, each with its own max_tokens, sampling, stop strings
    and prediction; a request that arrives takes a free slot at the next step. Sampling flags are
    the defaults of requests that set none. SIGTERM finishes the requests in flight, then exits
    (during start-up at once, refusing the requests that wait).

    \b
    samctl serve --model ./SmolLM2-135M-Instruct --sam docs=docs.sam --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "./SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    # usage errors first: they load neither torch nor the server
    check_count("--batch-size", batch_size, MAX_BATCH_SIZE)
    stores = _stores(store)
    names = list(stores) or [None]
    config = replace(config, store=stores.get(names[0]))
    plan(config)  # a missing draft model or head is refused now, not after torch loads (seconds)
    try:
        import uvicorn

        from samctl.server import create_app
    except ImportError as err:
        raise UserError(f"samctl serve needs the `serve` extra ({err.name} is missing): "
                        "pip install 'samctl[serve]'") from err
    listener = _listen(host, port)  # a taken port is refused now, not after torch and the model load (seconds)
    port = listener.getsockname()[1]  # --port 0: the one the system chose
    from samctl.scheduler import Sessions
    from samctl.session import Session, load_store

    first = Session(config)
    by_store: dict[str | None, Session] = {names[0]: first}
    for name in names[1:]:
        config = replace(config, store=stores[name], quiet=True)
        by_store[name] = Session.over(first.engine, config, load_store(stores[name], first.engine, config.occurrence))
    sessions = Sessions(by_store, model_name=served_model_name or config.model or EMBEDDED_MODEL_ID)
    batch_size = batch_size or (8 if first.engine.device.type == "cpu" else 32)
    app = create_app(sessions, batch_size=batch_size, api_key=api_key)
    if not first.config.quiet:
        at_once = "one request at a time" if batch_size == 1 else f"up to {batch_size} requests at once"
        click.echo(f"samctl: serving {sessions.model_name} (method {config.method}, stores: "
                   f"{', '.join(sessions.store_names) or 'none'}) on http://{host}:{port}/v1, "
                   f"{at_once}", err=True)
    _server(app, uvicorn.Config(app, host=host, port=port,
                                log_level="warning" if first.config.quiet else "info")).run(sockets=[listener])


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before anything loads; uvicorn serves on it, so no
    other process can take the port in between (a client that connects meanwhile waits in the
    backlog). Bound as uvicorn binds (IPv6 for an address with a colon, SO_REUSEADDR)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen()
    except OSError as err:
        listener.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} is in use: pick another with --port") from err
        raise UserError(f"cannot listen on {host}:{port} ({err.strerror or err}): check --host and --port") from err
    return listener


def _server(app: Any, config: Any) -> Any:
    """uvicorn's server, whose SIGTERM / Ctrl-C also stops the engine's start-up (uvicorn waits
    for open requests before the app's shutdown runs, and a request waiting for a verify-cost
    measurement would hold it until the measurement ended)."""
    import uvicorn

    from samctl.server import stop_starting

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stop_starting(app)
            super().handle_exit(sig, frame)

    return Server(config)
