"""``aiayn launch [torchrun's options] train ...``: ``torchrun [the same options] -m aiayn train ...`` that ends in one
line of aiayn's.

The same agent as torchrun's (``torch.distributed.run``, in this process), with what torchrun itself prints kept out
of the user's way (docs/distributed.md, "aiayn launch"):

- the agent's own output (its logs, a traceback, the C++ stack traces of a store that is gone) goes to a log file;
  the training processes write to the user's stderr as under torchrun (:mod:`aiayn.launched`: each opens the
  launcher's saved stderr again, through ``/proc``; where that cannot be done, the agent writes to it as well);
- when the job ends without success, the last line on stderr is this one (:func:`ending`): what ended it (a
  process's own line, a node lost with none in its place within the rendezvous' ``join_timeout``, the rendezvous
  host gone, a signal), the exact command that goes on from the newest checkpoint, and where the log is;
- an elastic rendezvous waits at most ``train.setup_timeout_s`` of the training's config for its nodes to meet: the
  ``join_timeout`` it is given is the shorter of that and the user's (``--rdzv-conf join_timeout=S``, else 600 s);
  the log's first line says which (:meth:`Launch.join_timeout`);
- the exit status: 0; a failed process's own (2 for aiayn's one-line errors, 1 for a bug, 128+N for signal N);
  2 when the nodes did not meet (a lost node, the rendezvous gone); 128+N for a signal to the launcher.

The log ends as RUN/logs/launch-HOST-PID.log when RUN is a run by then (its marker written), else it stays in the
temporary folder it was written to (``aiayn-launch-*`` in ``$TMPDIR``), which is then kept, holding that log alone,
only when the last line names it: a job that succeeded, was refused, or whose log moved into its run leaves no
temporary folder, and neither does torchrun's own log folder (its workers' error files), which is made inside it. The
launcher's process ends right after its last line (``os._exit``): nothing that torch prints at interpreter exit comes
after it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from aiayn.errors import ConfigError, one_line, user_error_message
from aiayn.files import MARKER
from aiayn.launched import DIR_ENV, STDERR_ENV, read_members
from aiayn.run.weights import list_checkpoints

JOIN_TIMEOUT_S = 600  # the c10d rendezvous' join_timeout when --rdzv-conf does not set it (torch's default)
LOG = "torchrun.log"  # the agent's own output, in the launcher's temporary folder


@dataclass(kw_only=True)
class Launch:
    """One ``aiayn launch``: torchrun's options as given and as parsed, aiayn's command, and what the last line
    needs (set by the command line: :func:`aiayn.cli.cmd_launch`)."""

    options: list[str]  # torchrun's options, as the user wrote them
    command: list[str]  # aiayn's command line: train ...
    args: argparse.Namespace  # torchrun's options parsed by torchrun's own parser
    run_dir: Path | None = None
    resume: str = ""  # the command that goes on from the run's newest checkpoint
    again: str = ""  # the command as given (a run that wrote nothing starts again with it)
    here: tuple[str, int] = field(default_factory=lambda: (socket.gethostname(), os.getpid()))  # this agent
    setup_timeout_s: float | None = None  # the training's train.setup_timeout_s (None: its config unread)

    @property
    def nodes(self) -> str:
        return str(self.args.nnodes)

    def rdzv_conf(self) -> dict[str, str]:
        """``--rdzv-conf`` as torchrun reads it (checked by :func:`check_options`)."""
        return rdzv_conf(self.args)

    def join_timeout(self) -> tuple[int, bool]:
        """The seconds an elastic rendezvous waits for the job's nodes to meet (torchrun's ``join_timeout``, whole
        seconds), and whether ``train.setup_timeout_s`` set them: the user's (``--rdzv-conf join_timeout=S``, else
        torch's 600 s), or the training's ``train.setup_timeout_s`` (at least 1 s) where that is shorter."""
        user = int(self.rdzv_conf().get("join_timeout", JOIN_TIMEOUT_S))
        setup = self.setup_timeout_s
        if setup is None or user <= setup or not (self.args.standalone or self.args.rdzv_backend != "static"):
            return user, False  # torchrun's static rendezvous (--master-addr) has no join_timeout
        return max(1, int(setup)), True

    def join_note(self, args: argparse.Namespace) -> str:
        """The log's first line: the ``--rdzv-conf`` torchrun is given (``args``) and where its join_timeout is
        from."""
        seconds, bounded = self.join_timeout()
        user = "--rdzv-conf" if "join_timeout" in self.rdzv_conf() else f"torch's default, {JOIN_TIMEOUT_S} s"
        whose = f"train.setup_timeout_s={self.setup_timeout_s:g}, shorter than {user}" if bounded else user
        return f"aiayn launch: torchrun's --rdzv-conf {args.rdzv_conf!r}: join_timeout={seconds} s (from {whose})\n"

    def torchrun_args(self, folder: Path) -> argparse.Namespace:
        """torchrun's options as given, but with :meth:`join_timeout` in ``--rdzv-conf`` (the user's other entries
        kept) and, unless a ``--log-dir`` is given or needed (``--redirects``, ``--tee``), torchrun's own log folder
        inside ``folder`` rather than a ``torchelastic_*`` folder of its own in $TMPDIR, which it never removes."""
        args = copy.copy(self.args)
        seconds, bounded = self.join_timeout()
        if bounded:
            args.rdzv_conf = ",".join(f"{k}={v}" for k, v in {**self.rdzv_conf(), "join_timeout": seconds}.items())
        if args.log_dir is None and args.redirects == "0" and args.tee == "0":
            args.log_dir = str(folder / "torchelastic")
        return args

    def joined_within(self) -> str:
        """The bound on the rendezvous' wait, as the last line names it."""
        seconds, bounded = self.join_timeout()
        if bounded:
            return f"train.setup_timeout_s ({seconds} s, which bounds the rendezvous' join_timeout)"
        return f"the rendezvous' join_timeout ({seconds} s; --rdzv-conf join_timeout=S sets it)"

    def endpoint(self) -> str:
        if self.args.rdzv_endpoint:
            return str(self.args.rdzv_endpoint)
        return f"{self.args.master_addr}:{self.args.master_port or 29500}"


