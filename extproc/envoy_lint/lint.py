"""Lint one file: read it, find its views, run every check, attach the file name."""

from __future__ import annotations

from extproc.envoy_lint.checks import CHECKS, ROUTE_CACHE
from extproc.envoy_lint.checks.routes import check_route_cache
from extproc.envoy_lint.findings import Finding, Issue
from extproc.envoy_lint.kinds import bootstrap, envoy_gateway, istio
from extproc.envoy_lint.model import View
from extproc.envoy_lint.reference import Reference
from extproc.envoy_lint.source import Node, UnreadableFile, load_documents

KNOWN = (
    "an Envoy bootstrap (static_resources), an Istio "
    + ", ".join(istio.KINDS)
    + " or an Envoy Gateway "
    + ", ".join(envoy_gateway.KINDS)
)


def views_of(path: str, documents: list[Node]) -> list[View]:
    """The pipelines the documents show; raises UnreadableFile when none is of a known kind."""
    found: list[View] = []
    istio_documents = [(kind, d) for d in documents if (kind := istio.kind_of(d)) is not None]
    gateway_documents = [
        (kind, d) for d in documents if (kind := envoy_gateway.kind_of(d)) is not None
    ]
    for document in documents:
        if bootstrap.is_bootstrap(document):
            found += bootstrap.views(document)
    if istio_documents:
        found.append(istio.view(istio_documents))
    if gateway_documents:
        found.append(envoy_gateway.view(gateway_documents))
    if not found:
        raise UnreadableFile(f"{path}: not {KNOWN}")
    return found


def lint_file(path: str, ref: Reference) -> list[Finding]:
    """Every finding for the file, by line; raises UnreadableFile."""
    documents = load_documents(path)
    issues: list[tuple[str, Issue]] = [(ROUTE_CACHE, i) for i in check_route_cache(documents)]
    for view in views_of(path, documents):
        for name, check in CHECKS.items():
            issues += [(name, issue) for issue in check(view, ref)]
    findings = {Finding(path, i.line, i.severity, name, i.message, i.fix) for name, i in issues}
    return sorted(findings, key=lambda f: (f.line, f.severity, f.check, f.message))
