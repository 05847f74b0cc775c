"""Pure builders for ext_proc ProcessingResponse messages (hot-path xds-protos stubs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from extproc.errors import HttpAnswer

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_option(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def header_mutation(
    set_headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    remove: Iterable[str] = (),
) -> HeaderMutation:
    items = set_headers.items() if isinstance(set_headers, Mapping) else set_headers
    return HeaderMutation(
        set_headers=[header_option(key, value) for key, value in items],
        remove_headers=list(remove),
    )


def _common(
    mutation: HeaderMutation | None, clear_route_cache: bool, body: bytes | None
) -> CommonResponse:
    common = CommonResponse(clear_route_cache=clear_route_cache)
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    if body is not None:
        common.body_mutation.CopyFrom(BodyMutation(body=body))
    return common


def continue_request_headers(
    mutation: HeaderMutation | None = None, clear_route_cache: bool = False
) -> ProcessingResponse:
    return ProcessingResponse(
        request_headers=HeadersResponse(response=_common(mutation, clear_route_cache, None))
    )


def continue_request_body(
    mutation: HeaderMutation | None = None,
    clear_route_cache: bool = False,
    body: bytes | None = None,
) -> ProcessingResponse:
    return ProcessingResponse(
        request_body=BodyResponse(response=_common(mutation, clear_route_cache, body))
    )


def continue_response_headers(mutation: HeaderMutation | None = None) -> ProcessingResponse:
    return ProcessingResponse(
        response_headers=HeadersResponse(response=_common(mutation, False, None))
    )


def immediate(answer: HttpAnswer) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=answer.status),  # type: ignore[arg-type]
            headers=header_mutation(answer.headers),
            body=answer.body,
        )
    )


def hold(seconds: float) -> ProcessingResponse:
    """Ask Envoy to wait up to `seconds` for the real reply to the current message."""
    whole = int(seconds)
    return ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )
