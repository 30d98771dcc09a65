"""Load test of ``aiayn serve`` on loopback: N concurrent clients for a fixed time against one server.

    python -m benchmarks.serve_load --run runs/multi30k_en_de_quick            # 1 and 8 clients, 60 s each
    python -m benchmarks.serve_load --run RUN --smoke --md /tmp/B.md            # seconds (CI)

The server is a subprocess (``aiayn serve RUN --port 0``, 127.0.0.1 only). Each client is a thread
with one keep-alive connection that posts one sentence at a time (Multi30k test sources when
``$AIAYN_DATA_DIR`` has them, else synthetic sentences) and waits for the answer. Bounded twice: by
``--duration`` seconds per phase and by ``--max-requests`` per phase. Reported per phase: requests,
sentences/s, latency p50/p90/p99/max, errors by status (goal: zero 5xx), mean requests per model call
(the dynamic batching at work, from /health), and the server's resident memory sampled every second
(goal: flat: the growth over the second half of a phase stays within a few MiB). At the end the
server gets SIGTERM and must exit 0. Writes the ``serve_load`` section of BENCHMARKS.md and a JSON file.

The peer: where ``$AIAYN_LIBRETRANSLATE`` names a LibreTranslate executable (benchmarks/libretranslate_peer.py), a
real LibreTranslate server on the same run's Argos package (``aiayn export argos``), with LibreTranslate's and Argos'
defaults, gets the same phases after aiayn's, its clients posting LibreTranslate's ``/translate``; elsewhere the
section says why it was not measured. ``--no-peer`` leaves it out. aiayn serves with the run's own search (its
config's decode section: ``stop=exact`` by default), the peer with Argos' (``stop=first``, alpha 0.2);
``--argos-search`` gives aiayn Argos' search too (:data:`aiayn.interop.argos.ARGOS_FLAGS`), the same search on both.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn.interop.argos import ARGOS_FLAGS

# The server ---------------------------------------------------------------------------------------------


def server_args(run: str | os.PathLike, *extra: str) -> list[str]:
    """The ``aiayn`` arguments of the server under test: ``serve RUN --port 0 --device cpu EXTRA...``."""
    return ["serve", str(run), "--port", "0", "--device", "cpu", *extra]


def start_server(run: str | os.PathLike, *extra: str, timeout: float = 120.0, cwd: os.PathLike | None = None,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, list]:
    """``python -m aiayn serve RUN --port 0 --device cpu EXTRA...`` as a subprocess (in ``cwd``, with ``env``:
    by default this process's); returns the process, its base URL (``http://127.0.0.1:PORT``) once it listens,
    and the list its stderr lines go to. The server binds a free port itself: a port probed here first could be
    another process's by the time the server binds it."""
    cmd = [sys.executable, "-m", "aiayn", *server_args(run, *extra)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8", errors="replace", cwd=cwd, env=env)
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def drain() -> None:  # read stderr to the end, so that the server never blocks on a full pipe
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            m = re.search(r"(http://[^/\s]+)/", line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(timeout) or not url:
        proc.kill()
        proc.wait()
        raise RuntimeError("aiayn serve did not start:\n" + "\n".join(lines[-20:]))
    return proc, url[0], lines


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then the exit status (killed after ``timeout`` seconds: status -9)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


def request(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request on a keep-alive connection: (status, decoded JSON or None)."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


def connect(url: str, timeout: float = 120.0) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (Linux /proc), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# The clients --------------------------------------------------------------------------------------------


def sentences(run: str | os.PathLike, limit: int = 1000) -> tuple[list[str], str]:
    """Source sentences to send: Multi30k test_2016_flickr of the run's source language, else synthetic."""
    try:
        from aiayn.config import load_config
        from aiayn.data.datasets import multi30k_split

        data = load_config(Path(run) / "config.yaml").data
        if data.dataset == "multi30k" and os.environ.get("AIAYN_DATA_DIR"):
            pairs = multi30k_split("test_2016_flickr", data.src_lang, data.tgt_lang)[:limit]
            return [s for s, _ in pairs], f"Multi30k test_2016_flickr {data.src_lang} ({len(pairs)} sentences)"
    except Exception:  # no data here: synthetic sentences still load the server the same way
        pass
    words = "a man woman dog child runs walks on the street with red ball in park two people".split()
    out = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(4 + i % 9)) for i in range(limit)]
    return out, f"synthetic word sequences ({limit})"


@dataclass
class Shared:
    """What a phase's clients share: the deadline, the requests left (under the lock) and the results
    (latency in seconds, HTTP status; 0 for a connection failure)."""

    deadline: float
    budget: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    out: list[tuple[float, int]] = field(default_factory=list)


Post = Callable[[http.client.HTTPConnection, str], int]  # one sentence's request on a connection -> its status


def aiayn_post(options: dict) -> Post:
    """``aiayn serve``'s ``POST /v1/translate`` of one sentence with ``options``."""
    return lambda conn, text: request(conn, "POST", "/v1/translate", {"text": [text], **options})[0]


def libretranslate_post(source: str, target: str) -> Post:
    """LibreTranslate's ``POST /translate`` of one sentence, as its clients send it."""
    return lambda conn, text: request(conn, "POST", "/translate", {"q": text, "source": source, "target": target,
                                                                   "format": "text"})[0]


def client(url: str, texts: Sequence[str], offset: int, stride: int, post: Post, shared: Shared) -> None:
    """Post one sentence at a time until the deadline or the shared request budget runs out."""
    conn = connect(url)
    i = offset
    deadline, lock, out = shared.deadline, shared.lock, shared.out
    try:
        while time.monotonic() < deadline:
            with lock:
                if shared.budget <= 0:
                    return
                shared.budget -= 1
            t0 = time.perf_counter()
            try:
                status = post(conn, texts[i % len(texts)])
            except (OSError, http.client.HTTPException):
                status = 0  # connection failure
                conn.close()
                conn = connect(url)
            out.append((time.perf_counter() - t0, status))
            i += stride
    finally:
        conn.close()


def phase(url: str, pid: int, texts: Sequence[str], clients: int, duration: float, max_requests: int,
          post: Post, health: bool = True) -> dict[str, Any]:
    """``clients`` clients for ``duration`` seconds (at most ``max_requests`` requests); the numbers. ``health``:
    the server counts its model calls at ``/health`` (aiayn's; LibreTranslate has none)."""
    def calls_and_jobs() -> dict[str, Any]:
        if not health:
            return {"calls": 0, "jobs": 0, "busy_s": 0.0}
        with closing(connect(url)) as conn:
            return request(conn, "GET", "/health")[1]

    before = calls_and_jobs()
    load_before = os.getloadavg()[0]
    memory: list[tuple[float, float]] = []
    start = time.monotonic()
    shared = Shared(start + duration, max_requests)
    results = shared.out
    threads = [threading.Thread(target=client, args=(url, texts, k, clients, post, shared))
               for k in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        rss = rss_mib(pid)
        if rss is not None:
            memory.append((round(time.monotonic() - start, 1), round(rss, 1)))
        time.sleep(min(1.0, max(0.05, duration / 20)))
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    after = calls_and_jobs()
    load_after = os.getloadavg()[0]
    ok = sorted(lat for lat, s in results if s == 200)
    statuses = Counter(s for _, s in results)
    calls = after["calls"] - before["calls"]

    def pct(p: float) -> float | None:
        return round(1000 * ok[min(len(ok) - 1, int(p / 100 * len(ok)))], 1) if ok else None

    half = [m for t, m in memory if t >= elapsed / 2]
    return {
        "clients": clients, "seconds": round(elapsed, 1), "requests": len(results), "ok": len(ok),
        "errors": {str(k): v for k, v in sorted(statuses.items()) if k != 200},
        "errors_5xx": sum(v for k, v in statuses.items() if k >= 500 or k == 0),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99),
                       "max": round(1000 * ok[-1], 1) if ok else None,
                       "mean": round(1000 * statistics.fmean(ok), 1) if ok else None},
        "model_calls": calls if health else None,
        "requests_per_call": round((after["jobs"] - before["jobs"]) / calls, 2) if calls else None,
        # the share of the phase the model worked (summed over workers): the rest it waited for requests
        "model_busy": round((after["busy_s"] - before["busy_s"]) / elapsed, 3) if health else None,
        "rss_mib": {"start": memory[0][1] if memory else None, "end": memory[-1][1] if memory else None,
                    "max": max(m for _, m in memory) if memory else None,
                    "second_half_growth": round(half[-1] - half[0], 1) if len(half) > 1 else None},
        "rss_series": memory,
        "load_average_1min": [round(load_before, 2), round(load_after, 2)],  # the machine's, clients included
    }


# Report -------------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    from benchmarks.common import markdown_table, provenance

    rows = []
    peer = result.get("peer") or {"skipped": "not run"}
    servers = [("aiayn", p) for p in result["phases"]] + [("LibreTranslate", p) for p in peer.get("phases", [])]
    for server, p in servers:
        lat, mem = p["latency_ms"], p["rss_mib"]
        rows.append([server, p["clients"], p["seconds"], p["requests"], p["requests_per_s"], lat["p50"], lat["p90"],
                     lat["p99"], lat["max"], p["requests_per_call"],
                     "" if p.get("model_busy") is None else f"{100 * p['model_busy']:.0f}%", p["errors_5xx"],
                     sum(v for k, v in p["errors"].items() if k.startswith("4")),
                     f"{mem['start']} / {mem['max']} / {mem['end']}", mem["second_half_growth"],
                     " / ".join(map(str, p["load_average_1min"]))])
    table = markdown_table(["server", "clients", "seconds", "requests", "sentences/s", "p50 ms", "p90 ms", "p99 ms",
                            "max ms", "requests per model call", "model busy", "5xx", "4xx",
                            "server RSS MiB start / max / end",
                            "RSS growth, 2nd half (MiB)", "load avg before / after"], rows)
    return (
        "## 4. Serving under load (`aiayn serve`, loopback, CPU)\n\n"
        + provenance(result["machine"], result["command"], result["date"])
        + f"\n- Run: `{result['run']}` ({result['parameters'] / 1e6:.2f}M parameters); inputs: {result['inputs']}; "
        f"each request is one sentence, options {json.dumps(result['options'])}.\n"
        f"- Server: `{result['server_command']}`; clients are threads on the same machine, each with one "
        "keep-alive connection, sending the next request when the last is answered.\n"
        f"- Shutdown: SIGTERM after the last phase, exit status {result['exit_status']} (0 = graceful).\n\n"
        + table + peer_lines(result["phases"], peer)
        + "\nGoals: zero 5xx in every phase; memory flat (RSS growth over the second half of a phase within a "
        "few MiB). Requests per model call above 1 is the dynamic batching merging concurrent requests. Model busy: "
        "the share of the phase the model spent in its calls (summed over `--workers`; the rest it waited for "
        "requests: each client sends its next request only after its answer). The load "
        "average (1 minute, whole machine, the clients included) says how much else ran on the cores.\n"
    )


def phases_of(name: str, url: str, pid: int, texts: Sequence[str], args: argparse.Namespace, post: Post
              ) -> list[dict[str, Any]]:
    """One phase per ``--clients`` count against the server at ``url`` (process ``pid``), each printed."""
    phases = []
    for n in args.clients:
        phases.append(phase(url, pid, texts, n, args.duration, args.max_requests, post, health=name == "aiayn"))
        p = phases[-1]
        print(f"{name}, {n} clients: {p['requests_per_s']} sentences/s, p50 {p['latency_ms']['p50']} ms, "
              f"p99 {p['latency_ms']['p99']} ms, {p['errors_5xx']} 5xx, {p['requests_per_call']} requests/call, "
              f"RSS {p['rss_mib']}", file=sys.stderr, flush=True)
    return phases


def measure_peer(args: argparse.Namespace, texts: Sequence[str]) -> dict[str, Any]:
    """The same phases against a real LibreTranslate server on the run's Argos package (its defaults), or why not."""
    import tempfile

    from aiayn.config import load_config
    from benchmarks import libretranslate_peer

    exe, why = libretranslate_peer.executable()
    if exe is None:
        print(f"[serve_load] LibreTranslate not measured: {why}", file=sys.stderr)
        return {"skipped": why}
    data = load_config(Path(args.run) / "config.yaml").data
    names = ("libretranslate", "argostranslate", "ctranslate2")
    script = f"import importlib.metadata as m; print(*(m.version(n) for n in {names}))"
    version = subprocess.run([str(Path(exe).with_name("python")), "-c", script], capture_output=True,
                             text=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="serve-load-lt-") as root:
        server = libretranslate_peer.start(args.run, root, exe, (data.src_lang, data.tgt_lang))
        try:
            post = libretranslate_post(data.src_lang, data.tgt_lang)
            with closing(connect(server.url)) as conn:
                for t in texts[:4]:  # warm-up, not counted
                    post(conn, t)
            phases = phases_of("LibreTranslate", server.url, server.proc.pid, texts, args, post)
        finally:
            status = server.stop()
    return {"name": "LibreTranslate", "versions": dict(zip(names, version)),
            "argos_settings": server.argos_env, "exit_status": status, "phases": phases,
            "server_command": f"libretranslate --load-only {data.src_lang},{data.tgt_lang} --disable-web-ui "
                              "(the run exported by aiayn export argos, installed offline)"}


def peer_lines(ours: list[dict[str, Any]], peer: dict[str, Any]) -> str:
    """What the table says of aiayn against LibreTranslate: sentences/s and p50 per client count (issue 69's goals:
    >= 4x its sentences/s at 8 clients; aiayn's p50 at 1 client <= 26 ms), or why the peer was not measured."""
    if "skipped" in peer:
        return f"\nLibreTranslate: not measured ({peer['skipped']}).\n"
    versions = ", ".join(f"{k} {v}" for k, v in peer["versions"].items())
    lines = [f"\nLibreTranslate ({versions}; `{peer['server_command']}`; Argos settings "
             f"{json.dumps(peer['argos_settings'])}, the rest their defaults; exit status {peer['exit_status']}), "
             "the same sentences and clients:"]
    theirs = {p["clients"]: p for p in peer["phases"]}
    for p in ours:
        q = theirs.get(p["clients"])
        if q and q["requests_per_s"]:
            lines.append(f"- {p['clients']} client(s): aiayn {p['requests_per_s']} sentences/s = "
                         f"{p['requests_per_s'] / q['requests_per_s']:.2f}x LibreTranslate's {q['requests_per_s']}; "
                         f"p50 {p['latency_ms']['p50']} against {q['latency_ms']['p50']} ms")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from benchmarks.common import DEFAULT_MD, RESULTS_DIR

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n")[0])
    p.add_argument("--run", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients, one phase each")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--max-requests", type=int, default=100_000, help="requests per phase at most")
    p.add_argument("--beam", type=int, default=None, help="beam of every request (default: the run's)")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="the server's --max-wait-ms")
    p.add_argument("--precision", default=None, help="the server's --precision (default: its own, auto)")
    p.add_argument("--server-threads", type=int, default=None, help="the server's --threads (default: its own)")
    p.add_argument("--server-workers", type=int, default=None, help="the server's --workers (default: its own)")
    p.add_argument("--argos-search", action="store_true",
                   help="serve with Argos' search (aiayn.interop.argos.ARGOS_FLAGS: beam 4, alpha 0.2, stop=first, "
                   "...), the search the LibreTranslate peer runs, instead of the run's own")
    p.add_argument("--smoke", action="store_true", help="seconds-long: 2 phases (1 and 4 clients) of 2 s")
    p.add_argument("--no-peer", action="store_true",
                   help="leave out the LibreTranslate server ($AIAYN_LIBRETRANSLATE) measured after aiayn's")
    p.add_argument("--md", default=str(DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=str(RESULTS_DIR / "serve_load.json"))
    args = p.parse_args(argv)
    from benchmarks.common import check_outputs

    check_outputs(p, args.md, args.out_json)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from benchmarks.common import command_line, machine_info, update_section, utc_now, write_json

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        args.clients, args.duration, args.max_requests = [1, 4], 2.0, 400
    texts, inputs = sentences(args.run)
    options = {} if args.beam is None else {"beam": args.beam}
    extra = ["--max-wait-ms", str(args.max_wait_ms)] + (["--precision", args.precision] if args.precision else [])
    extra += ["--threads", str(args.server_threads)] if args.server_threads else []
    extra += ["--workers", str(args.server_workers)] if args.server_workers else []
    extra += ARGOS_FLAGS.split() if args.argos_search else []
    proc, url, log_lines = start_server(args.run, *extra)
    try:
        with closing(connect(url)) as conn:
            info = request(conn, "GET", "/v1/model")[1]
            for t in texts[:4]:  # warm-up, not counted
                request(conn, "POST", "/v1/translate", {"text": [t], **options})
        phases = phases_of("aiayn", url, proc.pid, texts, args, aiayn_post(options))
    finally:
        status = stop_server(proc)
    if status != 0:
        print("\n".join(log_lines[-20:]), file=sys.stderr)
    peer = {"skipped": "--no-peer"} if args.no_peer else measure_peer(args, texts)
    md_argv = [a for a in argv if a not in ("--md", args.md, "--out-json", args.out_json)]
    result = {
        "date": utc_now(), "command": command_line("serve_load", md_argv), "machine": machine_info(os.cpu_count() or 1),
        "run": str(args.run), "parameters": info["parameters"], "inputs": inputs,
        "options": {**{k: info["decode"][k] for k in ("beam", "alpha", "length_penalty", "stop")}, **options},
        "server_command": " ".join(["aiayn", *server_args(args.run, *extra)]),
        "exit_status": status, "phases": phases, "peer": peer,
    }
    write_json(args.out_json, result)
    update_section(args.md, "serve_load", markdown(result))
    return result


if __name__ == "__main__":
    main()
