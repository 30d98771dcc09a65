"""The docs check (tests/docs_check.py; all of it: `make docs-check`): every fenced block of README.md and docs/
is tagged and every docs-check mark is well formed; the serving page's curl blocks run as written against a
running `aiayn serve` (the rest runs in `make docs-check`: a few minutes)."""

from __future__ import annotations

import pytest
from docs_check import INSTALLS, REPO, Block, Servers, build_runs, problems, run_block, shell_blocks


def test_every_block_is_tagged_and_every_mark_is_well_formed():
    assert problems() == []  # includes: a block that installs packages is marked skip
    skipped = [b for b in shell_blocks() if b.mark == "skip"]
    assert skipped and all(b.arg for b in skipped)
    # the check runs blocks with this checkout's interpreter: an install there would change its environment
    assert INSTALLS.search("pip install 'lm-eval[api]'\nlm_eval run")
    assert INSTALLS.search("cd x && python -m pip install y")
    assert not INSTALLS.search("aiayn export ctranslate2 RUN out/   # (pip install 'aiayn[ct2]')")


def test_the_serving_pages_requests_run_as_written(tiny_run, tmp_path):
    pytest.importorskip("starlette")
    runs = build_runs(tmp_path / "runs", translation=tiny_run)
    served = [b for b in shell_blocks([REPO / "docs" / "serve.md"]) if b.mark == "server"]
    assert {b.arg for b in served} == {"runs/m30k", "runs/lm_char"}
    with Servers(runs, tmp_path) as servers:
        for b in served:
            rc, out = run_block(b, runs, tmp_path, servers)
            assert rc == 0, f"{b.name}:\n{out}"
        # as the page once had it: without a Content-Type the server answers 415, and the check fails the block
        old = Block(b.page, 0, "bash", "curl -s localhost:8000/v1/translate -d '{\"text\": [\"A dog.\"]}'\n",
                    "server", "runs/m30k")
        rc, out = run_block(old, runs, tmp_path, servers)
        assert rc == 22 and "unsupported_media_type" in out, out  # curl: 22 = an HTTP error status