def parse_launch(argv: list[str]) -> Launch:
    """Split ``argv`` into torchrun's options and aiayn's command with torchrun's own parser (its usage and exit 2
    for an option it does not know). aiayn starts itself: ``-m``, ``--no-python`` and ``--run-path`` are refused."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "aiayn launch"
    parser.usage = "aiayn launch [torchrun's options] train CONFIG --run-dir RUN ... (or train --resume RUN)"
    parser.error = lambda message: parser.exit(  # type: ignore[method-assign]
        2, f"aiayn: error: {one_line(message)} (aiayn launch --help lists torchrun's options)\n")
    args = parser.parse_args(argv)
    if args.module or args.no_python or args.run_path:
        raise ConfigError("aiayn launch starts aiayn itself: leave out -m/--module, --no-python and --run-path "
                          "(aiayn launch [torchrun's options] train ...)")
    command = [args.training_script, *args.training_script_args]
    if args.training_script != "train":
        raise ConfigError(f"aiayn launch runs aiayn train under torchrun, not {args.training_script!r}: aiayn launch "
                          "[torchrun's options] train CONFIG --run-dir RUN")
    args.module, args.training_script, args.training_script_args = True, "aiayn", command
    check_options(args)
    return Launch(options=argv[: len(argv) - len(command)], command=command, args=args)


def check_options(args: argparse.Namespace) -> None:
    """What torchrun checks of its options only once it runs (``--nnodes 2:1``, ``--nproc-per-node abc``,
    ``--max-restarts -1``, an endpoint without a port number), checked first: one line, exit 2, nothing started.
    torchrun's own check on a copy of the options, without its warnings and without its changes to the environment."""
    import logging

    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import config_from_args

    trial, environ = copy.deepcopy(args), dict(os.environ)
    trial.log_dir = trial.log_dir or os.devnull  # else its log spec makes a torchelastic_* folder in $TMPDIR, for good
    if trial.standalone:  # as torchrun's run() sets them
        trial.rdzv_backend, trial.rdzv_endpoint, trial.rdzv_id = "c10d", "localhost:0", "check"
    logging.disable(logging.WARNING)
    try:
        config = config_from_args(trial)[0]
        if config.nproc_per_node < 1:  # torchrun's agent asserts it, once started
            raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
        if trial.rdzv_endpoint:
            parse_rendezvous_endpoint(trial.rdzv_endpoint, default_port=29400)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ConfigError(f"torchrun's options: {one_line(e)}") from None
    finally:
        logging.disable(logging.NOTSET)
        os.environ.clear()
        os.environ.update(environ)
    given = rdzv_conf(args).get("join_timeout")
    if given is not None and not (given.isdigit() and int(given) > 0):  # torch's int(), once its nodes meet
        raise ConfigError(f"torchrun's options: --rdzv-conf join_timeout={given}: expected a whole number of seconds "
                          "above 0")


