"""Typed handlers: a handler annotated with a model gets the message decoded into it.

``def bill(order: Order)`` receives an ``Order``; ``def bill(message: Message[Order])``
receives the message with ``value`` an ``Order``; batch handlers take
``list[Order]`` or ``list[Message[Order]]``. ``Order`` is a pydantic model, a
dataclass or a msgspec Struct (``broker/wire/models.py``). The annotation is
read once, when the runner starts the consumer; a handler without one (or with
``Message``, or one that does not resolve) is called with the message, as before.

A message that does not validate is not the handler's failure and no retry
would fix it: the runner raises ``InvalidMessage``, and the lane dead-letters
it at once with the validation error (consumers/lanes.py).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.broker.client.message import Message
from conveyor.broker.wire.models import ModelError, from_value, model_kind
from conveyor.decorators.consumer import Consumer
from conveyor.decorators.exceptions import InvalidMessage


@dataclass(frozen=True)
class Payload:
    """What a typed handler takes: ``model``, given bare (``Order``) or inside its message (``Message[Order]``)."""

    model: Any
    in_message: bool


def payload_of(fn: Callable[..., Any], *, batch: bool = False) -> Payload | None:
    """The model the handler's first parameter is annotated with, or None for an untyped handler."""
    hint = _first_hint(fn)
    if hint is None:
        return None
    if batch:
        if typing.get_origin(hint) not in (list, Sequence) or not typing.get_args(hint):
            return None
        hint = typing.get_args(hint)[0]
    in_message = typing.get_origin(hint) is Message
    model = typing.get_args(hint)[0] if in_message and typing.get_args(hint) else hint
    if model_kind(model) is None:
        return None  # Message, Message[dict], list[Message], ...: the message as it is
    return Payload(model, in_message)


def _first_hint(fn: Callable[..., Any]) -> Any:
    """The resolved annotation of the handler's first parameter; None without one, or when it does not resolve.

    Only that one is resolved: a return or later hint that names something imported under ``TYPE_CHECKING``
    must not make a typed handler untyped.
    """
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin, or a callable without a signature
        return None
    if not params or params[0].annotation is inspect.Parameter.empty:
        return None
    target = inspect.unwrap(fn)
    holder = types.SimpleNamespace(__annotations__={"hint": params[0].annotation})
    try:
        return typing.get_type_hints(holder, globalns=getattr(target, "__globals__", {}))["hint"]
    except Exception:  # a name imported under TYPE_CHECKING only, a local class: untyped, as before
        return None


def decode(payload: Payload, message: Message[Any]) -> Any:
    """The handler's argument for ``message``, or ``InvalidMessage`` with the reason it does not fit."""
    try:
        value = from_value(payload.model, message.value)
    except ModelError as exc:
        raise InvalidMessage(str(exc)) from exc
    except Exception as exc:  # an undecodable body, a validator that raised: the same bytes fail again
        name = getattr(payload.model, "__qualname__", payload.model)
        raise InvalidMessage(f"{name}: {type(exc).__name__}: {exc}") from exc
    if not payload.in_message:
        return value
    message.value = value
    return message


def handler_call(consumer: Consumer) -> Callable[[Any], Any]:
    """What the lanes call with a message (or a batch): the handler itself, or it behind the decoding."""
    fn = consumer.fn
    payload = payload_of(fn, batch=consumer.batch)
    if payload is None:
        return fn
    if not consumer.batch:
        # decode raises before fn is called, so an async handler's coroutine is never made for nothing
        return lambda message: fn(decode(payload, message))
    if consumer.is_async:

        async def call_async_batch(messages: list[Message[Any]]) -> Any:
            args, invalid = _decode_batch(payload, messages)
            error: BaseException | None = None
            if args:
                try:
                    await fn(args)
                except Exception as exc:
                    error = exc
            _raise_invalid(invalid, error)

        return call_async_batch

    def call_batch(messages: list[Message[Any]]) -> Any:
        args, invalid = _decode_batch(payload, messages)
        error: BaseException | None = None
        if args:
            try:
                fn(args)
            except Exception as exc:
                error = exc
        _raise_invalid(invalid, error)

    return call_batch


def _decode_batch(payload: Payload, messages: list[Message[Any]]) -> tuple[list[Any], list[tuple[Any, str]]]:
    args: list[Any] = []
    invalid: list[tuple[Any, str]] = []
    for message in messages:
        try:
            args.append(decode(payload, message))
        except InvalidMessage as exc:
            invalid.append((message, exc.error))
    return args, invalid


def _raise_invalid(invalid: list[tuple[Any, str]], error: BaseException | None) -> None:
    """Invalid messages of a batch: dead-lettered, the others settled by what the handler did (``error``)."""
    if invalid:
        raise InvalidMessage(invalid[0][1], invalid=invalid, handler_error=error)
    if error is not None:
        raise error
