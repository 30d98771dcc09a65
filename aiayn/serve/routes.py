"""The route tables of ``aiayn serve``: each path declared once, beside its handler, and the protocol a path answers
in, asked of the mounted tables.

A protocol's routes are a :class:`RouteTable` whose handlers carry :func:`route` (the path, its methods, whether
LibreTranslate's forms are taken there). The table names its ``protocol`` (the error shape its handlers answer in,
:data:`aiayn.serve.errors.ERRORS`) and ``claims``: the paths of that protocol it does not serve, whose 404 still
comes in its shape. :class:`Protocols` reads the mounted tables, so that what is refused before any handler runs
(no such route or method, a media type, a host, an origin) is answered in the shape of the route at that path,
else of the table that claims it, else aiayn's own. A new route is one decorated handler: nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from starlette.responses import JSONResponse
from starlette.routing import Route

from aiayn.serve.errors import answering_errors, error_response

OWN = "aiayn"  # the shape of a path no table serves or claims: aiayn's own
H = TypeVar("H", bound=Callable)


@dataclass(frozen=True)
class RouteSpec:
    """One route of a table: ``path``, its ``methods`` (None: GET), and whether it takes forms, as
    LibreTranslate's clients post them (else a POST must be JSON)."""

    path: str
    methods: tuple[str, ...] | None = None
    forms: bool = False


def route(path: str, *methods: str, forms: bool = False) -> Callable[[H], H]:
    """Marks a handler of a :class:`RouteTable` as the one of ``path`` (``methods``: default GET)."""

    def mark(handler: H) -> H:
        handler.route_spec = RouteSpec(path, methods or None, forms)  # type: ignore[attr-defined]
        return handler

    return mark


class RouteTable:
    """A protocol's routes: the handlers marked with :func:`route`, each answering errors in ``protocol``'s shape."""

    protocol: ClassVar[str] = OWN
    # paths of this protocol that this server does not serve (a prefix ends with "/"): their 404 in its shape
    claims: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def specs(cls) -> list[tuple[str, RouteSpec]]:
        """(handler name, route) of each marked handler, in the class's order."""
        return [(name, spec) for name, f in vars(cls).items()
                if isinstance(spec := getattr(f, "route_spec", None), RouteSpec)]

    def routes(self) -> list[Route]:
        """The Starlette routes of this table's handlers."""
        return [Route(spec.path, answering_errors(self.protocol, getattr(self, name)),
                      methods=list(spec.methods) if spec.methods else None) for name, spec in self.specs()]


class Protocols:
    """Which protocol each path answers in, read from the mounted route tables (instances or their classes)."""

    def __init__(self, tables: Iterable[RouteTable | type[RouteTable]]) -> None:
        self.tables = tuple(tables)
        self.served: dict[str, tuple[str, RouteSpec]] = {}
        self.claimed: list[tuple[str, str]] = []
        for table in self.tables:
            for _, spec in table.specs():
                self.served[spec.path] = (table.protocol, spec)
            self.claimed += [(claim, table.protocol) for claim in table.claims]

    def of(self, path: str) -> str:
        """The protocol of the route at ``path``, else of the table that claims it, else aiayn's own."""
        if path in self.served:
            return self.served[path][0]
        for claim, protocol in self.claimed:
            if path == claim or (claim.endswith("/") and path.startswith(claim)):
                return protocol
        return OWN

    def takes_forms(self, path: str) -> bool:
        """Whether the route at ``path`` takes form posts (LibreTranslate's clients send them)."""
        return path in self.served and self.served[path][1].forms

    def error_response(self, path: str, status: int, code: str, message: str,
                       headers: dict[str, str] | None = None) -> JSONResponse:
        """A refusal made before any handler, in the error shape of the protocol ``path`` answers in."""
        return error_response(self.of(path), status, code, message, headers)
