"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every refusal names the offending field and what would be accepted; nothing a client sends
reaches the engine before it passed these checks, so a bad request never hurts the server.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                    "model", code="model_not_found")


def overloaded(queued: int, limit: int, retry_after_s: int = 1) -> APIError:
    return APIError(503, f"{queued} requests are queued (--max-queued-requests={limit}); "
                    f"retry after {retry_after_s} s", None, type="server_overloaded",
                    code="too_many_requests", headers={"Retry-After": str(retry_after_s)})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and accepts no new requests", None,
                    type="server_shutting_down", code="shutting_down",
                    headers={"Retry-After": "5"})


def server_stopped(reason: str) -> APIError:
    """What a request still open gets when the server stops under it (a rank failed, or a
    second stop signal): an answer, not a dropped connection."""
    return APIError(500, f"the server stopped before this request finished: {reason}", None,
                    type="server_error", code="server_stopped")


def from_validation(err: ValidationError) -> APIError:
    """The first problem pydantic found, as one line naming the field."""
    first = err.errors(include_url=False)[0]
    # Union members add their type name to the location ('prompt', 'str'): keep the fields.
    fields = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    param = ".".join(fields) or None
    value = first.get("input")
    shown = "" if first["type"] == "missing" else f"={_short(value)}"
    return bad_request(f"{param or 'body'}{shown}: {first['msg']}", param)


def _is_type_tag(part: object) -> bool:
    """Union members tag error locations with their type ('int', 'list[str]'): not fields."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or not part.isidentifier())


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
