"""Identify the tenant of a request from its API key or a header set by a trusted mesh."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.errors import unauthorized
from extproc.policy import Policy


def presented_key(headers: Mapping[str, str]) -> str | None:
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    api_key = headers.get("x-api-key")
    return api_key.strip() if api_key and api_key.strip() else None


def identify_tenant(policy: Policy, headers: Mapping[str, str]) -> str:
    """The tenant's name, or GatewayError 401.

    With `gateway.trusted_tenant_header` set, a mesh in front of Envoy (e.g. an Istio
    ingress that authenticated the caller) names the tenant; the mesh must strip any
    client-sent copy of that header. Otherwise the API key decides.
    """
    trusted = policy.source.gateway.trusted_tenant_header
    if trusted:
        name = headers.get(trusted)
        if name:
            if policy.tenant(name) is None:
                raise unauthorized(f"tenant {name!r} named by the mesh is not in the policy")
            return name
    key = presented_key(headers)
    if key is None:
        raise unauthorized(
            "missing API key: send 'Authorization: Bearer <key>' or an 'x-api-key' header"
        )
    tenant = policy.keys.tenant_for(key)
    if tenant is None:
        raise unauthorized("invalid API key")
    return tenant