def setup_timeout_of(config: str | None, resume: str | None, overrides: list[str]) -> float | None:
    """``train.setup_timeout_s`` of the training command: its recipe ``config`` or the run ``resume`` (``--resume
    RUN``: RUN/config.yaml) with its ``--set`` ``overrides``, read as ``aiayn train`` reads them; None when they
    cannot be read (the training's processes refuse them, each in its line, as without the launcher)."""
    from aiayn.config.loading import load_config, read_run_config

    try:
        cfg = read_run_config(resume, overrides) if resume is not None else load_config(config or "", overrides)
    except Exception as e:  # noqa: BLE001 - the user's input: the training says why; a bug is raised
        if user_error_message(e) is None:
            raise
        return None
    return float(cfg.train.setup_timeout_s)


def rdzv_conf(args: argparse.Namespace) -> dict[str, str]:
    """torchrun's ``--rdzv-conf`` as torchrun reads it (its own parser)."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    return _parse_rendezvous_config(args.rdzv_conf or "")


def launch(job: Launch) -> NoReturn:
    """Run the job as torchrun would, then end this process with :func:`ending`'s status and line (see the module
    docstring)."""
    from torch.distributed.run import run

    folder = Path(tempfile.mkdtemp(prefix="aiayn-launch-"))
    log = folder / LOG
    args = job.torchrun_args(folder)
    log.write_text(job.join_note(args), encoding="utf-8")
    os.environ[DIR_ENV] = str(folder)
    with _kept_out(log) as (user_stderr, kept):
        error: BaseException | None = None
        try:
            run(args)
        except BaseException as e:  # noqa: BLE001 - every end is reported in one line, its traceback in the log
            error = e
            traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        members = read_members(folder)
        named: Path | None = None  # the log the last line names
        if refusal_of(error) is None and kept:  # a refusal's line says it all; unkept, the output was on stderr
            named = _settle(log, folder, job.run_dir, job.here)
        code, line = ending(error, job, named, members)
        _tidy(folder, named if line and named is not None and named.parent == folder else None)
        if line:
            _write_last(user_stderr, line)
    sys.stdout.flush()
    os._exit(code)


def _tidy(folder: Path, keep: Path | None) -> None:
    """The launcher's temporary folder removed, or, when the last line names ``keep`` in it, all of it but that."""
    if keep is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry != keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _write_last(user_stderr: int, line: str) -> None:
    """The last line, at the end of the user's stderr: a file the training processes appended to (they opened it
    again, with O_APPEND) has its end past this process's own offset."""
    fd = user_stderr
    with contextlib.suppress(OSError):
        fd = os.open(os.environ.get(STDERR_ENV, ""), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode("utf-8", "replace"))
    finally:
        if fd != user_stderr:
            os.close(fd)


