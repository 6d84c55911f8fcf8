from jaxinfer.serving.proto import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingOptions
    skip_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingOptions, _Mapping]] = ..., skip_tokens: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillClientMessage(_message.Message):
    __slots__ = ("request", "ack")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    ack: Ack
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype", "names", "scale_groups")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SCALE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    names: _containers.RepeatedScalarFieldContainer[str]
    scale_groups: int
    def __init__(self, num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., scale_groups: _Optional[int] = ...) -> None: ...

class PrefillHeader(_message.Message):
    __slots__ = ("first_token", "layout", "num_prompt_tokens", "first_page", "num_pages", "cached_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: _inference_pb2.TokenLogprob
    layout: KVLayout
    num_prompt_tokens: int
    first_page: int
    num_pages: int
    cached_tokens: int
    def __init__(self, first_token: _Optional[_Union[_inference_pb2.TokenLogprob, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("first_page", "num_pages", "data")
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_page: int
    num_pages: int
    data: bytes
    def __init__(self, first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class PrefillServerMessage(_message.Message):
    __slots__ = ("header", "chunk", "done")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    header: PrefillHeader
    chunk: KVChunk
    done: PrefillDone
    def __init__(self, header: _Optional[_Union[PrefillHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...
