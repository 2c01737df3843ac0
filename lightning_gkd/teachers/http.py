"""JSON over HTTP for the teacher server (standard library only): one request with retries of transient failures.

Transient: connection refused or dropped, timeouts, HTTP 5xx and 429; they are retried ``retries`` times with
exponential backoff (``backoff · 2^attempt`` seconds before retry ``attempt + 1``), then ``TeacherUnavailable``. Any
other HTTP error (a 4xx: a bad request, an unknown model) is the caller's mistake: ``TeacherRequestError`` at once,
with the server's own message.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from lightning_gkd.teachers.base import TeacherUnavailable

__all__ = [
    "JsonClient",
    "TeacherRequestError",
    "TeacherUnavailable",
    "check_number",
    "map_concurrently",
    "normalize_url",
    "start_command",
]

_T = TypeVar("_T")


class TeacherRequestError(RuntimeError):
    """The teacher server refused a request (an HTTP 4xx other than 429): retrying would not help."""

    def __init__(self, url: str, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"The teacher server at {url} answered HTTP {status}: {message}")
        self.url, self.status, self.message, self.param = url, status, message, param


def normalize_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1`` (the OpenAI clients' base URL), or ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"The teacher server url must be a string such as 'http://127.0.0.1:8000', got {url!r}.")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"The teacher server url must look like 'http://host:port' (the vLLM server's address), got {url!r}."
        )
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as error:
        raise ValueError(f"The teacher server url {url!r} has a bad port: {error}.") from error
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def start_command(url: str, top_k: int) -> str:
    """The command that starts a vLLM server answering at ``url`` with ``--max-logprobs >= top_k``."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (
        "python -m vllm.entrypoints.openai.api_server --model <teacher folder or hub id> "
        f"--max-logprobs {max(top_k, 20)} --host {parts.hostname} --port {port}"
    )


def _transient(error: BaseException) -> bool:
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500 or error.code == 429
    # OSError: refused connections (in a URLError), resets, timeouts; HTTPException: a dropped or cut-off answer
    return isinstance(error, (OSError, http.client.HTTPException))


def _describe(error: BaseException) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code}: {_server_message(error)[0]}"
    if isinstance(error, urllib.error.URLError):
        return f"{type(error.reason).__name__}: {error.reason}"
    return f"{type(error).__name__}: {error}"


def _server_message(error: urllib.error.HTTPError) -> tuple[str, str | None]:
    """The message and parameter of an error response (vLLM: ``{"error": {"message", "param", ...}}``)."""
    try:
        body = error.read().decode("utf-8", "replace")
    except Exception:  # a dropped body: the status line is all there is
        body = ""
    try:
        payload = json.loads(body)
    except ValueError:
        return (body.strip() or str(error.reason)), None
    detail = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(detail, dict):
        message = detail.get("message") or detail.get("detail") or json.dumps(detail)
        return str(message), (str(detail["param"]) if detail.get("param") is not None else None)
    return str(detail), None


class JsonClient:
    """GET/POST JSON to ``url`` (already normalized) with ``timeout`` seconds a request and the retry policy of the
    module docstring. ``hint`` ends every ``TeacherUnavailable`` message (how to start the server)."""

    def __init__(self, url: str, *, timeout: float, retries: int, backoff: float, hint: str = "") -> None:
        self.url, self.timeout, self.retries, self.backoff, self.hint = url, timeout, retries, backoff, hint
        #: bytes of answer bodies received so far (what the teacher signal costs on the wire)
        self.received_bytes = 0

    def get(self, path: str, *, abort: threading.Event | None = None) -> Any:
        return self.request("GET", path, None, abort=abort)

    def post(self, path: str, body: Any, *, abort: threading.Event | None = None) -> Any:
        return self.request("POST", path, body, abort=abort)

    def request(self, method: str, path: str, body: Any, *, abort: threading.Event | None = None) -> Any:
        """The decoded JSON answer (None for an empty body). ``abort`` set (by another thread that gave up) stops
        the retries early with ``TeacherUnavailable``."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        last: BaseException | None = None
        attempts = 0
        for attempt in range(self.retries + 1):
            if abort is not None and abort.is_set():
                break
            attempts += 1
            request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                self.received_bytes += len(raw)  # one int add per answer: not worth a lock under the GIL
                return json.loads(raw) if raw.strip() else None
            except urllib.error.HTTPError as error:
                if not _transient(error):
                    message, param = _server_message(error)
                    raise TeacherRequestError(self.url, error.code, message, param) from None
                last = error
            except Exception as error:
                if not _transient(error):
                    raise
                last = error
            if attempt < self.retries:
                delay = self.backoff * 2**attempt
                if abort is not None:
                    abort.wait(delay)
                else:
                    threading.Event().wait(delay)
        cause = _describe(last) if last is not None else "another request to it gave up"
        raise TeacherUnavailable(
            f"The teacher server at {self.url} did not answer {method} {path} after {attempts} attempt(s) "
            f"(last error: {cause}). Is it running? {self.hint}".rstrip()
        )


def map_concurrently(
    pool: ThreadPoolExecutor, call: Callable[[Any, threading.Event], _T], jobs: Sequence[Any]
) -> list[_T]:
    """``[call(job, abort) for job in jobs]`` on ``pool``, in order. The first failure stops the rest: queued jobs
    are cancelled and ``abort`` is set, which ends the running ones' retries (so a server that is down costs one
    request's retries, not one per row)."""
    if not jobs:
        return []
    abort = threading.Event()
    first: list[BaseException] = []  # the failure that stopped the rest (the others only report the stop)
    lock = threading.Lock()

    def run(job: Any) -> _T:
        try:
            return call(job, abort)
        except BaseException as error:
            with lock:
                if not first:
                    first.append(error)
            abort.set()  # here, not in the caller: the next queued job may start before the caller wakes
            raise

    futures: list[Future[_T]] = [pool.submit(run, job) for job in jobs]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if first:
        for future in pending:
            future.cancel()
        wait(pending)
        raise first[0]
    return [future.result() for future in futures]


def check_number(name: str, value: Any, minimum: float, what: str, *, integer: bool = False) -> None:
    """ValueError unless ``value`` is a number (an integer with ``integer``) >= ``minimum``."""
    kinds = (int,) if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not value >= minimum:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} >= {minimum} ({what}), got {value!r}.")
