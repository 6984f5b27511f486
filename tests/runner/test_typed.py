"""Typed handlers with a real `conveyor run` process and a real broker (issue #20, typed messages).

A handler annotated with a pydantic model, a dataclass or a msgspec Struct gets the message decoded into it;
a producer sends the same models; a message that does not validate is dead-lettered at once, never retried.
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.consumers.lanes import KeyGate, Report, handle_outcome
from conveyor.consumers.typed import Payload, handler_call, payload_of
from conveyor.decorators import InvalidMessage, consumer

from conveyor import Admin, Message, Producer
from conveyor.errors import ConveyorError
from conveyor.testing import scrape_metric
from tests.helpers import publish, wait_for
from tests.runner.apps.typed_models import DataclassOrder, PydanticOrder, StructOrder
from tests.runner.runner_helpers import RunnerProcess


def rows(out, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_rows(out, name: str, count: int) -> list[dict[str, Any]]:
    return wait_for(lambda: len(rows(out, name)) >= count and rows(out, name), 30, message=f"{count} {name} rows")


def dead_letters(address: str, topic: str, count: int) -> list[Message]:
    def fetch() -> list[Message]:
        with Admin(address) as admin:
            try:
                return admin.fetch(f"{topic}.dlq", 0, 100)
            except ConveyorError:
                return []

    return wait_for(lambda: len(found := fetch()) >= count and found, 30, message=f"{count} dead letters")


def runner_metric(proc: RunnerProcess, name: str) -> float:
    url = next(m.group(1) for line in proc.lines if (m := re.search(r"metrics (http://\S+)\)", line)))
    return scrape_metric(url, name)


# --- real runner ---------------------------------------------------------------------------------


def test_each_model_kind_is_decoded_for_its_handler_and_producers_send_models(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    proc = RunnerProcess(address, tmp_path, "app_typed")
    try:
        # a plain map, as any producer (another language, an old one) sends it, then the model itself
        with Producer(address, linger_ms=1) as producer:
            for topic, model in (
                ("typed-pydantic", PydanticOrder(id=2, total=2.5)),
                ("typed-dataclass", DataclassOrder(id=2, total=2.5)),
                ("typed-struct", StructOrder(id=2, total=2.5)),
            ):
                producer.send(topic, {"id": 1, "total": 1})
                future = producer.send(topic, model)
            producer.send("typed-message", PydanticOrder(id=3, total=3.0, lines=["a"]), key="c-3")
            producer.send_many("typed-batch", [StructOrder(id=i, total=i) for i in range(4)])
            producer.flush(timeout=30)
            assert future.result(timeout=30) == 1
        for name, kind in (("pydantic", "PydanticOrder"), ("dataclass", "DataclassOrder"), ("struct", "StructOrder")):
            got = wait_rows(tmp_path, name, 2)
            assert [(r["type"], r["id"], r["total"]) for r in got] == [(kind, 1, 1.0), (kind, 2, 2.5)], name
        [typed] = wait_rows(tmp_path, "message", 1)
        assert typed == {"type": "PydanticOrder", "id": 3, "total": 3.0, "offset": 0, "attempt": 1, "key": "c-3"}
        batch = wait_rows(tmp_path, "batch", 4)
        assert sorted((r["type"], r["id"]) for r in batch) == [("StructOrder", i) for i in range(4)]
        with Admin(address) as admin:  # what a producer stored: a plain msgpack map, its content type saying so
            [stored] = admin.fetch("typed-message", 0, 1)
        assert stored.value == {"id": 3, "total": 3.0, "lines": ["a"]}
        assert stored.content_type == "application/msgpack; model=tests.runner.apps.typed_models.PydanticOrder"
        assert runner_metric(proc, "conveyor_runner_invalid_messages_total") == 0
    finally:
        proc.kill()


def test_a_message_that_does_not_validate_is_dead_lettered_at_once_with_the_error(conveyor_broker, tmp_path):
    address = conveyor_broker.address
    proc = RunnerProcess(address, tmp_path, "app_typed")
    try:
        publish(address, "typed-strict", [{"id": "not a number", "total": 1}, {"id": 7, "total": 7}])
        publish(address, "typed-batch", [{"id": 1, "total": 1}, {"total": 2}, {"id": 3, "total": 3}])
        publish(address, "typed-async-batch", [{"id": 1, "total": 1}, {"id": 2, "total": "x"}, {"id": 3, "total": 3}])
        [letter] = dead_letters(address, "typed-strict", 1)
        assert letter.value == {"id": "not a number", "total": 1}, "the dead letter holds the message as it came"
        headers = letter.headers
        assert headers["x-delivery-count"] == "1", "not retried, though @retry_policy allows 5 attempts"
        assert headers["x-last-error"].startswith("invalid message: PydanticOrder: 1 validation error")
        assert "id\n  Input should be a valid integer" in headers["x-last-error"]
        [dead] = wait_rows(tmp_path, "strict-dead", 1)
        assert (dead["offset"], dead["attempt"], dead["error"]) == (0, 1, "InvalidMessage")
        assert [r["id"] for r in wait_rows(tmp_path, "strict", 1)] == [7], "the next message is handled"
        # a batch handler gets the valid messages; the invalid one alone is dead-lettered
        assert sorted(r["id"] for r in wait_rows(tmp_path, "batch", 2)) == [1, 3]
        [batch_letter] = dead_letters(address, "typed-batch", 1)
        assert batch_letter.headers["x-origin-offset"] == "1"
        assert "Object missing required field `id`" in batch_letter.headers["x-last-error"]
        assert sorted(r["id"] for r in wait_rows(tmp_path, "async-batch", 2)) == [1, 3]
        [async_letter] = dead_letters(address, "typed-async-batch", 1)
        assert (
            async_letter.headers["x-last-error"]
            == "invalid message: DataclassOrder: $.total: expected float, got str 'x'"
        )
        assert wait_for(lambda: runner_metric(proc, "conveyor_runner_invalid_messages_total") == 3, 30)
        assert any("does not decode, dead-lettered without retry" in line for line in proc.lines)
        assert proc.proc.poll() is None, "the runner goes on"
        assert len(rows(tmp_path, "strict-dead")) == 1 and len(rows(tmp_path, "strict")) == 1
    finally:
        proc.kill()


# --- the annotation read, without a broker ----------------------------------------------------------


def test_payload_is_read_from_the_first_parameters_annotation():
    def bare(order: PydanticOrder) -> None: ...
    def wrapped(message: Message[DataclassOrder]) -> None: ...
    def batch(messages: list[StructOrder]) -> None: ...
    def plain(message: Message) -> None: ...
    def untyped(message): ...
    def unresolved(message: NotImported) -> None: ...  # type: ignore[name-defined] # noqa: F821
    def late(order: PydanticOrder) -> NotImported: ...  # type: ignore[name-defined] # noqa: F821

    assert payload_of(bare) == Payload(PydanticOrder, in_message=False)
    assert payload_of(wrapped) == Payload(DataclassOrder, in_message=True)
    assert payload_of(batch, batch=True) == Payload(StructOrder, in_message=False)
    assert payload_of(batch) is None, "list[Order] on a one-message handler is not a model"
    assert payload_of(plain) is None and payload_of(untyped) is None and payload_of(unresolved) is None
    assert payload_of(late) == Payload(PydanticOrder, in_message=False), "only the first hint must resolve"


def test_handler_call_decodes_or_raises_invalid_message():
    got: list[Any] = []

    @consumer("t", group="g")
    def bill(message: Message[PydanticOrder]) -> None:
        got.append(message.value)

    @consumer("t", group="h")
    def untyped(message: Message) -> None: ...

    call = handler_call(bill)
    message = Message("t", 0, 0.0, None, {"content-type": "application/msgpack"}, b"\x82\xa2id\x01\xa5total\x02")
    call(message)
    assert got == [PydanticOrder(id=1, total=2.0)] and message.value == PydanticOrder(id=1, total=2.0)
    try:
        call(Message("t", 1, 0.0, None, {}, b"raw bytes"))
    except InvalidMessage as exc:
        assert "Input should be a valid dictionary or instance of PydanticOrder" in exc.error
    else:
        raise AssertionError("a body that is no map must not reach the handler")
    assert handler_call(untyped) is untyped.fn, "an untyped handler is called as it is, at no cost"


def test_a_batch_with_invalid_messages_dead_letters_them_and_settles_the_rest_as_the_handler_did():
    @consumer("t", group="g", batch=True)
    def batch(orders: list[PydanticOrder]) -> None: ...

    messages = [Message("t", i, 0.0, None, {}, b"") for i in range(3)]
    for handler_error, acked, retried in ((None, [1, 2], []), (RuntimeError("boom"), [], [1, 2])):
        report = Report(None)
        exc = InvalidMessage("bad", invalid=[(messages[0], "bad")], handler_error=handler_error)
        handle_outcome(batch, messages, exc, report, KeyGate())
        assert report.dead == [(0, "invalid message: bad")] and report.invalid == 1
        assert report.acked == acked and [o for o, _d, _e in report.retried] == retried
