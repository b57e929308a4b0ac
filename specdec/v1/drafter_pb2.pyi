from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SOURCE_UNSPECIFIED: _ClassVar[DraftSource]
    DRAFT_SOURCE_CONTEXT: _ClassVar[DraftSource]
    DRAFT_SOURCE_GLOBAL: _ClassVar[DraftSource]
    DRAFT_SOURCE_SUCCESSOR: _ClassVar[DraftSource]
DRAFT_SOURCE_UNSPECIFIED: DraftSource
DRAFT_SOURCE_CONTEXT: DraftSource
DRAFT_SOURCE_GLOBAL: DraftSource
DRAFT_SOURCE_SUCCESSOR: DraftSource

class Predictions(_message.Message):
    __slots__ = ("k", "previous", "current", "tokens")
    K_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    k: int
    previous: _containers.RepeatedScalarFieldContainer[int]
    current: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[int] = ..., previous: _Optional[_Iterable[int]] = ..., current: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("session_id", "new_tokens", "open", "num_draft_tokens", "verified_draft_tokens", "accepted_draft_tokens", "max_tree_nodes", "predictions", "scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    open: bool
    num_draft_tokens: int
    verified_draft_tokens: int
    accepted_draft_tokens: int
    max_tree_nodes: int
    predictions: Predictions
    scope: str
    def __init__(self, session_id: _Optional[str] = ..., new_tokens: _Optional[_Iterable[int]] = ..., open: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., verified_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., predictions: _Optional[_Union[Predictions, _Mapping]] = ..., scope: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("vocabulary", "sequences", "shared_scope")
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SHARED_SCOPE_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    shared_scope: str
    def __init__(self, vocabulary: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., shared_scope: _Optional[str] = ...) -> None: ...

class SequenceDraft(_message.Message):
    __slots__ = ("session_id", "tokens", "sources", "match_lengths", "counts", "totals", "parents")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sources: _containers.RepeatedScalarFieldContainer[DraftSource]
    match_lengths: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    totals: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sources: _Optional[_Iterable[_Union[DraftSource, str]]] = ..., match_lengths: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., totals: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("drafts",)
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[SequenceDraft]
    def __init__(self, drafts: _Optional[_Iterable[_Union[SequenceDraft, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("vocabulary", "observe_id", "sequences", "scope")
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    observe_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    scope: str
    def __init__(self, vocabulary: _Optional[str] = ..., observe_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., scope: _Optional[str] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("applied", "applied_sequences", "duplicate_sequences")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    applied_sequences: int
    duplicate_sequences: int
    def __init__(self, applied: _Optional[bool] = ..., applied_sequences: _Optional[int] = ..., duplicate_sequences: _Optional[int] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("vocabulary", "session_ids", "observe", "observe_id")
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_ID_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    observe: bool
    observe_id: str
    def __init__(self, vocabulary: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ..., observe: _Optional[bool] = ..., observe_id: _Optional[str] = ...) -> None: ...

class CloseSessionsResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("vocabulary",)
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    def __init__(self, vocabulary: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("entries", "bytes", "file_bytes", "max_bytes", "evictions", "open_sessions", "propose_calls", "proposed_tokens", "context_hits", "global_hits", "misses", "observed_tokens", "context_verified", "context_accepted", "global_verified", "global_accepted", "successor_entries", "successor_hits", "successor_verified", "successor_accepted", "scopes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_HITS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_HITS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SUCCESSOR_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    file_bytes: int
    max_bytes: int
    evictions: int
    open_sessions: int
    propose_calls: int
    proposed_tokens: int
    context_hits: int
    global_hits: int
    misses: int
    observed_tokens: int
    context_verified: int
    context_accepted: int
    global_verified: int
    global_accepted: int
    successor_entries: int
    successor_hits: int
    successor_verified: int
    successor_accepted: int
    scopes: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., file_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., propose_calls: _Optional[int] = ..., proposed_tokens: _Optional[int] = ..., context_hits: _Optional[int] = ..., global_hits: _Optional[int] = ..., misses: _Optional[int] = ..., observed_tokens: _Optional[int] = ..., context_verified: _Optional[int] = ..., context_accepted: _Optional[int] = ..., global_verified: _Optional[int] = ..., global_accepted: _Optional[int] = ..., successor_entries: _Optional[int] = ..., successor_hits: _Optional[int] = ..., successor_verified: _Optional[int] = ..., successor_accepted: _Optional[int] = ..., scopes: _Optional[int] = ...) -> None: ...

class BackupRequest(_message.Message):
    __slots__ = ("vocabulary", "destination")
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    destination: str
    def __init__(self, vocabulary: _Optional[str] = ..., destination: _Optional[str] = ...) -> None: ...

class BackupResponse(_message.Message):
    __slots__ = ("bytes", "log_sequence")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    log_sequence: int
    def __init__(self, bytes: _Optional[int] = ..., log_sequence: _Optional[int] = ...) -> None: ...

class ForgetRequest(_message.Message):
    __slots__ = ("vocabulary", "scope")
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    vocabulary: str
    scope: str
    def __init__(self, vocabulary: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class ForgetResponse(_message.Message):
    __slots__ = ("dropped", "log_sequence")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOG_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    log_sequence: int
    def __init__(self, dropped: _Optional[bool] = ..., log_sequence: _Optional[int] = ...) -> None: ...
