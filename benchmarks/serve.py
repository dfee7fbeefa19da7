"""Online serving load: streaming chat requests against the OpenAI-compatible server.

Requests arrive as a Poisson process at each given rate (`inf`: all at once). Prompts are MT-bench
first turns; every request asks for exactly `--max-tokens` tokens (EOS ignored) so runs compare, and
each run has its own system prompt so no run reuses the prefix cache another one filled.
Reports throughput and, per request, TTFT (arrival to first text), TPOT ((latency - TTFT) / (tokens - 1))
and ITL (gaps between streamed chunks), each as mean, median and p99.

    python benchmarks/serve.py --rates 0.5,inf                 # starts a server on the default model
    python benchmarks/serve.py --url http://127.0.0.1:8000 --model-name NAME --rates 1,2

A server started here runs in its own process, so the load generator does not share its GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

from common import load_mt_bench_prompts, machine_info, write_results


@dataclass(slots=True)
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one here")
    parser.add_argument("--model", default=None, help="model for the server started here (default model)")
    parser.add_argument("--model-name", default="default", help="the `model` field to send")
    parser.add_argument("--rates", default="0.5,inf", help="comma-separated requests/s; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra flags for the server started here")
    parser.add_argument("--json", type=Path, default=None, help="results file (default benchmarks/results/serve_<machine class>.json)")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "paged_backend.integrations.server", "--port", str(port),
               "--served-model-name", args.model_name, *args.server_args.split()]
    if args.model:
        command += ["--model", args.model]
    log_path = Path(tempfile.gettempdir()) / f"paged-backend-serve-{port}.log"
    with log_path.open("w") as log:  # the server's access log would drown the table
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
    except (RuntimeError, TimeoutError):
        process.kill()
        print(log_path.read_text()[-3000:], file=sys.stderr)
        raise
    return process, url


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not healthy after {timeout} s")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals, or all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def send(client: httpx.AsyncClient, url: str, body: dict, delay: float) -> RequestResult:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                last = read_event(line, start, last, result)
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=repr(exc))
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


def read_event(line: str, start: float, last: float | None, result: RequestResult) -> float | None:
    """Update `result` from one SSE line; return the time of the latest chunk with text."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    event = json.loads(line[6:])
    if event.get("usage"):
        result.output_tokens = event["usage"]["completion_tokens"]
    choices = event.get("choices") or []
    if not choices or not choices[0]["delta"].get("content"):
        return last
    now = time.perf_counter()
    if last is None:
        result.ttft = now - start
    else:
        result.itls.append(now - last)
    return now


async def run_rate(url: str, args: argparse.Namespace, prompts: list[str], rate: float, session: int) -> dict:
    # The session number in the system prompt keeps one run from hitting the prefix cache left by another,
    # while requests within a run share it, as real traffic with one system prompt does.
    system = {"role": "system", "content": f"You are a helpful AI assistant. Session {session:03d}."}
    bodies = [{"model": args.model_name, "messages": [system, {"role": "user", "content": p}], "temperature": 0,
               "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for p in prompts]
    offsets = arrival_offsets(len(bodies), rate, args.seed)
    limits = httpx.Limits(max_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, url, b, d) for b, d in zip(bodies, offsets)))
        duration = time.perf_counter() - start
    return summarise(rate, results, duration)


def summarise(rate: float, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        "rate": rate, "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "requests_per_s": len(done) / duration, "output_tokens_per_s": tokens / duration,
        "ttft_s": stats([r.ttft for r in done]), "tpot_s": stats([r.tpot for r in done if r.tpot is not None]),
        "itl_s": stats([gap for r in done for gap in r.itls]),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def print_table(rows: list[dict]) -> None:
    head = (f"{'rate':>6} {'done':>5} {'req/s':>6} {'tok/s':>6} | {'TTFT ms mean/med/p99':>22} | "
            f"{'TPOT ms mean/med/p99':>22} | {'ITL ms mean/med/p99':>22}")
    print(head)
    print("-" * len(head))
    for row in rows:
        cells = [ms(row[key]) for key in ("ttft_s", "tpot_s", "itl_s")]
        print(f"{row['rate']:>6} {row['completed']:>5} {row['requests_per_s']:>6.2f} "
              f"{row['output_tokens_per_s']:>6.1f} | {cells[0]:>22} | {cells[1]:>22} | {cells[2]:>22}")


def ms(summary: dict[str, float]) -> str:
    return "/".join(f"{summary[k] * 1000:.0f}" for k in ("mean", "median", "p99"))


def main() -> None:
    args = parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    prompts = load_mt_bench_prompts(args.num_prompts)
    process, url = (None, args.url) if args.url else start_server(args)
    try:
        asyncio.run(run_rate(url, args, prompts[:1], math.inf, 0))  # warm-up: first-call costs out of the numbers
        rows = [asyncio.run(run_rate(url, args, prompts, rate, i)) for i, rate in enumerate(rates, start=1)]
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    print_table(rows)
    settings = {k: v for k, v in vars(args).items() if k != "json"} | {"json": str(args.json) if args.json else None}
    path = write_results({"settings": settings, "machine": machine_info(), "results": rows}, "serve", args.json)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