@contextlib.contextmanager
def _kept_out(log: Path) -> Iterator[tuple[int, bool]]:
    """This process's stderr into ``log``, and the user's stderr kept (yielded as a file descriptor) for the last
    line and for the training processes (``AIAYN_LAUNCH_STDERR``), where /proc lets them open it; else stderr stays
    the user's (yielded: whether torchrun's output goes into ``log``)."""
    try:
        user = os.dup(2)
    except OSError:  # no stderr at all (2>&-): nothing to keep apart
        user = os.open(os.devnull, os.O_WRONLY)
    path = f"/proc/{os.getpid()}/fd/{user}"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # what a training process will do (not a socket, ...)
        reachable = True
    except OSError:
        reachable = False
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if reachable:
        os.environ[STDERR_ENV] = path
        sys.stderr.flush()
        os.dup2(fd, 2)
    os.close(fd)
    yield user, reachable


def _settle(log: Path, folder: Path, run_dir: Path | None, here: tuple[str, int]) -> Path:
    """Where the log ends: RUN/logs/launch-HOST-PID.log when RUN is a run (its marker written), else where it is."""
    if run_dir is None or not (run_dir / MARKER).is_file():
        return log
    target = run_dir / "logs" / f"launch-{here[0]}-{here[1]}.log"
    try:
        target.parent.mkdir(exist_ok=True)
        shutil.move(str(log), target)
    except OSError:
        return log
    return target


def ending(error: BaseException | None, job: Launch, log: Path | None,
           members: list[tuple[int, str, int]]) -> tuple[int, str | None]:
    """The launcher's exit status and last line for how torchrun's agent ended: ``error`` None (success: no line), a
    failed process (ChildFailedError), a rendezvous that timed out or is gone, a signal, anything else. ``log``:
    where torchrun's own output is (None: it went to stderr, above the line)."""
    if error is None:
        return 0, None
    kind = type(error).__name__
    report = f"torchrun's own report: {log if log is not None else 'above, on stderr'}"
    if kind == "ChildFailedError":
        return _child_failed(error, job, report)
    if kind in ("SignalException", "KeyboardInterrupt"):
        sig = getattr(error, "sigval", signal.SIGINT)
        name = signal.Signals(sig).name if isinstance(sig, int) else str(sig)
        return 128 + int(sig), f"aiayn: interrupted ({name}): the job stopped; {go_on(job)}; {report}"
    if kind == "RendezvousTimeoutError":
        return 2, (f"aiayn: error: {lost_nodes(job, members)} within {job.joined_within()}: the job stopped; "
                   f"{go_on(job)}; {report}")
    if kind == "RendezvousClosedError":
        return 2, (f"aiayn: error: the job's rendezvous at {job.endpoint()} was closed by another node (its "
                   f"launcher ended the job: its last line says why); {go_on(job)}; {report}")
    if kind in ("RendezvousConnectionError", "DistNetworkError", "DistStoreError", "RendezvousError"):
        cause = error.__cause__ or error  # torch's own words: "Broken pipe", not "See inner exception"
        return 2, (f"aiayn: error: the job's rendezvous at {job.endpoint()} is gone (the node that hosted it "
                   f"stopped or was lost: {type(cause).__name__}: {one_line(cause)[:120]}), so no node can meet the "
                   f"others again; "
                   f"{go_on(job, new_host=True)}; {report}")
    if isinstance(error, SystemExit):  # torchrun's parser or a sys.exit in the agent
        code = error.code if isinstance(error.code, int) else 1
        return code, (None if code == 0 else f"aiayn: error: torchrun's agent exited with status {code}; {report}")
    msg = user_error_message(error)
    if msg is not None:
        return 2, f"aiayn: error: {msg}; {report}"
    return 1, (f"aiayn: internal error (in torchrun's agent or aiayn launch): {kind}: {one_line(error)[:200]}; "
               f"{report}")


