"""docs/serve.md's error tables say what the server answers: every (status, code) that aiayn's own routes and
OpenAI's routes raise is listed, and every listed one is raised somewhere (read from the code's refusals, so a new
refusal or a changed status fails here until the docs say it)."""

from __future__ import annotations

import ast
import re

from conftest import REPO

SERVE = REPO / "aiayn" / "serve"


def _literal(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else ...


def raised() -> dict[str, set[tuple[int, str | None]]]:
    """(status, code) of every refusal written with literal values in aiayn/serve: ``ApiError(status, code, ...)``,
    ``error_response(where, status, code, ...)`` (refusals before a route) and ``OpenAIError(status, ...,
    code=...)``; a refusal whose status or code is computed is not counted."""
    found: dict[str, set[tuple[int, str | None]]] = {"aiayn": set(), "openai": set()}
    for path in sorted(SERVE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            args, kwargs = node.args, {k.arg: k.value for k in node.keywords}
            if node.func.id == "ApiError" and len(args) >= 2:
                pair = (_literal(args[0]), _literal(args[1]))
                kind = "aiayn"
            elif node.func.id == "error_response" and len(args) >= 3 and path.name == "app.py":
                pair, kind = (_literal(args[1]), _literal(args[2])), "aiayn"
            elif node.func.id == "OpenAIError" and args:
                code = kwargs.get("code", args[3] if len(args) > 3 else None)
                pair, kind = (_literal(args[0]), None if code is None else _literal(code)), "openai"
            else:
                continue
            if ... not in pair:
                found[kind].add(pair)
    return found


def documented() -> list[set[tuple[int, str | None]]]:
    """The (status, code) pairs of each table in docs/serve.md's "Errors and limits" section, in order."""
    text = (REPO / "docs" / "serve.md").read_text(encoding="utf-8")
    section = text.split("## Errors and limits", 1)[1].split("\n## ", 1)[0]
    tables: list[set[tuple[int, str | None]]] = []
    for block in re.split(r"\n(?!\|)", section):
        rows = [line for line in block.splitlines() if re.match(r"\| \d", line)]
        if not rows:
            continue
        pairs = set()
        for row in rows:
            statuses = [int(s) for s in re.findall(r"\d{3}", row.split("|")[1])]
            codes = [None if c == "null" else c for c in re.findall(r"`([a-z_0-9]+)`", row.split("|")[2])]
            pairs |= set(zip(statuses, codes)) if len(statuses) == len(codes) else {(s, c) for s in statuses
                                                                                    for c in codes}
        tables.append(pairs)
    return tables


def test_the_error_tables_list_every_refusal_and_nothing_else():
    aiayn_table, openai_table = documented()
    code = raised()
    before_route = {(404, "not_found"), (405, "method_not_allowed")}  # Starlette's, answered by app.not_found
    assert '{404: "not_found", 405: "method_not_allowed"}' in (SERVE / "app.py").read_text(encoding="utf-8")
    assert aiayn_table == code["aiayn"] | before_route
    assert openai_table == code["openai"]
    assert (400, "out_of_range") in openai_table and (413, "too_many_sentences") not in openai_table
