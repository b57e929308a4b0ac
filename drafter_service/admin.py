"""The drafter's admin calls, apart from serving: Stats, Backup and Forget. Served on the
main port, or only on --admin-port when it is set (``server._ServingOnly`` refuses them
on the main port then). ``DrafterServicer`` takes them from ``AdminCalls``."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from drafter_service.config import DrafterConfig
from drafter_service.log import LogUnavailable, ObservationLog
from drafter_service.metrics import DrafterMetrics
from drafter_service.replica import Replica
from drafter_service.request_checks import InvalidRequest, check
from drafter_service.scopes import DEFAULT_SCOPE, SCOPE_PATTERN
from drafter_service.sessions import SessionTable
from drafter_service.storage import StoreRegistry
from drafter_service.store import StoreClosed
from specdec.v1 import drafter_pb2

log = logging.getLogger(__name__)

# A backup's name: one plain path component, nothing a filesystem reads specially.
BACKUP_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class AdminCalls:
    """Stats, Backup and Forget over the servicer's tables, sessions and metrics."""

    config: DrafterConfig
    stores: StoreRegistry
    sessions: SessionTable
    metrics: DrafterMetrics
    log: ObservationLog | None
    replica: Replica | None
    _check_vocabulary: Callable[[str], None]  # the servicer's
    _trusted: Callable[[Any], bool]  # the servicer's: the client may declare scopes

    def Stats(self, request, context):
        if request.vocabulary:
            try:
                self._check_vocabulary(request.vocabulary)
            except InvalidRequest as invalid:
                context.abort(invalid.code, str(invalid))
        tables = self.stores.table_stats()
        if request.vocabulary:
            tables = {request.vocabulary: tables[request.vocabulary]} if request.vocabulary in tables else {}
        totals = {"entries": 0, "bytes": 0, "file_bytes": 0, "evictions": 0, "successor_entries": 0}
        for stats in tables.values():
            for name in totals:
                totals[name] += stats.get(name, 0)
        scopes = sum(stats.get("scopes", 0) for stats in tables.values())
        return drafter_pb2.StatsResponse(
            **totals,
            max_bytes=self.config.max_bytes * max(1, scopes),
            open_sessions=len(self.sessions),
            scopes=scopes,
            **self.metrics.stats(),
        )

    def Backup(self, request, context):
        """A compact copy of a vocabulary's tables in ``--backup-dir``/``destination``, one folder
        per scope named as in --db (a restore copies them back). Callers learn nothing about the
        filesystem beyond that directory: failures are logged here."""
        try:
            check(
                self.config.backup_dir is not None,
                "backups are off: start the drafter with --backup-dir DIR to allow them",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            self._check_vocabulary(request.vocabulary)
            check(
                bool(BACKUP_NAME_PATTERN.fullmatch(request.destination)),
                f"destination must be a plain name of 1-128 letters, digits, '.', '_' or '-' (not starting with "
                f"'.', '_' or '-'), got {request.destination[:200]!r}; the backup goes into the drafter's backup directory",
            )
            tables = self.stores.tables_of(request.vocabulary)
            check(bool(tables), f"no table for vocabulary {request.vocabulary}", grpc.StatusCode.NOT_FOUND)
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        destination = Path(self.config.backup_dir) / request.destination
        # Read before the copies: every message up to it is in them (later ones too, perhaps,
        # which each table's own mark makes a replica restored from the copy skip).
        sequence = self.replica.position.sequence if self.replica is not None else 0
        try:
            Path(self.config.backup_dir).mkdir(parents=True, exist_ok=True)
            destination.mkdir()  # exclusive: two callers never share a folder
        except FileExistsError:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a backup named {request.destination!r} already exists; pick another name")
        except OSError:
            log.exception("could not create backup folder %s", destination)
            context.abort(grpc.StatusCode.INTERNAL, "could not create the backup; the drafter's log says why")
        try:
            for name, store in tables.items():
                store.backup(str(destination / name))
            size = sum(f.stat().st_size for folder in destination.iterdir() for f in folder.iterdir())
        except StoreClosed as gone:
            shutil.rmtree(destination, ignore_errors=True)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{gone}; nothing was backed up")
        except Exception:
            log.exception("backup of %s into %s failed", request.vocabulary, destination)
            shutil.rmtree(destination, ignore_errors=True)
            context.abort(grpc.StatusCode.INTERNAL, "the backup failed and was removed; the drafter's log says why")
        return drafter_pb2.BackupResponse(bytes=size, log_sequence=sequence)

    def Forget(self, request, context: Any):
        """Drop a scope's table. With a log: publish the FORGET (every replica drops the table
        when it applies it), purge the scope's earlier messages from the log, and answer once
        this replica has applied it (UNAVAILABLE, to retry, when either does not happen in time)."""
        try:
            self._check_vocabulary(request.vocabulary)
            check(
                request.scope == DEFAULT_SCOPE or bool(SCOPE_PATTERN.fullmatch(request.scope)),
                f"scope must be empty (the default scope) or 32 lowercase hex digits, got {request.scope[:64]!r}",
            )
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        if not self._trusted(context):  # a client that may not name a scope may not forget one
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "Forget needs a client that may declare scopes (--client-token or --verifier-identities)",
            )
        if self.log is None or self.replica is None:
            return drafter_pb2.ForgetResponse(dropped=self.stores.drop(request.vocabulary, request.scope))
        held = self.stores.find(request.vocabulary, request.scope) is not None
        try:
            sequence = self.log.forget(request.vocabulary, request.scope)
        except LogUnavailable as away:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{away}; nothing was forgotten yet: retry")
        if not self.replica.wait_for(sequence, self.config.log.publish_timeout_s):
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the forget is in the log (sequence {sequence}) and every replica drops the table when it applies it; "
                "this replica has not applied it yet",
            )
        return drafter_pb2.ForgetResponse(
            dropped=held and self.stores.find(request.vocabulary, request.scope) is None, log_sequence=sequence
        )