def _child_failed(error: BaseException, job: Launch, report: str) -> tuple[int, str]:
    """A training process failed and torchrun has no restart left: the first refusal of the input as it is (the
    processes left it to the launcher: :func:`aiayn.launched.said_by_launcher`; the others stopped because of it);
    else the first failure's own line, and what to do."""
    refused = refusal_of(error)
    if refused is not None:
        # exit 2 as aiayn's refusals: its process may have been ended by torchrun (SIGTERM) after it wrote its line
        return 2, f"aiayn: error: {refused.message}"
    failures = error.failures  # type: ignore[attr-defined]
    said_one = {r: f for r, f in failures.items() if "status" in f.error_file_data}  # aiayn's line, then its exit
    # the first process that said why it stopped (torchrun may have ended it, SIGTERM, before its exit), else the
    # first that failed
    rank = min(said_one or failures, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    code = int(failure.error_file_data.get("status", failure.exitcode))
    if code < 0:
        try:
            what = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
        status = 128 - code
    else:
        what, status = f"ended with exit {code}", code or 1
    said = failure.error_file_data.get("message")  # aiayn's own line (aiayn.launched.record_error), or "<NONE>"
    said = first_clause(said) if isinstance(said, str) and said != "<NONE>" else ""
    restarts = int(job.args.max_restarts or 0)
    spent = f" after torchrun's {restarts} restart(s)" if restarts else ""
    return status, (f"aiayn: error: the training process of rank {rank} (pid {failure.pid}) {what}"
                    f"{f': {said}' if said else ''}; the job stopped{spent}; {go_on(job)}; {report}")


def refusal_of(error: BaseException | None) -> Any:
    """The failure (torch's ProcessFailure) of the lowest rank whose line refused the input, when torchrun's agent
    ended in a ChildFailedError and a process recorded one (:func:`aiayn.launched.record_error`); else None."""
    failures = getattr(error, "failures", None) if type(error).__name__ == "ChildFailedError" else None
    refused = sorted(r for r, f in (failures or {}).items() if f.error_file_data.get("aiayn") == "refusal")
    return failures[refused[0]] if refused else None


def first_clause(line: str) -> str:
    """``line`` up to its first ``"; "`` outside parentheses: what happened, without the advice that follows (the
    launcher's line gives its own)."""
    depth = 0
    for i, ch in enumerate(line):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and line.startswith("; ", i):
            return line[:i]
    return line


def lost_nodes(job: Launch, members: list[tuple[int, str, int]]) -> str:
    """What the rendezvous waited for: the other node(s) of the job's last round, by host, agent pid and ranks
    (from :func:`aiayn.launched.record_members`), or the nodes that never came."""
    others: dict[tuple[str, int], list[int]] = {}
    for rank, (_pid, host, agent) in enumerate(members):
        if (host, agent) != job.here:
            others.setdefault((host, agent), []).append(rank)
    if not others:
        return f"the job's nodes (--nnodes {job.nodes}) did not all come to its rendezvous at {job.endpoint()}"
    named = ", ".join(f"{host} (launcher pid {agent}: rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))})" for (host, agent), ranks in others.items())
    if len(others) == 1:
        return f"the job's other node, {named}, was lost and no node took its place"
    return f"a node of the job was lost (the others of its last round: {named}) and no node took its place"


def go_on(job: Launch, new_host: bool = False) -> str:
    """The command that continues the run: ``aiayn launch ... train --resume RUN`` from its newest checkpoint, or
    the command as given when the run holds nothing to continue."""
    run = job.run_dir
    several = job.nodes not in ("1", "1:1")
    each = " (on every node, each with its own options" + (
        ", one of them hosting a new rendezvous)" if new_host else ")") if several else ""
    if run is None or not (run / "config.yaml").is_file():
        return f"nothing was trained: start it again with: {job.again}{each}"
    steps = list_checkpoints(run)
    if not steps:
        return f"no checkpoint yet: start it again with: {job.resume}{each}"
    return f"go on from its newest checkpoint (update {steps[-1]}) with: {job.resume}{each}"
