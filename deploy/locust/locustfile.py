"""Load for a rebar server (or any OpenAI-compatible one): streamed chat completions, with
time to first token and inter-token latency reported as Locust statistics.

    locust -f deploy/locust/locustfile.py --host http://127.0.0.1:8000 \
        --headless -u 16 -r 4 -t 2m --csv load

Each simulated user sends one streamed chat completion after another (a fresh prompt each time,
so the response cache never answers). Besides the request itself ("POST chat stream", whole
response time), every stream adds one "TTFT" sample (request sent -> first content chunk) and one
"ITL" sample per later chunk (the gap since the previous one), in milliseconds; a stream that
breaks, ends without [DONE] or carries an error event is a failure. Settings, from the environment:
REBAR_LOAD_MODEL (smollm2), REBAR_LOAD_MAX_TOKENS (64), REBAR_LOAD_API_KEY (none).
"""

from __future__ import annotations

import itertools
import json
import os
import time

from locust import HttpUser, between, task

MODEL = os.environ.get("REBAR_LOAD_MODEL", "smollm2")
MAX_TOKENS = int(os.environ.get("REBAR_LOAD_MAX_TOKENS", "64"))
API_KEY = os.environ.get("REBAR_LOAD_API_KEY", "")
TOPICS = ("rivers", "bridges", "owls", "volcanoes", "libraries", "comets", "gardens", "trains")
_counter = itertools.count()


class ChatStreamUser(HttpUser):
    wait_time = between(0.0, 0.5)

    @task
    def stream_chat(self) -> None:
        n = next(_counter)
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "messages": [
                {"role": "user", "content": f"Tell me one fact about {TOPICS[n % 8]} (#{n})."}
            ],
        }
        headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        started = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name="POST chat stream",
        ) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {response.text[:200]}")
                return
            problem = self._read_stream(response, started)
            if problem:
                response.failure(problem)
            else:
                response.success()

    def _read_stream(self, response, started: float) -> str | None:
        """Fires the TTFT and ITL samples; returns what went wrong, or None."""
        last = None
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue  # blank separators and ": ping" comments
            data = line[len("data: ") :]
            if data == "[DONE]":
                return None if last is not None else "the stream ended without content"
            event = json.loads(data)
            if "error" in event:
                return f"error event: {event['error'].get('message')}"
            choices = event.get("choices") or []
            if not any(c.get("delta", {}).get("content") for c in choices):
                continue
            now = time.perf_counter()
            if last is None:
                self._sample("TTFT", now - started)
            else:
                self._sample("ITL", now - last)
            last = now
        return "the stream ended without [DONE]"

    def _sample(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="STREAM",
            name=name,
            response_time=seconds * 1000.0,
            response_length=0,
            exception=None,
            context={},
        )
