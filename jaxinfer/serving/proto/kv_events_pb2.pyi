from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hash", "parent_hash")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hash: int
    parent_hash: int
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("seq", "block_hashes", "block_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class WatchKVEventsResponse(_message.Message):
    __slots__ = ("snapshot", "batch")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    snapshot: KVSnapshot
    batch: KVEventBatch
    def __init__(self, snapshot: _Optional[_Union[KVSnapshot, _Mapping]] = ..., batch: _Optional[_Union[KVEventBatch, _Mapping]] = ...) -> None: ...
