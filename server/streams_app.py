"""The HTTP control of `tandem streams` (tandem/streams_cli.py runs it): the camera service's
(workers/cameras.py) API, its page and views, its /metrics and /health.

HTTP (default 127.0.0.1:8100). With --api-key (or $TANDEM_STREAMS_API_KEY) every endpoint but
/health wants "Authorization: Bearer KEY"; the page takes the key once as /?key=KEY, which sets
it as an HttpOnly, SameSite=Strict cookie the page's views and fetches then carry. Without a
key it does not start, unless --no-auth on a loopback --host. A Host header naming anything but --host
(and localhost, 127.0.0.1, [::1] on loopback, and --allowed-hosts) is refused with 421, and a
body that is not Content-Type application/json with 415: so a web page the user opens can
neither post to the service nor reach it through DNS rebinding.

    GET    /                    the page: every camera's live view, health, fps, drops, latency,
                                counts, and last events with their clips in a player
    GET    /cameras             {"cameras": [row, ...]}
    GET    /cameras/{id}/view   annotated MJPEG (multipart/x-mixed-replace) at most --view-fps:
                                boxes, lines and zones with their counts
    GET    /clips/{name}        an event clip (video/mp4, Range requests answered) from --clips-dir:
                                a clip's own file name only, no symlink; 404 otherwise
    GET    /clips/{name}/play   the same clip replayed as MJPEG at its frame rate (browsers decode
                                no mp4v), within the views' bound
    POST   /cameras             {"camera": id, "url": stream URL, "max_fps"?, "policy"?, "queue"?,
                                 "max_staleness_ms"?, "motion_threshold"?, "tracker"?, "lines"?,
                                 "zones"?} -> 201 {"camera": row}
    DELETE /cameras/{id}        {"camera": row}
    GET    /metrics             Prometheus text: every camera's up/state, fps, frames, drops, line
                                crossings, zone occupancy, ...
    GET    /health              {"status": "ok" | "failing", ...}; 503 once the Runtime refuses frames

Errors are serve's (OpenAI's) shape {"error": {"message", "type", "param", "code"}}: 400 bad
input, 401 no or a wrong key, 404 unknown camera, 409 an id in use or no room for another
camera, 415 not JSON, 421 a Host this service is not. Cameras added over HTTP (or the Redis
control list) must be network stream URLs on public addresses (private and loopback ones need
--allow-private-urls or --allowed-url-networks). A camera's last_error over HTTP is a class
("connection refused", "timed out", "not a video stream", ...), never what the target answered;
the log has the full text.
"""

import socket
import threading
import time

from workers.cameras_security import KEY_COOKIE, Security, public_row

# Nothing heavy at import (FastAPI loads in create_app). No `from __future__ import annotations`:
# FastAPI must see the endpoints' annotations as objects.

MAX_BODY = 64 * 1024


_JSON_METHODS = ("POST", "PUT", "PATCH")


def _error(status: int, message: str, param: str | None = None, type_: str | None = None, headers=None):
    """serve's error shape (server/http_errors.APIError): {"error": {"message", "type",
    "param", "code"}}, so one client handles both services' errors."""
    from fastapi.responses import JSONResponse

    from server.http_errors import APIError

    types = {401: "authentication_error", 409: "conflict_error", 415: "invalid_request_error"}
    err = APIError(status, message, param, type_ or types.get(status), headers)
    return JSONResponse(err.body(), status_code=status, headers=err.headers)


