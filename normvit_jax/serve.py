"""An HTTP service for an exported artifact (``python -m normvit_jax.export --format=...``).

    python -m normvit_jax.serve --artifact=model.onnx [--port=8000] [--host=127.0.0.1]
    curl -s --data-binary @cat.jpg 'http://127.0.0.1:8000/predict?top_k=3'

``POST /predict[?top_k=K]``: one image as the raw body or as the multipart field ``file`` (any
size and format PIL reads; cropped and resized as the run's evaluation, the artifact's
metadata); answers ``{"predictions": [{"label", "index", "probability"}, ...]}``, most
probable first. ``GET /healthz``: 200 once the model is loaded (it is loaded and run once
before the port opens), 503 once a SIGTERM or Ctrl-C is stopping it (``_server_class``: the
connections made before the signal are still answered). Bad input is a 4xx with a one-line JSON ``error`` (docs/deploy.md).
The runtime is the artifact's own: ONNX Runtime, TensorFlow or JAX (Starlette on uvicorn).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
from typing import Any, Sequence

import numpy as np

DEFAULT_MAX_BYTES = 20 * 2**20      # a 20 MiB upload: any camera's JPEG
DEFAULT_MAX_PIXELS = 50_000_000     # 50 megapixels decoded (~150 MB of RGB)
DEFAULT_TOP_K = 5
# On SIGTERM or Ctrl-C the requests in flight get this long to finish; then their connections are
# dropped. Without a bound, one client that stopped sending its body kept the service alive
# forever (docker stop, systemd and Kubernetes then kill it).
SHUTDOWN_GRACE_S = 5
# Within it: the connections queued in the kernel at the signal are taken (the port then closes)
# within SHUTDOWN_ACCEPT_S at most, even under a steady stream of new ones; a connection taken
# without its request yet gets until SHUTDOWN_REQUEST_S for its request to arrive; the requests
# read get the rest of the grace (at least SHUTDOWN_GRACE_S - SHUTDOWN_REQUEST_S) to finish.
SHUTDOWN_ACCEPT_S = 1
SHUTDOWN_REQUEST_S = 2


class Model:
    """The artifact, its metadata and class names; ``predict(bytes, top_k)`` -> predictions."""

    def __init__(self, path: str, threads: int = 0, max_pixels: int = DEFAULT_MAX_PIXELS):
        from normvit_jax.deploy import artifact, runtimes
        self.meta, self.names = artifact.read_metadata(path)
        self.path, self.fmt = path, self.meta["format"]
        self.max_pixels = max_pixels
        self.run = runtimes.open_artifact(path, self.fmt, self.meta["input"]["shape"][0], threads)
        from normvit_jax.data import images
        from normvit_jax.deploy import preprocess
        # compiles / warms up the decoder and the model before serving (--max_pixels is for
        # the requests: a tiny one must not refuse the warm-up's image)
        x = preprocess.to_input(images.encode_png(np.zeros((2, 2, 3), np.uint8)),
                                self.meta["preprocess"], 2**62)
        self.run(x[None])

    def top_k(self, raw: str | None) -> int:
        from normvit_jax.deploy.preprocess import InputError
        n = len(self.names)
        if raw is None:
            return min(DEFAULT_TOP_K, n)
        # plain decimal digits only: int() also takes '1_0', ' 3', '+3' and other scripts' digits;
        # and few of them: int() of over 4300 digits raises ValueError (a 500)
        digits = raw.lstrip("0") or "0"
        k = int(digits) if raw.isascii() and raw.isdigit() and len(digits) <= 9 else 0
        if not 1 <= k <= n:
            shown = repr(raw) if len(raw) <= 20 else f"{raw[:20]!r}... ({len(raw):,} characters)"
            raise InputError(400, f"top_k={shown}: must be an integer from 1 to {n} (the number "
                                  "of classes), in decimal digits")
        return k

    def predict(self, data: bytes, k: int) -> dict:
        from normvit_jax.deploy import preprocess
        x = preprocess.to_input(data, self.meta["preprocess"], self.max_pixels)
        probs, _ = self.run(x[None])
        p = np.asarray(probs[0], np.float64)
        order = np.argsort(-p, kind="stable")[:k]
        return {"predictions": [{"label": self.names[i], "index": int(i),
                                 "probability": float(p[i])} for i in order]}


async def _read_limited(request: Any, limit: int) -> bytes:
    from normvit_jax.deploy.preprocess import InputError
    too_big = InputError(413, f"request body over the limit of {limit:,} bytes (--max_bytes)")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _image_bytes(request: Any, limit: int) -> bytes:
    """The raw body, or the multipart field ``file`` of a multipart/form-data body."""
    from starlette.requests import Request
    from normvit_jax.deploy.preprocess import InputError
    body = await _read_limited(request, limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return body
    from starlette.formparsers import parse_options_header  # python-multipart's, as starlette
    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary", b"")
    if boundary and b"--" + boundary + b"--" not in body:  # the parser takes a cut body silently
        raise InputError(400, "malformed multipart body: it ends before its closing boundary "
                              f"(--{boundary.decode('latin-1')}--): truncated?")
    sent = False

    async def replay() -> dict:  # the body already read, for starlette's form parser
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=16,
                                                        max_part_size=limit)
    except Exception as e:  # noqa: BLE001  python-multipart's errors for malformed bodies
        why = str(getattr(e, "detail", None) or e)  # starlette's HTTPException: without "400: "
        raise InputError(400, "malformed multipart body: "
                              f"{why.splitlines()[0] if why else type(e).__name__}") from None
    field = form.get("file")
    if field is None:
        raise InputError(400, "multipart body without a field named 'file' (send the image as "
                              "-F file=@image.jpg, or as the raw body)")
    return field.encode() if isinstance(field, str) else await field.read()


def make_app(model: Model, max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 4) -> Any:
    """The Starlette app; at most ``workers`` requests decode and run the model at once (each
    holds a decoded image in memory), the others wait."""
    import anyio
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from normvit_jax.deploy.preprocess import InputError
    busy = anyio.Semaphore(workers)
    # python-multipart logs a warning per malformed body ("Expected boundary character 45, got
    # 106 at index 2"): any client could flood the log; the answer says it is malformed
    for name in ("python_multipart", "multipart"):
        logging.getLogger(name).setLevel(logging.ERROR)

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": " ".join(str(message).split())}, status_code=status,
                            headers=headers)

    async def predict(request: Any) -> JSONResponse:
        try:
            given = request.query_params.getlist("top_k")
            if len(given) > 1:  # not the last one silently; the count and the first 3 values,
                # each cut (a client could make the line as long as its URL)
                shown = [repr(v) if len(v) <= 20 else f"{v[:20]!r}..." for v in given[:3]]
                shown += ["..."] if len(given) > 3 else []
                raise InputError(400, f"top_k is given {len(given):,} times ({', '.join(shown)}): "
                                      "give it once")
            k = model.top_k(given[0] if given else None)
            data = await _image_bytes(request, max_bytes)
            async with busy:
                return JSONResponse(await run_in_threadpool(model.predict, data, k))
        except InputError as e:
            return error(e.status, e.message)
        except ClientDisconnect:  # gone mid-body: nobody reads the answer; no traceback in the log
            return error(400, "the client disconnected before sending the whole body")
        except asyncio.CancelledError:  # the shutdown's grace ran out (SHUTDOWN_GRACE_S): the
            # answer ends the task, instead of uvicorn logging the cancellation's traceback
            return error(503, "the service stopped before the request was complete")

    async def healthz(request: Any) -> JSONResponse:
        if app.state.stopping:  # a signal came: the requests in flight finish, no new ones
            return error(503, "the service is stopping (SIGTERM or Ctrl-C)")
        return JSONResponse({"status": "ok", "format": model.fmt, "artifact": model.path,
                             "num_classes": len(model.names)})

    async def http_error(request: Any, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, exc.detail, exc.headers)  # a 405's Allow

    app = Starlette(routes=[Route("/predict", predict, methods=["POST"]),
                            Route("/healthz", healthz, methods=["GET"])],
                    exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # /predict/ is another path (404), not a 307 to /predict
    app.state.stopping = False  # set by _Server.shutdown
    return app


def _server_class() -> Any:
    """uvicorn's Server, whose shutdown first takes every connection made before the signal.

    uvicorn's own shutdown closes the listening socket at once, which resets the connections the
    kernel has already completed but uvicorn has not accepted (its backlog), and closes accepted
    ones whose request has not been read yet. Here, from the signal: /healthz answers 503; the
    listening socket stays open until its backlog is drained once (every connection made before
    the signal is accepted: the event loop takes the whole queue at each pass), at most
    SHUTDOWN_ACCEPT_S, then closes; a connection accepted without a request yet gets until
    SHUTDOWN_REQUEST_S for its request to arrive; then uvicorn's shutdown lets the requests read
    finish in what is left of SHUTDOWN_GRACE_S."""
    import select
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            deadline = start + SHUTDOWN_GRACE_S
            self.config.app.state.stopping = True
            listening = [s for s in sockets or [] if s.fileno() >= 0]

            def waiting() -> bool:  # a connection in the kernel's backlog, not yet accepted
                try:
                    return bool(listening and select.select(listening, [], [], 0)[0])
                except (OSError, ValueError):
                    return False
            # The event loop accepts until the kernel's queue is empty at each pass, so the first
            # empty poll says the queue of the signal was taken; under a steady stream of new
            # connections (never an empty poll) they are taken for SHUTDOWN_ACCEPT_S at most, not
            # until the grace ends (the requests read then had no time left: cancelled, 503)
            while waiting() and loop.time() < start + SHUTDOWN_ACCEPT_S and not self.force_exit:
                await asyncio.sleep(0.01)  # the event loop accepts them meanwhile
            for server in self.servers:
                server.close()
            await asyncio.sleep(0.05)  # the accepted ones' transports and protocols are made

            def no_request_yet() -> bool:  # uvicorn's private cycle: None until a request
                # (tests/test_serve.py::test_uvicorns_protocol_has_what_the_shutdown_reads)
                return any(getattr(c, "cycle", 0) is None and not c.transport.is_closing()
                           for c in list(self.server_state.connections))
            while (no_request_yet() and loop.time() < start + SHUTDOWN_REQUEST_S
                   and not self.force_exit):
                await asyncio.sleep(0.01)
            self.config.timeout_graceful_shutdown = max(0.1, deadline - loop.time())
            await super().shutdown(sockets)

    return _Server


def _stop(message: str) -> None:
    print(f"python -m normvit_jax.serve: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    from normvit_jax import logs, tool_flags
    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m normvit_jax.serve", __doc__)
    p.add_argument("--artifact", required=True, help="an artifact written by python -m "
                   "normvit_jax.export --format=onnx|savedmodel|stablehlo")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--max_bytes", type=int, default=DEFAULT_MAX_BYTES, help="largest request "
                   "body accepted (413 above)")
    p.add_argument("--max_pixels", type=int, default=DEFAULT_MAX_PIXELS, help="largest decoded "
                   "image accepted, width x height (413 above)")
    p.add_argument("--workers", type=int, default=4, help="requests decoded and run at once")
    p.add_argument("--threads", type=int, default=0, help="the runtime's intra-op threads "
                   "(0: its default)")
    args = p.parse_args(argv)
    from normvit_jax import cli
    # Ctrl-C while loading or serving (uvicorn shuts down, then re-raises it): one line and 130,
    # not a KeyboardInterrupt traceback (docs/faults.md)
    with cli.tool_errors(p.prog):
        _serve(args)


def _serve(args: Any) -> None:
    bad = [f"--{k}={getattr(args, k)}" for k in ("max_bytes", "max_pixels", "workers")
           if getattr(args, k) < 1]  # the flags at fault, not a list of every rule
    bad += [f"--threads={args.threads}"] if args.threads < 0 else []
    bad += [f"--port={args.port}"] if not 0 <= args.port < 65536 else []
    if bad:
        _stop(f"{', '.join(bad)} is not accepted; accepted: --max_bytes, --max_pixels and "
              "--workers >= 1, --threads >= 0 (0: the runtime's default), --port in 0..65535")
    address = args.host.strip("[]")  # an IPv6 address as URLs write it: [::1]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound before the model loads (a port in use is said at once), opened after
        sock.bind((address, args.port))
    except OSError as e:
        _stop(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    from normvit_jax.deploy import DeployError, errors
    try:
        errors.require("starlette", "python -m normvit_jax.serve")
        errors.require("uvicorn", "python -m normvit_jax.serve")
        errors.require("python_multipart", "python -m normvit_jax.serve")  # as starlette
        model = Model(args.artifact, args.threads, args.max_pixels)
    except DeployError as e:
        _stop(str(e))
    try:  # from here on clients queue until uvicorn accepts: none is refused
        sock.listen(2048)
    except OSError as e:  # another process bound it meanwhile and listens first
        _stop(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    import uvicorn
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # http://[::1]:8000, not http://::1:8000
    config = uvicorn.Config(make_app(model, args.max_bytes, args.workers), log_level="warning",
                            backlog=2048, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = _server_class()(config)
    interrupted = _stop_on_ctrl_c(server)
    print(json.dumps({"serving": args.artifact, "format": model.fmt, "url":
                      f"http://{host}:{port}"}), flush=True)
    server.run(sockets=[sock])
    if interrupted:
        raise KeyboardInterrupt  # cli.tool_errors: one line, exit 130


def _stop_on_ctrl_c(server: Any) -> list[int]:
    """From the line saying it serves (which a script may answer with `kill -INT` at once) until
    uvicorn's own handler is in place, and when uvicorn hands the signal back after its shutdown:
    a Ctrl-C is recorded in the list returned and stops ``server`` as uvicorn's handler does.

    Python's default handler raised KeyboardInterrupt wherever the main thread was, also in a
    garbage-collection callback (JAX has one), which ignores it: the service then served on and
    never stopped. A background job of a non-interactive shell (`serve ... &` in a script)
    starts with SIGINT ignored (left so while loading, as the shell asked); uvicorn stops on it
    anyway, so it gets the terminal's one line and 130 as well."""
    interrupted: list[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        server.should_exit = True  # uvicorn's handle_exit: checked at start-up and every tick

    signal.signal(signal.SIGINT, on_sigint)
    return interrupted


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    main()
