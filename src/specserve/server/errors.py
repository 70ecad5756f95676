"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from specserve.server.responses import ErrorDetail, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 503: "overloaded_error"}

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """Raised by handlers; turned into an error response by the app."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON request body; any problem is a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"The request body is not valid JSON: {first['msg']}", code="invalid_json") from None
        parts = []
        for err in errors[:3]:
            where = ".".join(str(x) for x in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        param = str(first["loc"][0]) if first["loc"] else None
        raise ApiError(400, "; ".join(parts) + more, param=param) from None
