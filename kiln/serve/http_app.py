"""The Open Inference Protocol's REST routes as a FastAPI app: health, server and model metadata, model config,
repository index, inference (JSON and Triton's binary extension) and Prometheus `/metrics`. The app holds no
server of its own: uvicorn runs it for `kiln serve`, and Ray Serve can mount it (`@serve.ingress(app)`)."""
from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from kiln.errors import Error, InputError
from kiln.serve import metrics
from kiln.serve.codec import HEADER_LENGTH, decode_request, encode_response
from kiln.serve.protocol import http_status
from kiln.serve.repository import ModelRepository

SERVER_NAME = "kiln"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository"]


def create_app(repository: ModelRepository | Callable[[], ModelRepository], manage_lifecycle: bool = True) -> FastAPI:
    """The REST app over `repository` (or a factory called at startup, e.g. inside a Ray Serve replica). With
    `manage_lifecycle` the app starts the batchers on startup and drains them on shutdown; `kiln serve` does
    that itself because the gRPC server shares them."""
    holder: dict[str, ModelRepository] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        repo = repository() if callable(repository) else repository
        holder["repo"] = repo
        if manage_lifecycle:
            repo.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await asyncio.get_running_loop().run_in_executor(None, repo.stop)

    app = FastAPI(title="kiln serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kiln_repository = holder

    def repo() -> ModelRepository:
        return holder["repo"]

    @app.exception_handler(Error)
    async def kiln_error(request: Request, exc: Error):
        return JSONResponse({"error": str(exc)}, status_code=http_status(exc))

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        ok = "repo" in holder and repo().ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_metadata():
        from kiln.version import __version__

        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str = ""):
        return repo().get(name, version).metadata()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str = ""):
        model = repo().get(name, version)
        return JSONResponse({"name": model.name, "ready": model.ready}, status_code=200 if model.ready else 503)

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(name: str, version: str = ""):
        return repo().get(name, version).config()

    @app.post("/v2/repository/index")
    async def repository_index():
        return [{"name": m.name, "version": m.version, "state": "READY" if m.ready else "UNAVAILABLE"}
                for m in repo().models.values()]

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = ""):
        model = repo().get(name, version)
        try:
            body = await read_body(request, repo().options.max_request_bytes)
        except ClientDisconnect:
            return Response(status_code=499)   # the client left mid-body: nothing to answer, nothing ran
        infer_request = decode_request(body, request.headers.get(HEADER_LENGTH), model.name, model.version)
        response = await _unless_disconnected(request, model.infer(infer_request))
        if response is None:
            return Response(status_code=499)   # nobody is listening; nginx's "client closed request"
        content, header_length = encode_response(response, infer_request)
        headers = {HEADER_LENGTH: str(header_length)} if header_length is not None else {}
        media = "application/octet-stream" if header_length is not None else "application/json"
        return _maybe_compressed(content, media, headers, request.headers.get("accept-encoding", ""))

    @app.get("/metrics")
    async def prometheus_metrics():
        models = [(m.name, m.version, m.stats) for m in repo().models.values()]
        return PlainTextResponse(metrics.render(models), media_type="text/plain; version=0.0.4")

    return app


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, decompressed if `Content-Encoding` says gzip/deflate; InputError past `limit_bytes`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit_bytes:
        raise InputError(f"request body of {int(declared)} bytes exceeds the server's limit of {limit_bytes} "
                         "bytes (--max-request-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise InputError(f"request body exceeds the server's limit of {limit_bytes} bytes (--max-request-bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if declared and declared.isdigit() and len(body) < int(declared):
        raise InputError(f"request body ended after {len(body)} of its {declared} bytes (truncated body)")
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding == "gzip" else 0))
        try:
            body = inflater.decompress(body, limit_bytes + 1)
        except zlib.error as exc:
            raise InputError(f"request body is not valid {encoding} data ({exc})") from None
        if len(body) > limit_bytes or inflater.unconsumed_tail:
            raise InputError(f"decompressed request body exceeds the server's limit of {limit_bytes} bytes "
                             "(--max-request-bytes)")
    elif encoding != "identity":
        raise InputError(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    return body


async def _unless_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first: then cancel it (a queued request is dropped unrun)
    and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _maybe_compressed(content: bytes, media: str, headers: dict, accept: str) -> Response:
    accepted = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    for encoding, wbits in (("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)):
        if encoding in accepted:
            packer = zlib.compressobj(6, zlib.DEFLATED, wbits)
            content = packer.compress(content) + packer.flush()
            headers = {**headers, "Content-Encoding": encoding}
            break
    return Response(content, media_type=media, headers=headers)
