"""The ingest pipeline as four stages with one signature: each takes the items the stage before it yields
and yields its own (datatrove's `run(data)`), so a worker only wires them together.

    claim ──Task──► prepare ──Unit──► embed ──Embedded──► commit
      ledger          helpers          device             writer threads: rows + rejects + the chunk's cursor,
      (SKIP LOCKED,   (read, template,  (packed forward,   one transaction per unit, fenced by the claim's token
       lease, token)   tokenize, COPY)   pool, normalise)

A `Failure` can take the place of any item: it travels down to the commit stage, the one owner that records
failures in the ledger.

Glossary (one name per concept; docs/concepts.md says the same for users):

    job        what `embedfleet ingest` makes: inputs, model, template, table (a `JobSpec`, kept in the ledger)
    chunk      a claimable piece of a job's input, planned into the ledger: a byte span of a JSONL file, a run of
               row groups of a Parquet file, or a whole stream (CSV, .gz, .zst)
    claim      a worker's hold on a chunk: a lease and a fencing token (`ledger.Claim`)
    task       what one unit is made from: the claim, and the part of its chunk to read (a JSONL byte span the
               helper reads itself, or a stream's records or lines read by the claim stage)
    unit       a task prepared: COPY-ready rows without their vectors, the texts' tokens, the rejects, and the
               cursor its commit moves the chunk to; the grain of a transaction
    embedded   a unit with its vectors
    failure    what could not be done with a claim, and why
    worker     a process (or Ray actor) that runs these stages on one device
    helper     a process that prepares units for a worker (the prepare stage's pool)
    launcher   what starts a job's workers: local processes or Ray actors (`ingest.launch`)
    page span  a run of heap pages one COPY reads (`pg.scan`)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Protocol, TypeVar

import numpy as np

from embedfleet.ledger import Claim
from embedfleet.pg.copyin import EncodedRows
from embedfleet.sources.plan import ChunkSpec
from embedfleet.sources.records import Reject

__all__ = ["Embedded", "Failure", "FailedClaims", "Stage", "Task", "Unit", "IDLE"]

In = TypeVar("In", contravariant=True)
Out = TypeVar("Out", covariant=True)

# Yielded by the claim stage when nothing can be claimed right now: what is in flight is finished first.
IDLE = None


class Stage(Protocol[In, Out]):
    """A stage: the items of the stage before it in, its own out (a Failure passes through)."""

    def __call__(self, items: Iterator[In]) -> Iterator[Out]: ...


@dataclass
class Failure:
    """A claim (or one of its units) that could not be done, with why."""

    claim: Claim
    error: BaseException


@dataclass
class Task:
    """The part of a claimed chunk one unit is made from."""

    spec: ChunkSpec
    after_line: int  # resume cursor: lines up to here are done
    last_line: int | None  # --limit: no line after this one
    raws: list | None = None  # CSV/Parquet records read by the claim stage
    block: bytes | None = None  # whole lines of a compressed JSONL file, from line `first_line` on
    first_line: int = 1
    cursor_line: int = 0  # with raws or block: every line up to here is in this task or an earlier one
    last: bool = True  # the chunk's final unit: its commit marks the chunk done
    claim: Claim | None = None  # whose task it is (None: a task made outside a worker, e.g. in a test)
    # No raws and no block: the helper reads the plain-JSONL byte span `spec` itself.


@dataclass
class Unit:
    """A task prepared: a slice of a chunk's records, embedded together and committed in one transaction."""

    claim: Claim
    rows: EncodedRows  # COPY-ready rows, one per distinct id, without their embeddings
    seen: int  # records read, before merging duplicate ids
    rejects: list[Reject]
    cursor_line: int  # every line up to here has been read into this unit or an earlier one
    last: bool  # the chunk's final unit: commit marks the chunk done
    tokens: int = 0
    tok: object = None  # the encoder's Tokenized batch, in row order (dropped once embedded)
    id_prefix: str | None = None  # a --replace unit whose ids name lines: its lines' earlier rows are cleared
    passages: dict[str, int] | None = None  # --passages: each record's passages' count (the rest of its rows go)


@dataclass
class Embedded:
    """A unit with its vectors, ready to commit."""

    unit: Unit
    vectors: np.ndarray | None  # [unit.rows.n, dim], in row order (None: a unit of no rows)


@dataclass
class FailedClaims:
    """The claims whose chunk failed, by token: recorded once each (by the commit stage), and asked about by
    the stages before it, which drop the rest of such a chunk (it is retried from its last commit)."""

    tokens: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, claim: Claim) -> bool:
        """Mark `claim` failed; False when it already was."""
        with self._lock:
            if claim.token in self.tokens:
                return False
            self.tokens.add(claim.token)
            return True

    def __contains__(self, claim: Claim) -> bool:
        return claim.token in self.tokens
