"""POST /v1/detect: one image, uploaded (multipart field `file`, or the raw body), as base64
JSON {"image"}, or named by an allowed {"url"} or {"path"}; the answer is the detection record."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from server import openapi, protocol
from server.common import context, within
from server.protocol import APIError

router = APIRouter()
DETECT_FIELDS = frozenset({"url", "path", "image"})


_UPLOAD = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "properties": {"file": {"type": "string", "format": "binary"}},
            "required": ["file"],
        }
    },
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
}


@router.post("/v1/detect", openapi_extra=openapi.request_body("Detect", extra_content=_UPLOAD))
async def detect(request: Request) -> dict:
    ctx = context(request)
    ctype = request.headers.get("content-type", "")
    timeout = ctx.config.request_timeout_s
    if ctype.startswith("multipart/form-data"):
        # Read the body within the limit first (a chunked upload has no Content-Length to
        # check); the form parser then reads it from memory.
        request._body = await ctx.read_body(request)
        form = await request.form(max_part_size=ctx.config.max_body_bytes)
        try:
            upload = form.get("file") or form.get("image")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "upload the image as the form field 'file'", "file")
            data = await upload.read()
        finally:
            await form.close()
        if not data:
            raise APIError(400, "file: the uploaded image is empty", "file")
        kind, value = "image", data
    elif ctype.startswith("application/json"):
        body = await ctx.read_json(request)
        unknown = sorted(set(body) - DETECT_FIELDS) if isinstance(body, dict) else []
        if unknown:  # a field taken and ignored would be worse than a refusal
            raise APIError(
                400,
                f"{unknown[0]}: /v1/detect takes only {', '.join(sorted(DETECT_FIELDS))} (per-request options such "
                f"as conf are not supported; the server's vision flags set them)",
                unknown[0],
            )
        given = [k for k in ("url", "path", "image") if isinstance(body, dict) and body.get(k) is not None]
        if len(given) != 1:
            raise APIError(400, "give exactly one of url, path or image (base64), or upload a file", "body")
        kind, value = given[0], body[given[0]]
        if not isinstance(value, str) or not value:
            raise APIError(400, f"{kind} must be a non-empty string", kind)
        if kind in ("url", "path"):
            protocol.check_text(kind, value)
        if kind == "image":
            from workers.jobspec import decode_image_b64

            value = decode_image_b64(value)
    else:
        kind, value = "image", await ctx.read_body(request)  # the raw image bytes
        if not value:
            raise APIError(400, "send an image: multipart field 'file', JSON {url|path|image}, or raw bytes")
    return await within(ctx.backend.detect(kind, value, timeout), time.monotonic() + timeout, request)
