"""Bare /generate clients: the same requests the workers send, with no queue, ledger or window,
for the benchmarks' "what the server could do" side.

Imported as `bare_client` by the scripts in bench/ (the script's folder is first on sys.path).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# --- bare /generate clients --------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    input_ids: list[int]
    sampling: dict[str, Any]
    rid: str


@dataclass
class ClientRun:
    """What a bare client run saw: per-request send and completion times, tokens."""

    sent: list[float]
    done: list[float]
    tokens: list[int]
    errors: list[str]
    wall_s: float

    @property
    def span_s(self) -> float:
        """First request sent to last answer received."""
        return max(self.done) - min(s for s in self.sent if s > 0)

    @property
    def generated(self) -> int:
        return sum(self.tokens)


def bare_client_run(
    url: str,
    requests: Sequence[Request],
    *,
    window: int,
    barrier: bool = False,
    counter: Iterator[int] | None = None,
) -> ClientRun:
    """Send every request to url from `window` threads, each with its own single-connection
    httpx client. barrier=False keeps exactly `window` requests in flight (a thread takes
    the next request the moment its answer arrives); barrier=True sends `window` requests,
    waits for all of them, then sends the next `window` ("batch and wait").

    Several servers as one ideal client: run one per server at once, all with the same
    `counter` (they take the requests from one shared queue); a run's figures then cover only
    the requests it sent (the others stay 0)."""
    n = len(requests)
    sent = [0.0] * n
    done = [0.0] * n
    tokens = [0] * n
    errors: list[str] = []
    counter = counter if counter is not None else itertools.count()
    rounds = (n + window - 1) // window
    gate = threading.Barrier(window) if barrier else None
    ready = threading.Barrier(window + 1)

    def send(client: httpx.Client, i: int) -> None:
        req = requests[i]
        body = json.dumps(
            {
                "input_ids": req.input_ids,
                "sampling_params": req.sampling,
                "rid": req.rid,
                "stream": False,
            },
            separators=(",", ":"),
        ).encode()
        sent[i] = time.time()
        response = client.post(
            "/generate", content=body, headers={"content-type": "application/json"}
        )
        done[i] = time.time()
        if response.status_code != 200:
            errors.append(f"{response.status_code}: {response.text[:200]}")
            return
        tokens[i] = int(json.loads(response.content)["meta_info"]["completion_tokens"])

    def work(slot: int) -> None:
        client = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(3600.0, connect=10.0),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            trust_env=False,
        )
        try:
            ready.wait()
            if gate is None:
                while (i := next(counter)) < n:
                    send(client, i)
            else:
                for r in range(rounds):
                    i = r * window + slot
                    if i < n:
                        send(client, i)
                    gate.wait()
        except Exception as exc:
            errors.append(repr(exc))
            if gate is not None:
                gate.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(window)]
    for t in threads:
        t.start()
    ready.wait()
    wall0 = time.perf_counter()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - wall0
    return ClientRun(sent, done, tokens, errors, wall_s)
