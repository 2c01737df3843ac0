"""A stand-in for vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``, 0.32), for the server
teacher's tests without vLLM: ``/health``, ``/v1/models``, ``/tokenize`` and ``/v1/completions`` answered in the JSON
format of the real server (checked against it), with log-probs computed by a Hugging Face causal LM; ``/pooling``
(per-token final hidden states, base64, as a server started with ``--runner pooling --pooler-config '{"task":
"token_embed", ...}'``; ``normalize=True``: L2-normalised, as with ``use_activation`` on).

Switches make it misbehave: ``fail_next(n, status)`` answers the next ``n`` requests with an HTTP error,
``drop_next(n)`` closes the next ``n`` connections without an answer, ``delay_next(n, seconds)`` answers them late,
``stop()`` takes it down (connections are then refused). ``requests`` records every ``(method, path)`` it received.

As a process (the toy studies' served teacher, conf/recipe/*_server.yaml), it serves a saved model until stopped:

    python -m lightning_gkd.testing.fake_vllm_server --model <folder> --max-logprobs 1 [--port 8000]

printing ``serving <folder> at http://127.0.0.1:<port>`` once it answers.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lightning_gkd.ops.decoding.sampling import sampling_logits
from lightning_gkd.ops.hf.heads import final_hidden_states


class FakeVLLMServer:
    """Serves ``model`` (its ``vocab_size`` unless given) as ``name`` on 127.0.0.1, a free port.

    ``served``: the model names ``/v1/models`` lists (default ``[name]``); ``tokenize``: text → ids for
    ``/tokenize`` (default ``tokenizer``'s); ``max_logprobs``/``max_model_len``: the server's limits;
    ``logprobs_mode``: vLLM's ``--logprobs-mode`` for the sampled tokens' log-probs (``raw_logprobs``: the full
    softmax at temperature 1; ``processed_logprobs``: the distribution sampled from)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        name: str = "toy-teacher",
        served: list[str] | None = None,
        max_logprobs: int = 20,
        max_model_len: int = 64,
        vocab_size: int | None = None,
        tokenize: Callable[[str, bool], list[int]] | None = None,
        eos_token_id: int | None = 2,
        normalize: bool = False,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model: Any = model.eval()  # a Hugging Face causal LM (its config, its forward's .logits)
        self.tokenizer, self.name = tokenizer, name
        self.served = served if served is not None else [name]
        self.max_logprobs, self.max_model_len = max_logprobs, max_model_len
        config: Any = model.config  # a Hugging Face model's
        self.vocab_size = vocab_size if vocab_size is not None else int(config.vocab_size)
        self.tokenize = tokenize or (lambda text, special: tokenizer(text, add_special_tokens=special)["input_ids"])
        self.eos_token_id = eos_token_id
        self.normalize = normalize
        self.logprobs_mode = logprobs_mode
        self.requests: list[tuple[str, str]] = []
        self._fail: list[int] = []  # statuses of the next failing requests
        self._drop = 0
        self._delays: list[float] = []  # seconds the next requests wait before answering
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    # -- control ----------------------------------------------------------------------------------------------------
    def start(self, port: int = 0) -> FakeVLLMServer:
        """Serve on 127.0.0.1: ``port``, or a free one (0)."""
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> FakeVLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def fail_next(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._fail.extend([status] * n)

    def delay_next(self, n: int, seconds: float) -> None:
        with self._lock:
            self._delays.extend([seconds] * n)

    def drop_next(self, n: int) -> None:
        with self._lock:
            self._drop += n

    def reset(self) -> None:
        with self._lock:
            self._fail.clear()
            self._delays.clear()
            self._drop = 0
            self.requests.clear()

    def count(self, path: str) -> int:
        return sum(1 for _, p in self.requests if p == path)

    # -- answers (status, JSON body or None) ------------------------------------------------------------------------
    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/health":
            return 200, None
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [self._model_card(name) for name in self.served]}
        if method == "POST" and path == "/tokenize":
            if "model" in body and body["model"] not in self.served:
                return _model_not_found(body["model"], self.served)
            tokens = [int(i) for i in self.tokenize(body["prompt"], bool(body.get("add_special_tokens", True)))]
            return 200, {
                "count": len(tokens),
                "max_model_len": self.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        if method == "POST" and path == "/v1/completions":
            return self._completions(body)
        if method == "POST" and path == "/pooling":
            return self._pooling(body)
        return 404, {"detail": "Not Found"}

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": int(time.time()),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    def _completions(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("model") not in self.served:
            return _model_not_found(body.get("model"), self.served)
        prompt = [int(i) for i in body["prompt"]]
        if not prompt:
            return _bad_request("You must pass at least one prompt")
        for bad in (min(prompt), max(prompt)):
            if bad < 0 or bad >= self.vocab_size:
                return _bad_request(f"Token id {bad} is out of vocabulary")
        k = body.get("prompt_logprobs")
        if k is not None and k > self.max_logprobs:
            return _bad_request(
                f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs} "
                f"(parameter=prompt_logprobs, value={k})",
                param="prompt_logprobs",
            )
        temperature = float(body.get("temperature", 1.0))
        if not 0 <= temperature <= 2:
            return _bad_request(f"temperature must be in [0, 2], got {temperature}.", param="temperature")
        max_tokens = min(int(body.get("max_tokens", 16)), self.max_model_len - len(prompt))
        if max_tokens < 1:
            return _bad_request(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        with self._model_lock:
            tokens, sampled = self._generate(prompt, body, temperature, max_tokens)
            prompt_logprobs = None if k is None else self._prompt_logprobs(prompt, k)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(tokens),
            "logprobs": None,
            "finish_reason": "stop" if tokens[-1] in self._stops(body) else "length",
            "stop_reason": tokens[-1] if tokens[-1] in (body.get("stop_token_ids") or []) else None,
            "token_ids": tokens if body.get("return_token_ids") else None,
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "routed_experts": None,
        }
        if body.get("logprobs") is not None:
            strings = [self.tokenizer.decode([t]) for t in tokens]
            choice["logprobs"] = {
                "text_offset": [sum(len(s) for s in strings[:i]) for i in range(len(strings))],
                "token_logprobs": sampled,
                "tokens": strings,
                "top_logprobs": [{s: v} for s, v in zip(strings, sampled, strict=True)],
            }
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(tokens)}
        usage.update(completion_tokens=len(tokens), prompt_tokens_details=None, completion_tokens_details=None)
        return 200, {
            "id": f"cmpl-fake{len(self.requests)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": "vllm-0.32.0-fake",
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    @torch.no_grad()
    def _pooling(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("model") not in self.served:
            return _model_not_found(body.get("model"), self.served)
        if body.get("task", "token_embed") != "token_embed":
            return _bad_request("Try switching the model's pooling_task via --pooler-config.task", param="task")
        inputs = body["input"]
        rows = inputs if inputs and isinstance(inputs[0], list) else [inputs]  # one prompt of ids, or a batch
        dtype = body.get("embed_dtype", "float32")
        items = []
        for index, row in enumerate(rows):
            ids = [int(i) for i in row]
            if len(ids) > self.max_model_len:
                return _bad_request(f"This model's maximum context length is {self.max_model_len} tokens.")
            with self._model_lock:
                positions = torch.ones(1, len(ids), dtype=torch.bool)
                mask = torch.ones(1, len(ids), dtype=torch.long)
                states = final_hidden_states(self.model, torch.tensor([ids]), mask, positions).float()
            if self.normalize:
                states = torch.nn.functional.normalize(states, dim=-1)
            if dtype == "bfloat16":
                raw = states.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
            else:
                raw = states.numpy().astype("<f4" if dtype == "float32" else "<f2").tobytes()
            data = base64.b64encode(raw).decode() if body.get("encoding_format") == "base64" else states.tolist()
            items.append({"index": index, "object": "pooling", "data": data})
        tokens = sum(len(row) for row in rows)
        return 200, {
            "id": f"pooling-fake{len(self.requests)}",
            "object": "list",
            "created": int(time.time()),
            "model": body["model"],
            "data": items[::-1],  # the client must order by index
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    @torch.no_grad()
    def _log_probs(self, ids: list[int]) -> torch.Tensor:
        """``(len(ids), V)`` float32 next-token log-probs (vLLM's raw log-probs: full softmax, temperature 1)."""
        known = int(self.model.config.vocab_size)  # a fake larger vocabulary: the extra ids embed as the last one
        logits = self.model(input_ids=torch.tensor([ids]).clamp(max=known - 1)).logits[0]
        return logits.float().log_softmax(-1)

    def _prompt_logprobs(self, prompt: list[int], k: int) -> list[dict[str, Any] | None]:
        log_probs = self._log_probs(prompt)
        entries: list[dict[str, Any] | None] = [None]
        for j in range(1, len(prompt)):
            row, token = log_probs[j - 1], prompt[j]
            # vLLM: the prompt token first (rank = how many log-probs are >= its own), then torch.topk's k
            entry = {str(token): self._entry(token, row[token], int((row >= row[token]).sum()))}
            values, ids = torch.topk(row, k)
            for rank, (value, index) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
                entry.setdefault(str(index), self._entry(index, value, rank))
            entries.append(entry)
        return entries

    def _entry(self, token: int, logprob: float | torch.Tensor, rank: int) -> dict[str, Any]:
        return {"logprob": float(logprob), "rank": rank, "decoded_token": self.tokenizer.decode([token])}

    def _stops(self, body: dict[str, Any]) -> set[int]:
        stops = set(body.get("stop_token_ids") or [])
        if not body.get("ignore_eos") and self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        return stops

    def _generate(
        self, prompt: list[int], body: dict[str, Any], temperature: float, max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """Decoded tokens (through the first stop token) and their raw log-probs; seeded sampling per request."""
        generator = torch.Generator().manual_seed(int(body["seed"])) if body.get("seed") is not None else None
        top_k, top_p = int(body.get("top_k") or 0), float(body.get("top_p", 1.0))
        ids, tokens, logprobs = list(prompt), [], []
        for _ in range(max_tokens):
            raw = self._log_probs(ids)[-1]
            processed = raw
            if temperature < 1e-5:
                token = int(raw.argmax())
            else:
                logits = sampling_logits(raw[None], temperature=temperature, top_k=max(top_k, 0), top_p=top_p)
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
                processed = logits[0].log_softmax(-1)
            tokens.append(token)
            logprobs.append(float((processed if self.logprobs_mode == "processed_logprobs" else raw)[token]))
            ids.append(token)
            if token in self._stops(body):
                break
        return tokens, logprobs


def _error(status: int, kind: str, message: str, param: str | None) -> tuple[int, Any]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _bad_request(message: str, param: str | None = None) -> tuple[int, Any]:
    return _error(400, "BadRequestError", message, param)


def _model_not_found(name: Any, served: list[str]) -> tuple[int, Any]:
    message = f"The model `{name}` does not exist. Valid aliases: {', '.join(served)}."
    return _error(404, "NotFoundError", message, "model")


def _handler(server: FakeVLLMServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._serve("GET", None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self._serve("POST", json.loads(self.rfile.read(length) or b"null"))

        def _serve(self, method: str, body: Any) -> None:
            with server._lock:
                server.requests.append((method, self.path))
                drop = server._drop > 0
                server._drop -= int(drop)
                failure = server._fail.pop(0) if server._fail and not drop else None
                delay = server._delays.pop(0) if server._delays else 0.0
            time.sleep(delay)
            if drop:  # the connection closes without a status line
                self.close_connection = True
                return
            if failure is not None:
                status, payload = _error(failure, "ServiceUnavailableError", "fake failure", None)
            else:
                try:
                    status, payload = server.answer(method, self.path, body)
                except Exception as error:  # like vLLM's engine failing
                    status, payload = _error(500, "InternalServerError", f"{type(error).__name__}: {error}", None)
            data = b"" if payload is None else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                self.close_connection = True

    return Handler


def serve_folder(folder: str, *, max_logprobs: int, max_model_len: int, port: int = 0) -> FakeVLLMServer:
    """A started server of the causal LM saved in ``folder`` (float32, its own tokenizer, its EOS), served as the
    default name (``toy-teacher``; a teacher spec's ``model: null`` takes the only one served)."""
    from lightning_gkd.data.tokenizer import load_tokenizer
    from lightning_gkd.models.loading import load_causal_lm
    from lightning_gkd.ops.hf.forward import resolve_eos_token_id

    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    eos = resolve_eos_token_id(model, tokenizer)
    return FakeVLLMServer(
        model,
        tokenizer,
        max_logprobs=max_logprobs,
        max_model_len=max_model_len,
        eos_token_id=eos if isinstance(eos, int) else None,
    ).start(port)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import signal

    parser = argparse.ArgumentParser(description="Serve a saved causal LM with vLLM's OpenAI-compatible JSON.")
    parser.add_argument("--model", required=True, help="the model's folder (save_pretrained, with its tokenizer)")
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args(argv)
    server = serve_folder(args.model, max_logprobs=args.max_logprobs, max_model_len=args.max_model_len, port=args.port)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    print(f"serving {args.model} at {server.url}", flush=True)
    stopped.wait()
    server.stop()


if __name__ == "__main__":
    main()
