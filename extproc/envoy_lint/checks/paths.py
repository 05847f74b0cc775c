"""Check 9: path normalisation, without which an encoded path bypasses admission.

The admission filter decides by the path (/v1/chat/completions is admitted and budgeted); a
path like /v1/chat/complet%69ons reaches the engine as the same endpoint unless Envoy
normalises it first.
"""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, missing
from extproc.envoy_lint.model import Manager, Setting, View
from extproc.envoy_lint.reference import Reference

SAFE_ESCAPED_SLASHES = ("UNESCAPE_AND_REDIRECT", "REJECT_REQUEST")
_BYPASS = "an encoded path like /v1/chat/complet%69ons otherwise bypasses admission"


def _flag(view: View, manager: Manager, name: str, setting: Setting[bool] | None) -> list[Issue]:
    if setting is not None:
        if setting.value:
            return []
        return [
            error(
                setting.line,
                f"{name} is false: {_BYPASS}",
                f"set {view.spelling.get(name, f'{name}: true')}",
            )
        ]
    if manager.safe_path_defaults:
        return []
    return [
        missing(
            view.complete,
            manager.line,
            f"{name} is not set"
            + (" (Envoy's default: false)" if view.complete else "")
            + f": {_BYPASS}",
            f"set {name}: true on the HTTP connection manager",
        )
    ]


def check_path_normalisation(view: View, _: Reference) -> list[Issue]:
    manager = view.manager
    if manager is None:
        return [
            missing(
                view.complete,
                view.line,
                "this file does not show the HTTP connection manager's path normalisation",
                "make sure it sets normalize_path: true, merge_slashes: true and "
                "path_with_escaped_slashes_action: REJECT_REQUEST",
            )
        ]
    issues = _flag(view, manager, "normalize_path", manager.normalize_path)
    issues += _flag(view, manager, "merge_slashes", manager.merge_slashes)
    action = manager.escaped_slashes_action
    if action is not None and action.value not in SAFE_ESCAPED_SLASHES:
        issues.append(
            error(
                action.line,
                f"path_with_escaped_slashes_action is {action.value}: {_BYPASS}",
                f"set {view.name_of('path_with_escaped_slashes_action')} to "
                "REJECT_REQUEST (the render's choice) or UNESCAPE_AND_REDIRECT",
            )
        )
    elif action is None and not manager.safe_path_defaults:
        issues.append(
            missing(
                view.complete,
                manager.line,
                "path_with_escaped_slashes_action is not set"
                + (" (Envoy's default keeps %2F as is)" if view.complete else "")
                + f": {_BYPASS}",
                "set path_with_escaped_slashes_action: REJECT_REQUEST",
            )
        )
    return issues
