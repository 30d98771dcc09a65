"""Running ``aiayn serve``: its options (checked before the run is loaded), binding the socket, uvicorn, the graceful
stop, and the subcommand's flags.

It binds 127.0.0.1 unless ``--host`` says otherwise. SIGTERM or Ctrl-C stop it gracefully: no new
connection is taken, the requests in flight are answered, then the process exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiayn.errors import ConfigError, UserError, require
from aiayn.serve.batcher import Batching
from aiayn.serve.schemas import API_KEY_ENV, Limits

if TYPE_CHECKING:
    from aiayn.serve.service import Choices

log = logging.getLogger("aiayn.serve")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), or a one-line error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and without it a keep-alive
    # client's every request after the first waited ~40 ms (Nagle's algorithm against the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class RedactKeys(logging.Filter):
    """Hides an ``api_key`` given in a URL's query string from the access log (LibreTranslate's routes refuse such
    a request, but uvicorn logs its line, URL included, all the same)."""

    QUERY_KEY = re.compile(r"([?&]api_key=)[^&\s]*", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.QUERY_KEY.sub(r"\1[hidden]", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


def redact_access_log() -> None:
    """Install :class:`RedactKeys` on uvicorn's access logger (once per process)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactKeys) for f in access.filters):
        access.addFilter(RedactKeys())


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """How ``aiayn serve`` runs, checked when built (before the run is loaded or a port is bound)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free one, printed at start
    device: str = "auto"
    precision: str = "auto"
    max_batch_tokens: int | None = None  # default: the device's decoding budget
    max_wait_ms: float = 10.0
    max_queue: int = 256
    workers: int | None = None  # model calls side by side, each on its share of the CPU threads (None: 1)
    limits: Limits = field(default_factory=Limits)
    access_log: bool = False
    allow_hosts: tuple[str, ...] = ()  # Host names allowed beside the loopback ones and the bound address; "*": any
    cors: str | None = None  # the one other origin (scheme://host[:port]) whose pages may call the API
    api_key: str | None = None  # every API request must carry it (aiayn.serve.service); None: no key
    api_key_from: str = "--api-key"  # where the key came from, for the message that refuses it ($AIAYN_API_KEY)
    # the decoding flags (DecodeOptions field names): they replace the run's decode section on every route
    decode: dict = field(default_factory=dict)
    model_aliases: tuple[str, ...] = ()  # other model names OpenAI's routes answer to (--model-alias)
    # LibreTranslate's routes: sentence by sentence, and formatted as LibreTranslate formats (both on by default)
    split_sentences: bool = True
    libre_formatting: bool = True

    def batching(self) -> Batching:
        """How the server batches its model calls (checked: a one-line ConfigError for a flag out of range)."""
        workers = 1 if self.workers is None else self.workers
        return Batching(self.max_batch_tokens, self.max_wait_ms, self.max_queue, workers)

    def choices(self) -> Choices:
        """What the operator chose beyond the run, as the routes read it."""
        from aiayn.serve.service import Choices  # starlette's, imported once a server starts

        return Choices(self.decode, self.model_aliases, self.split_sentences, self.libre_formatting)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: expected 1-65535 (or 0 for a free port)")
        self.batching()
        if self.cors is not None and not re.fullmatch(r"https?://[^/\s]+", self.cors):
            raise ConfigError(f"--cors {self.cors!r}: expected an origin, e.g. https://example.org (no path)")
        for name in self.allow_hosts:
            if not name or "/" in name or " " in name:
                raise ConfigError(f"--allow-host {name!r}: expected a host name or address (or * for any)")
        if self.api_key is not None and (len(self.api_key) < 8 or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ConfigError(f"{self.api_key_from}: expected at least 8 printable characters without spaces")
        if self.decode.get("max_tokens") is not None and self.max_batch_tokens is not None:
            raise ConfigError("--max-tokens and --max-batch-tokens both set the tokens of one model call: give one")
        for name in self.model_aliases:
            if not name or not name.isprintable():
                raise ConfigError(f"--model-alias {name!r}: expected a model name (printable, not empty)")
        from aiayn.config import DecodeOptions

        DecodeOptions().replace(**self.decode)  # a value no run takes (--beam 0) fails before the run is loaded

    def access(self, bound_host: str):
        """Who may call the server: the loopback names, the bound address when it is not a wildcard, and what
        ``--allow-host`` adds (:class:`aiayn.serve.app.Access`)."""
        from aiayn.serve.app import LOOPBACK_NAMES, Access

        bound = [] if ipaddress.ip_address(bound_host).is_unspecified else [bound_host.lower()]
        extra = [h.lower().strip("[]") for h in self.allow_hosts]
        return Access(tuple(dict.fromkeys([*LOOPBACK_NAMES, self.host.lower(), *bound, *extra])), self.cors)


def serve(run_dir: str, options: ServeOptions | None = None) -> int:
    """Load the run, bind, serve until SIGTERM / Ctrl-C, then finish the requests in flight. Returns 0."""
    require("starlette", "serve", "aiayn serve")
    require("uvicorn", "serve", "aiayn serve")
    import torch
    import uvicorn

    from aiayn.decode.open_run import open_run
    from aiayn.engine import set_cpu_threads
    from aiayn.serve.app import create_app, warm_up
    from aiayn.serve.chat_template import load_chat_template

    o = options or ServeOptions()
    # The model computes on the batcher's threads with the CPU threads aiayn.cli chose (--threads, else the free
    # cores), shared out among its --workers; this thread, which answers HTTP, keeps to one. GNU OpenMP spins a
    # waiting team only while its teams hold no more threads than there are CPUs: a team of this thread's too made it
    # sleep and wake at every operation of the model's thread, and a 2-thread server decoded at half its speed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = open_run(run_dir, o.device, o.precision)  # a bad run or device fails here, before binding
    model.cfg.decode.replace(**o.decode)  # and decoding flags the run's section refuses (--nbest over its beam)
    load_chat_template(model.run)  # and a chat template of the run's own that does not parse
    sock = listen(o.host, o.port)
    bound_host, bound_port = sock.getsockname()[:2]
    batching = o.batching()
    workers = batching.workers
    shares = [max(1, threads // workers + (i < threads % workers)) for i in range(workers)]  # each worker's threads
    app = create_app(model, batching, o.limits, o.access(bound_host), o.api_key, o.choices())

    try:
        app.state.service.batcher.setup(lambda worker: (set_cpu_threads(shares[worker]), warm_up(model)))
    except BaseException:
        sock.close()
        raise
    config = uvicorn.Config(app, log_config=None, access_log=o.access_log, timeout_graceful_shutdown=60,
                            lifespan="on")
    redact_access_log()
    server = uvicorn.Server(config)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    if not ipaddress.ip_address(bound_host).is_loopback and o.api_key is None:
        log.warning("aiayn serve: listening on %s: anyone who can reach this machine can use the model "
                    "(--api-key or $%s asks every request for a key)", bound_host, API_KEY_ENV)
    log.info("aiayn serve: %d model call(s) side by side, CPU threads %s", workers, "+".join(map(str, shares)))
    print(f"aiayn serve: {model.cfg.task} run {run_dir} on {model.device}: http://{shown}:{bound_port}/ "
          "(Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    # uvicorn catches SIGTERM / SIGINT, shuts down gracefully, then re-raises the signal to whatever handler
    # was there before: a no-op one, so that a requested stop ends with status 0, not as killed by a signal.
    stopped = []
    previous = {sig: signal.signal(sig, lambda s, f: stopped.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if not server.started:
        raise UserError(f"aiayn serve: the server did not start on {o.host}:{bound_port} (see the log above)")
    log.info("aiayn serve: stopped")
    return 0


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """The serve subcommand's own flags (the decoding and device flags come from the CLI's add_decode_options,
    built from DecodeOptions as translate's are)."""
    p.add_argument("run", help="run directory (translation, summarization or language model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="source tokens x beam merged into one model call (default: the device's decoding budget)")
    p.add_argument("--max-wait-ms", type=float, default=10.0,
                   help="how long a request waits for others to share its model call (default 10; not when one "
                        "client sends one request at a time)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most; then 503 (default 256)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="model calls that run side by side, each on its share of --threads (default 1; on a CPU "
                        "under load from many clients, 2 served more and steadier: BENCHMARKS.md, section 4e)")
    p.add_argument("--max-sentences", type=int, default=Limits.max_sentences, metavar="N",
                   help="texts per request: sentences to translate, prompts (x n) of a completion (default "
                        f"{Limits.max_sentences}; LangChain's OpenAI sends batch_size prompts at once)")
    p.add_argument("--char-limit", type=int, default=-1, metavar="N",
                   help="LibreTranslate's routes: characters per text (default -1: none, as LibreTranslate)")
    p.add_argument("--batch-limit", type=int, default=-1, metavar="N",
                   help="LibreTranslate's routes: texts per request (default -1: none, as LibreTranslate)")
    p.add_argument("--split-sentences", action=argparse.BooleanOptionalAction, default=True,
                   help="LibreTranslate's routes translate a text sentence by sentence, with the splitter an Argos "
                        "package ships, and join them as Argos does (default: on)")
    p.add_argument("--libre-formatting", action=argparse.BooleanOptionalAction, default=True,
                   help="LibreTranslate's routes format a translation as LibreTranslate does: the source's final "
                        "mark and case carried over (default: on)")
    p.add_argument("--max-beam", type=int, default=16, help="largest beam (and nbest) a request may ask (16)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (default: the loopback names and the "
                        "bound address only; * for any: then any web page can reach a server on this machine)")
    p.add_argument("--cors", default=None, metavar="ORIGIN",
                   help="let pages of ORIGIN (e.g. https://example.org) call the API from a browser (default: none)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"every API request must carry KEY (Authorization: Bearer KEY, or LibreTranslate's api_key "
                        f"field; default ${API_KEY_ENV}, else none)")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="OpenAI's routes also answer to the model name NAME (default: the run directory's name only; "
                        "e.g. gpt-3.5-turbo, the name LangChain's ChatOpenAI sends unless told)")


def serve_cli(args: argparse.Namespace, decode: dict | None = None) -> int:
    """``aiayn serve`` from parsed arguments; ``decode``: the decoding flags given, by DecodeOptions field name."""
    limits = Limits(max_sentences=args.max_sentences, max_beam=args.max_beam, max_nbest=args.max_beam,
                    char_limit=args.char_limit, batch_limit=args.batch_limit)
    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    key_from = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
    options = ServeOptions(host=args.host, port=args.port, device=args.device, precision=args.precision,
                           max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                           max_queue=args.max_queue, workers=args.workers, limits=limits, access_log=args.access_log,
                           allow_hosts=tuple(args.allow_host), cors=args.cors, api_key=key, api_key_from=key_from,
                           decode=dict(decode or {}), model_aliases=tuple(args.model_alias),
                           split_sentences=args.split_sentences, libre_formatting=args.libre_formatting)
    return serve(args.run, options)
