"""A real LibreTranslate server on a run's Argos package, offline, for tests and benchmarks to compare with.

LibreTranslate is not one of aiayn's dependencies (it pins Flask, numpy and packaging versions of its own), so it
runs from a separate environment whose ``libretranslate`` executable is named by ``$AIAYN_LIBRETRANSLATE``:

    python -m venv /tmp/lt && echo "$(python -c 'import site; print(site.getsitepackages()[0])')" \\
        > /tmp/lt/lib/python3.11/site-packages/aiayn_venv.pth && /tmp/lt/bin/pip install libretranslate==1.9.6
    export AIAYN_LIBRETRANSLATE=/tmp/lt/bin/libretranslate

(about 2 minutes to install). :func:`start` exports the run as an Argos package (``aiayn export argos``), installs
it into a private home (Argos' package index: a local empty one, so nothing is downloaded), and starts
``libretranslate --load-only SRC,TGT`` on a free loopback port. Argos' own settings (``ARGOS_COMPUTE_TYPE``,
``ARGOS_INTRA_THREADS``, ...) are LibreTranslate's defaults unless the caller passes them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ENV = "AIAYN_LIBRETRANSLATE"


def executable() -> tuple[str | None, str]:
    """The ``libretranslate`` executable ``$AIAYN_LIBRETRANSLATE`` names, or None with the reason there is none."""
    exe = os.environ.get(ENV, "")
    if not exe:
        return None, (f"needs a LibreTranslate server: set {ENV} to the libretranslate executable of a separate "
                      "environment (pip install libretranslate==1.9.6; see benchmarks/libretranslate_peer.py)")
    if not Path(exe).is_file():
        return None, f"{ENV}={exe} is not a file"
    return exe, ""


@dataclass
class Peer:
    """A running LibreTranslate server: its process, URL, log file and the Argos settings it was started with."""

    proc: subprocess.Popen
    url: str
    log: Path
    argos_env: dict[str, str]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then its exit status (killed after ``timeout`` seconds)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(run_dir: str | os.PathLike, root: str | os.PathLike, exe: str, languages: tuple[str, str],
          argos_env: dict[str, str] | None = None, timeout: float = 300.0) -> Peer:
    """LibreTranslate serving the run ``run_dir`` (languages (source, target)) from a private home under ``root``;
    ``argos_env``: Argos' settings to set (e.g. ``{"ARGOS_COMPUTE_TYPE": "float32"}``), the rest its defaults.
    Returns once ``/languages`` answers; raises RuntimeError (with the end of its log) if it stops first."""
    from aiayn.interop.argos import export_argos

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    package = export_argos(run_dir, root / f"{languages[0]}_{languages[1]}.argosmodel", force=True)
    (root / "index").mkdir(exist_ok=True)
    (root / "index" / "index.json").write_text("[]")
    home = root / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_", "PYTHONPATH"))}
    settings = {"ARGOS_DEVICE_TYPE": "cpu", **(argos_env or {})}
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), ARGOS_PACKAGE_INDEX=f"file://{root}/index/", **settings)
    python = Path(exe).with_name("python")
    subprocess.run([str(python), "-c", f"from argostranslate.package import install_from_path; "
                                       f"install_from_path({str(package)!r})"], env=env, check=True, timeout=timeout)
    port, log = _free_port(), root / "libretranslate.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--load-only", ",".join(languages),
                                 "--disable-web-ui"], env=env, stdout=out, stderr=subprocess.STDOUT)
    peer = Peer(proc, f"http://127.0.0.1:{port}", log, settings)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("LibreTranslate stopped: " + log.read_text()[-2000:])
        try:
            urllib.request.urlopen(peer.url + "/languages", timeout=2).read()
            return peer
        except OSError:
            time.sleep(0.5)
    peer.stop()
    raise RuntimeError(f"LibreTranslate did not answer within {timeout:.0f} s: " + log.read_text()[-2000:])
