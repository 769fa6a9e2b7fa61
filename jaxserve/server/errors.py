"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure a client can cause is an `APIError` raised with the status it deserves; only server
faults become a 500 (logged with a traceback by the route wrapper in app.py).
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    """A request failure that maps to one HTTP status and one OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: tuple[str, ...]) -> APIError:
    """404 as OpenAI and vLLM answer it (the openai client raises NotFoundError)."""
    return APIError(404, f"The model {model!r} does not exist on this server; it serves: {', '.join(served)}",
                    "NotFoundError", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                    None, "request_too_large")


def overloaded(limit: int) -> APIError:
    return APIError(429, f"the server's waiting queue is full (at most {limit} waiting sequences); retry later",
                    "rate_limit_error", None, "rate_limit_exceeded")


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, code)


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"request exceeded the server's request timeout of {seconds:g}s and was aborted",
                    "timeout_error", None, "request_timeout")


def server_error(message: str, code: str) -> APIError:
    """A 500 the server knows the cause of (the route wrapper logs it with its cause)."""
    return APIError(500, message, "internal_server_error", None, code)


def internal() -> APIError:
    return server_error("internal server error (logged on the server)", "internal_error")