def create_app(service, security: Security | None = None, stop: threading.Event | None = None, view_fps=None):
    """The HTTP control of a workers.cameras.CameraService, its views (workers/cameras_views.py)
    and, with `security`, the API key and Host checks (tandem streams always passes one; None is for
    embedding behind another guard). JSON bodies need Content-Type application/json either way."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

    from workers import cameras_views as views
    from workers.cameras import CameraConflict, CameraError, CameraNotFound, json_object

    app = FastAPI(title="tandem streams", docs_url=None, redoc_url=None, openapi_url=None)
    stop = stop or threading.Event()
    viewers = views.Viewers()
    fps = view_fps or views.DEFAULT_VIEW_FPS

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if security is not None:
            local = request.scope.get("server")
            if not security.host_ok(request.headers.get("host"), local[0] if local else None):
                # Another name than this service's: a DNS-rebinding page, or a proxy's mistake.
                return _error(
                    421,
                    "this service does not answer to that Host (see --allowed-hosts)",
                    "host",
                    "invalid_request_error",
                )
            path = request.url.path
            login = path == "/" and "key" in request.query_params
            if path != "/health" and not login and not security.key_ok(request):
                return _error(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>' (the page: open /?key=<key> once)",
                    None,
                    None,
                    {"WWW-Authenticate": "Bearer"},
                )
        if request.method in _JSON_METHODS:
            ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                # A browser page may send text/plain cross-origin without asking; JSON needs a preflight.
                return _error(415, f"Content-Type must be application/json, got {ctype or 'none'!r}", "content-type")
        return await call_next(request)

    @app.exception_handler(CameraError)
    async def camera_error(_request, exc: CameraError):
        status = 404 if isinstance(exc, CameraNotFound) else 409 if isinstance(exc, CameraConflict) else 400
        return _error(status, str(exc), exc.field)

    @app.exception_handler(RuntimeError)
    async def closed(_request, exc: RuntimeError):
        return _error(503, str(exc))

    @app.get("/")
    def index(request: Request):
        key = request.query_params.get("key")
        if key is not None and security is not None and security.api_keys:
            if not security.key_ok(_KeyRequest(key)):
                return _error(401, "invalid API key", "key", None, {"WWW-Authenticate": "Bearer"})
            # The key moves to an HttpOnly cookie (the page's script cannot read it; SameSite=
            # Strict: no other site's page sends it), and out of the address bar.
            resp = RedirectResponse("./", status_code=303)
            resp.set_cookie(KEY_COOKIE, key, httponly=True, samesite="strict", path="/")
            return resp
        return HTMLResponse(views.page(service.instance), headers={"Cache-Control": "no-store"})

    @app.get("/cameras")
    def list_cameras():
        return {"cameras": [public_row(r) for r in service.cameras()]}

    @app.get("/cameras/{camera_id}/view")
    def view(camera_id: str):
        if camera_id not in {c["camera"] for c in service.cameras()}:
            raise CameraNotFound("camera", f"no camera {camera_id!r} (GET /cameras lists them)")
        if not viewers.acquire():
            return _error(429, f"{viewers.limit} views are open already", "camera", "rate_limit_error")
        return StreamingResponse(
            views.mjpeg(service, camera_id, fps, stop, viewers),
            media_type=f"multipart/x-mixed-replace; boundary={views.BOUNDARY}",
            headers={"Cache-Control": "no-store"},
        )

    def clip_path(name: str):
        """The clip's file, or the 404 to answer."""
        clips = getattr(service, "clips", None)  # the service's ClipWriter; None: no --clips-dir
        if clips is None:
            return None, _error(404, "this service keeps no clips (start tandem streams with --clips-dir)", "name")
        path = views.clip_file(clips.clips_dir, name)
        if path is None:
            return None, _error(404, f"no clip {name[:100]!r} (the events in GET /cameras name them)", "name")
        return path, None

    @app.get("/clips/{name}")
    def clip(name: str):
        from fastapi.responses import FileResponse

        path, refused = clip_path(name)
        if refused is not None:
            return refused
        # nosniff: the browser takes it as the MP4 it is, never as a page of this origin.
        return FileResponse(path, media_type="video/mp4", headers={"X-Content-Type-Options": "nosniff"})

    @app.get("/clips/{name}/play")
    def play_clip(name: str):
        path, refused = clip_path(name)
        if refused is not None:
            return refused
        if not viewers.acquire():
            return _error(429, f"{viewers.limit} views are open already", "name", "rate_limit_error")
        return StreamingResponse(
            views.replay(path, stop, viewers),
            media_type=f"multipart/x-mixed-replace; boundary={views.BOUNDARY}",
            headers={"Cache-Control": "no-store"},
        )

    @app.post("/cameras", status_code=201)
    async def add_camera(request: Request):
        body = await request.body()
        if len(body) > MAX_BODY:
            raise CameraError("body", f"the body must be a JSON object under {MAX_BODY} bytes")
        cmd = json_object(body, "body", 'the body must be a JSON object {"camera", "url", "max_fps"?}')
        if "op" in cmd:
            raise CameraError("op", "op is for the Redis control list; POST adds, DELETE removes")
        return {"camera": public_row(service.apply({**cmd, "op": "add"}))}

    @app.delete("/cameras/{camera_id}")
    def remove_camera(camera_id: str):
        return {"camera": public_row(service.remove(camera_id))}

    @app.get("/metrics")
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        from server.metrics import render

        return Response(render([{**service.payload(), "instance": service.instance}]), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health():
        from fastapi.responses import JSONResponse

        cams = service.cameras()
        body = {
            "status": "failing" if service.failure else "ok",
            "failure": service.failure,
            "instance": service.instance,
            "cameras": len(cams),
            "cameras_up": sum(c["up"] for c in cams),
        }
        return JSONResponse(body, status_code=503 if service.failure else 200)

    return app


class _KeyRequest:
    """A key given as ?key= checked like a Bearer header."""

    def __init__(self, key: str) -> None:
        self.headers = {"authorization": f"Bearer {key}"}
        self.cookies: dict = {}


class ControlServer:
    """uvicorn on its own thread, on a socket bound at construction: a port in use is an error
    before the model loads, and port 0 is resolved to the one the kernel picked."""

    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        bound = self.sock.getsockname()
        self.url = f"http://{f'[{bound[0]}]' if family == socket.AF_INET6 else bound[0]}:{bound[1]}"
        self._server = None
        self._thread: threading.Thread | None = None
        self.stop = threading.Event()  # ends the open views, so uvicorn's shutdown need not wait on them

    def start(self, app, timeout: float = 30.0) -> None:
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        # Off the main thread uvicorn leaves the signals alone: tandem streams handles them.
        run = lambda: self._server.run(sockets=[self.sock])  # noqa: E731
        self._thread = threading.Thread(target=run, name="tandem-cameras-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP control did not start on {self.url}")
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self.sock.close()
