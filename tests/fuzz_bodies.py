"""Hypothesis strategies for hostile gRPC request bodies, built from the proto descriptors.

`bodies(descriptor, vocabulary)` draws the bytes of one request, three ways:
  generated  a message of that type, every field drawn by its proto type, with
             strings and integers often taken from a vocabulary of real values
             (engine ids, request ids, epochs, addresses) so that requests get
             past the first lookup, and from hostile ones (newlines, non-ASCII,
             path tricks, boundaries of every integer type, unknown enum values);
             or a real message of the fleet, as is or with one or two of its
             fields, at any depth, redrawn that way
  mutated    a generated or real message's bytes, then 1-4 byte-level edits
             (flip, insert, delete, truncate, repeat, an over-long varint)
  raw        random bytes
Nothing here knows which values kvxfer accepts: the server has to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
INT_BOUNDS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
HOSTILE_STRINGS = (
    "", " ", "a b", "r\n", "r\r\nx", "ré", "日本", "\x00", "\x7f", "x" * 300, "y" * 5000,
    ".", "..", "../etc/passwd", "/dev/shm/x", "kvxfer-x/../y", "%s%n", "{}", "-1",
    "127.0.0.1:0", "127.0.0.1:1", "localhost:9", "[::1]:1", "0.0.0.0:1", "unix:/tmp/nope",
    "host:99999", ":", "a:b:c",
)  # fmt: skip
MAX_DEPTH = 3


@dataclass(frozen=True)
class Vocabulary:
    """Real values of the running fleet, mixed into generated messages."""

    strings: tuple[str, ...] = ()
    ints: tuple[int, ...] = ()
    messages: Mapping[str, Sequence[Message]] = field(default_factory=dict)  # by full name


def _integers(kind: int, vocab: Vocabulary) -> st.SearchStrategy[int]:
    low, high = INT_BOUNDS[kind]
    near = [v for v in (low, low + 1, -1, 0, 1, 2, 16, 4096, high - 1, high) if low <= v <= high]
    real = [v for v in vocab.ints if low <= v <= high]
    return st.one_of(
        st.sampled_from(near + real), st.integers(0, 64).filter(lambda v: v <= high),
        st.integers(low, high),
    )  # fmt: skip


def _scalar(fd: FieldDescriptor, vocab: Vocabulary) -> st.SearchStrategy[object]:
    if fd.type in INT_BOUNDS:
        return _integers(fd.type, vocab)
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if fd.type == F.TYPE_FLOAT else 64)
    if fd.type == F.TYPE_STRING:
        known = HOSTILE_STRINGS + vocab.strings
        return st.one_of(st.sampled_from(known), st.text(max_size=40))
    if fd.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if fd.type == F.TYPE_ENUM:
        numbers = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"no strategy for field {fd.full_name} of type {fd.type}")


def messages(
    descriptor: Descriptor, vocab: Vocabulary, depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of this type, any subset of fields set, repeated fields 0-5 long."""
    cls = GetMessageClass(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    optional = {}
    for fd in descriptor.fields:
        one = (
            messages(fd.message_type, vocab, depth + 1)
            if fd.type == F.TYPE_MESSAGE
            else _scalar(fd, vocab)
        )
        optional[fd.name] = st.lists(one, max_size=5) if fd.is_repeated else one

    def build(values: dict[str, object]) -> Message:
        message = cls()
        for name, value in values.items():
            target = getattr(message, name)
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, Message):
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)
            elif isinstance(value, Message):
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    generated = st.fixed_dictionaries({}, optional=optional).map(build)
    real = vocab.messages.get(descriptor.full_name, ())
    if not real:
        return generated
    return st.one_of(generated, st.sampled_from(real), tweaked(real, vocab))


Leaf = tuple[Message, FieldDescriptor, int | None]  # (message, scalar field, index or append)


def _leaves(message: Message) -> list[Leaf]:
    """Every scalar field of a message and of the messages set inside it."""
    found: list[Leaf] = []
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.type == F.TYPE_MESSAGE:
            children = list(value) if fd.is_repeated else [value] * message.HasField(fd.name)
            for child in children:
                found += _leaves(child)
        elif fd.is_repeated:
            found += [(message, fd, i) for i in range(len(value))] + [(message, fd, None)]
        else:
            found.append((message, fd, None))
    return found


@st.composite
def tweaked(draw: st.DrawFn, real: Sequence[Message], vocab: Vocabulary) -> Message:
    """A real message with one or two scalar fields, anywhere inside it, redrawn: it
    gets past decoding and most checks, and its one bad value reaches deep code."""
    message = type(real[0])()
    message.CopyFrom(draw(st.sampled_from(real)))
    leaves = _leaves(message)
    for _ in range(draw(st.integers(1, 2))):
        parent, fd, index = draw(st.sampled_from(leaves))
        value = draw(_scalar(fd, vocab))
        if not fd.is_repeated:
            setattr(parent, fd.name, value)
        elif index is None:
            getattr(parent, fd.name).append(value)
        else:
            getattr(parent, fd.name)[index] = value
    return message


OVERLONG_VARINT = b"\xff" * 10 + b"\x01"


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "insert", "delete", "truncate", "repeat", "varint")))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            index = min(at, len(data) - 1)
            data[index] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 32))] * draw(st.integers(2, 50))
        elif op == "varint":
            data[at:at] = OVERLONG_VARINT
    return bytes(data)


KINDS = ("generated", "mutated", "raw")


def bodies(descriptor: Descriptor, vocab: Vocabulary, kind: str) -> st.SearchStrategy[bytes]:
    """Request bodies of one kind: generated, mutated or raw."""
    generated = messages(descriptor, vocab).map(lambda m: m.SerializeToString())
    if kind == "generated":
        return generated
    if kind == "mutated":
        return mutated(generated)
    if kind == "raw":
        return st.binary(max_size=512)
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
