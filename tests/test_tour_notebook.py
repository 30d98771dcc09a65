"""docs/tour.ipynb, the guided tour of the paper and its code, runs from its first cell to its last without an error
(issue 71: executed in CI so that it never rots): in a kernel of the Python that runs this test, from docs/ as a
reader who opens it there runs it. The committed file carries no outputs (they would be stale the day the code
changes, and the diff of a PNG is unreadable)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

WHY = "the dev extra's nbformat, nbclient and ipykernel run the notebook"
nbformat = pytest.importorskip("nbformat", reason=WHY)
nbclient = pytest.importorskip("nbclient", reason=WHY)
pytest.importorskip("ipykernel", reason=WHY)

NOTEBOOK = Path(__file__).resolve().parent.parent / "docs" / "tour.ipynb"
# Per cell. The longest, the training, takes under a minute on one busy core; a hung cell fails the test, not CI.
CELL_TIMEOUT_S = 240


def test_the_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None] == []


@pytest.mark.slow
def test_the_tour_runs_from_docs_in_a_kernel_of_this_python(tmp_path, monkeypatch):
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # the kernel's profile and history: not the user's
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # its connection file
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    # No kernel directory searched: only ipykernel's own "python3", which runs sys.executable, whatever kernels the
    # user's or the system's Jupyter has registered under that name.
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # CellExecutionError, with the cell and its traceback, on any error (its asserts included)
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
