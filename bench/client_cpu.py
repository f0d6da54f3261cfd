"""Client CPU per /generate request of app.sglang.SGLangClient, by client shape.

Starts a canned loopback /generate server in a subprocess (or uses --url), then compares one
single-connection client per thread with one shared pooled client, at several thread counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.sglang.client import SGLangClient

SHAPES = ("client-per-thread", "shared-pool")
WARMUP_REQUESTS_PER_THREAD = 3


# --- the canned server (runs in its own process) -----------------------------------------


def serve(output_tokens: int) -> None:
    """Answer every POST /generate at once with a valid stop answer echoing the rid.

    Prints the port on stdout, then serves until stdin closes (the parent exited or is done).
    """
    from aiohttp import web

    output_ids = [1000 + i % 30000 for i in range(output_tokens - 1)] + [163586]

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        answer = {
            "text": "",
            "output_ids": output_ids,
            "meta_info": {
                "id": body["rid"],
                "finish_reason": {"type": "stop", "matched": 163586},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": 0.0,
                "weight_version": "default",
            },
        }
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, backlog=1024).start()
        print(sock.getsockname()[1], flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)
        await runner.cleanup()

    asyncio.run(main())


# --- the measurement ---------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Figure:
    """One measured run; ordered by CPU per request so a median can be taken."""

    cpu_per_request_s: float
    shape: str
    threads: int
    requests: int
    wall_s: float
    cpu_s: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000.0 * self.cpu_s / self.requests


def make_client(url: str, max_connections: int) -> SGLangClient:
    return SGLangClient(
        url,
        connect_timeout_s=5.0,
        generate_timeout_s=60.0,
        info_timeout_s=10.0,
        probe_timeout_s=30.0,
        max_connections=max_connections,
    )


def run_threads(
    threads: int, requests_per_thread: int, send_for: Callable[[int], Callable[[int], None]]
) -> tuple[float, float]:
    """Run `threads` threads sending warmup then measured requests; return (wall_s, cpu_s)."""
    start = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        send = send_for(index)
        try:
            for k in range(WARMUP_REQUESTS_PER_THREAD):
                send(-1 - k)
            start.wait()
            for k in range(requests_per_thread):
                send(k)
        except BaseException as exc:
            errors.append(exc)
            start.abort()
        finally:
            done.wait()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    wall0_s, cpu0_s = time.perf_counter(), time.process_time()
    done.wait()
    wall_s, cpu_s = time.perf_counter() - wall0_s, time.process_time() - cpu0_s
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return wall_s, cpu_s


def measure(
    url: str, shape: str, threads: int, requests_per_thread: int, prompt: list[int]
) -> Figure:
    params = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    if shape == "client-per-thread":
        clients = [make_client(url, max_connections=1) for _ in range(threads)]
    else:
        clients = [make_client(url, max_connections=threads)]

    def send_for(index: int) -> Callable[[int], None]:
        client = clients[index % len(clients)]

        def send(k: int) -> None:
            client.generate(prompt, params, f"bench-{shape}-{threads}-{index}-{k}")

        return send

    try:
        wall_s, cpu_s = run_threads(threads, requests_per_thread, send_for)
    finally:
        for client in clients:
            client.close()
    requests = threads * requests_per_thread
    return Figure(cpu_s / requests, shape, threads, requests, wall_s, cpu_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,8,32,64", help="comma-separated thread counts")
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; median shown")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--url", help="an existing loopback server (e.g. the emulator)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.output_tokens)
        return

    server: subprocess.Popen[str] | None = None
    url = args.url
    if url is None:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--output-tokens", str(args.output_tokens)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
    prompt = [1000 + i % 30000 for i in range(args.prompt_tokens)]
    print(
        f"server {url}; {args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens,"
        f" {args.requests} requests per row"
    )
    print(f"{'shape':<20} {'threads':>7} {'requests/s':>11} {'client CPU ms/request':>22}")
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            per_thread = max(1, args.requests // threads)
            runs: dict[str, list[Figure]] = {shape: [] for shape in SHAPES}
            # shapes interleaved and the median kept: the server shares the machine's cores
            for _ in range(args.repeat):
                for shape in SHAPES:
                    runs[shape].append(measure(url, shape, threads, per_thread, prompt))
            for figures in runs.values():
                figure = statistics.median_low(figures)
                print(
                    f"{figure.shape:<20} {figure.threads:>7} {figure.requests_per_s:>11.0f}"
                    f" {figure.cpu_ms_per_request:>22.3f}",
                    flush=True,
                )
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    main()
