"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Union members and wrappers pydantic puts into an error location; not field names.
_LOC_NOISE = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _printable(text: str | None) -> str | None:
    """``text`` without lone surrogates (a message may quote a client's invalid Unicode, which
    UTF-8 cannot encode)."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": _printable(message),
            "type": type_,
            "param": _printable(param),
            "code": code,
        }
    }


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, detail: str = "") -> APIError:
    suffix = f" {detail}" if detail else ""
    return bad_request(
        f"'{param}' is not supported by this server.{suffix}", param, "unsupported_parameter"
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def server_unavailable(message: str, code: str, retry_after_s: int | None = None) -> APIError:
    """A 503; with ``retry_after_s`` it carries ``Retry-After`` (the condition is temporary)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, "server_error", None, code, headers)


def payload_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes).",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def too_many_headers(count: int, size: int) -> APIError:
    return APIError(
        431,
        f"The request's header fields are more than this server accepts ({count} fields, "
        f"{size} bytes).",
        "invalid_request_error",
        None,
        "request_header_fields_too_large",
    )


def server_fault(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'list[Part]', 1) -> 'messages[0].content[1]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        part = str(part)
        if part in _LOC_NOISE or "[" in part or "-" in part:
            continue
        out += f".{part}" if out else part
    return out or None


def validation_error_to_api_error(errors: list[dict[str, Any]]) -> APIError:
    """Pick the most telling pydantic error and phrase it for a client."""
    if not errors:
        return bad_request("the request is invalid")
    # A wrong discriminator ("role", a content part's "type") explains the other errors of
    # the same object (its fields then look unknown or missing), so it goes first.
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if e.get("type") == "literal_error" and loc and loc[-1] in ("role", "type"):
            param = _param_from_loc(loc)
            return bad_request(f"{param}: {e.get('msg', 'invalid value')}", param)
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        param = _param_from_loc(tuple(extra[0].get("loc", ())))
        return bad_request(
            f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
        )
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            return bad_request(f"The request body is not valid JSON: {detail}".rstrip(": "))
    if len(errors) == 1 and tuple(errors[0].get("loc", ())) == ("body",):
        e = errors[0]
        if e.get("type") == "missing":
            return bad_request("The request body is missing; send a JSON object.")
        return bad_request(f"The request body must be a JSON object: {e.get('msg', '')}")
    # Unions report one error per member; the deepest location is usually the real mistake.
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param_from_loc(tuple(best.get("loc", ())))
    message = str(best.get("msg", "invalid value"))
    if param:
        message = f"{param}: {message}"
    if best.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    return bad_request(message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_to_api_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(
            error_body(detail, type_), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return server_fault(f"Internal server error: {type(exc).__name__}").response()
