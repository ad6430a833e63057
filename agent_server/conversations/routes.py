"""`/v1/conversations`: conversations and their items, kept in the store beside responses.

A conversation is a list of Responses API items. `POST /v1/responses` with `conversation`
continues it: its items come before the request's `input`, and when the response ends its input
and output items are added (`agent_server/responses/lifecycle.py`). While only responses add to
a conversation, the next one continues exactly what the model saw, as `previous_response_id`
does; once items are added or deleted here, the next response reads the items themselves.

A conversation belongs to the owner of the API key that created it (`agent_server/ownership.py`):
another owner gets the 404 of a missing one from every route here and from `conversation` on
`POST /v1/responses`, and item references resolve only to the requester's own items.
"""

from __future__ import annotations

from typing import Any, get_args

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent_server.auth import request_owner
from agent_server.errors import APIError, not_found
from agent_server.ownership import visible
from agent_server.request_parsing import int_query, read_request
from agent_server.responses.events import new_id
from agent_server.responses.prepare import check_item_ids, listed_input_items, resolve_references
from agent_server.state import ServerState
from agent_server.store import StoredConversation
from schemas.conversations import ConversationCreateRequest, ConversationItemsRequest, ConversationUpdateRequest
from schemas.responses import Includable

INCLUDABLE = set(get_args(Includable))


def conversation_json(conversation: StoredConversation) -> dict[str, Any]:
    return {
        "id": conversation.id,
        "object": "conversation",
        "created_at": int(conversation.created_at),
        "metadata": conversation.metadata,
    }


async def _stored(request: Request) -> StoredConversation:
    """The conversation the path names, if it is the requester's; another owner's is a 404, as a
    missing one."""
    state: ServerState = request.app.state.server
    conversation_id = request.path_params["conversation_id"]
    conversation = await state.store.get_conversation(conversation_id)
    if conversation is None or not visible(conversation.owner, request_owner(request)):
        raise not_found("Conversation", conversation_id, param="conversation_id")
    return conversation


def _check_include(request: Request) -> None:
    """`include` (or `include[]`, as some clients write lists) names what may be included; the
    items are returned whole, so it changes nothing."""
    for name in ("include", "include[]"):
        for value in request.query_params.getlist(name):
            if value not in INCLUDABLE:
                raise APIError(f"Invalid value for 'include': '{value}'.", param="include", code="invalid_value")


async def _new_items(state: ServerState, items: list[Any], owner: str | None) -> list[dict[str, Any]]:
    """Input items as the conversation keeps them: references (to the owner's items) replaced,
    each with an id."""
    items = await resolve_references(state, items, owner)
    check_item_ids(items)
    return listed_input_items(items)


def _item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


async def create_conversation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_request(request, ConversationCreateRequest, state.config.max_request_bytes)
    owner = request_owner(request)
    items = await _new_items(state, body.items or [], owner)
    conversation = StoredConversation(id=new_id("conv"), metadata=body.metadata or {}, owner=owner)
    await state.store.create_conversation(conversation, items)
    return JSONResponse(conversation_json(conversation))


async def retrieve_conversation(request: Request) -> Response:
    return JSONResponse(conversation_json(await _stored(request)))


async def update_conversation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id = request.path_params["conversation_id"]
    body = await read_request(request, ConversationUpdateRequest, state.config.max_request_bytes)
    await _stored(request)
    conversation = await state.store.update_conversation(conversation_id, body.metadata or {})
    if conversation is None:
        raise not_found("Conversation", conversation_id, param="conversation_id")
    return JSONResponse(conversation_json(conversation))


async def delete_conversation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id = request.path_params["conversation_id"]
    await _stored(request)
    if not await state.store.delete_conversation(conversation_id):
        raise not_found("Conversation", conversation_id, param="conversation_id")
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def list_items(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id = request.path_params["conversation_id"]
    limit = int_query(request, "limit", 20, 1, 100)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError("Invalid value for 'order': must be 'asc' or 'desc'.", param="order", code="invalid_value")
    _check_include(request)
    await _stored(request)
    after = request.query_params.get("after")
    try:
        items = await state.store.conversation_items(
            conversation_id, after=after, limit=limit + 1, descending=order == "desc"
        )
    except KeyError:
        raise APIError(f"No item with id '{after}' in this conversation.", param="after") from None
    if items is None:
        raise not_found("Conversation", conversation_id, param="conversation_id")
    return JSONResponse(_item_list(items[:limit], has_more=len(items) > limit))


async def create_items(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id = request.path_params["conversation_id"]
    _check_include(request)
    body = await read_request(request, ConversationItemsRequest, state.config.max_request_bytes)
    await _stored(request)
    items = await _new_items(state, body.items, request_owner(request))
    try:
        added = await state.store.add_conversation_items(conversation_id, items)
    except ValueError as e:
        raise APIError(f"Duplicate item: {e}. Remove duplicate items and try again.", param="items") from None
    if added is None:
        raise not_found("Conversation", conversation_id, param="conversation_id")
    return JSONResponse(_item_list(items))


async def retrieve_item(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
    _check_include(request)
    await _stored(request)
    item = await state.store.conversation_item(conversation_id, item_id)
    if item is None:
        raise not_found("Item", item_id, param="item_id")
    return JSONResponse(item)


async def delete_item(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
    await _stored(request)
    conversation = await state.store.delete_conversation_item(conversation_id, item_id)
    if conversation is None:
        raise not_found("Item", item_id, param="item_id")
    return JSONResponse(conversation_json(conversation))


routes = [
    Route("/v1/conversations", create_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", retrieve_conversation, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}", update_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items", create_items, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
]
