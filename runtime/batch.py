"""Continuous batching: many requests in flight on one model, each in its own KV cache row at its own position.

Each step is one ragged pass (`MoEModel.forward_rows`): the next token of every sequence that is decoding, then the
prompts of requests that have joined, in chunks, up to the step's token budget. A sequence that finishes frees its
row, and the next request waiting takes it at the next step. Every expert a step's tokens chose is read once for all
of them, so the more sequences in flight, the more tokens each read of the weights serves (MoE-Lightning's point).

With prefix reuse, a request that joins while another in flight has a prompt beginning as its own does not compute
that shared part again: it waits for the other's row to hold it, copies it (`copy_rows`) and prefills the rest (a
system prompt or few-shot examples common to a batch's requests are computed once).

A request's answer is the one `Engine.generate` gives it alone: the same sampling, on its own generator and seed,
over its own history; only the rounding of products over more rows can differ.

Letters: N tokens in a step, S sequences in it, V vocabulary.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from tandem.kernels.errors import GenerationError
from tandem.runtime.engine import FinishReason, check_scores
from tandem.runtime.model import MoEModel, Segment
from tandem.runtime.prefix import PrefixStore, common_length
from tandem.runtime.sampling import SamplingParams, next_token


@dataclass(frozen=True)
class BatchRequest:
    key: str  # the caller's name for it (an OpenAI batch line's custom_id)
    prompt: list[int]
    params: SamplingParams = SamplingParams()


@dataclass
class BatchResult:
    key: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: FinishReason | str  # "eos", "length", "context", "stop" (BatchEngine.finish) or "error"
    error: str = ""  # why the request was refused or stopped ("" when it ran)
    seconds: float = 0.0  # from joining the batch to finishing
    cached: int = 0  # prompt tokens not prefilled for it (prefix reuse): its row held them, or a leader's row did


@dataclass(frozen=True)
class TokenEvent:
    key: str
    token: int


@dataclass(frozen=True)
class DoneEvent:
    result: BatchResult


@dataclass
class BatchStats:
    steps: int = 0
    prompt_tokens: int = 0  # fed through prefill (a LongRoPE re-run counts again)
    new_tokens: int = 0
    busiest: int = 0  # most sequences in one step
    seconds: float = 0.0  # inside the engine's passes and sampling

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Sequence:
    request: BatchRequest
    row: int
    history: torch.Tensor  # [context] prompt + generated ids
    pos: int  # ids in history
    budget: int  # new tokens it may still take
    generator: torch.Generator
    long: bool  # LongRoPE's long tables for its next pass
    joined: float
    fed: int = 0  # ids of history already in its KV cache row
    tokens: list[int] = field(default_factory=list)
    cached: int = 0  # of those, held by the row when it joined (prefix reuse) or copied from its leader's
    # (prefix reuse) an active sequence whose prompt begins as this one's for `share` tokens: this one waits until
    # the leader's row holds them, then takes a copy of them rather than computing them a second time
    leader: _Sequence | None = field(default=None, repr=False)
    share: int = 0


WAIT_SLICE_S = 0.25


class RequestQueue:
    """Requests that arrive while the batch runs (a server's): `put` from any thread. The engine takes what is waiting
    without blocking while it has sequences to step, and waits on the queue when it has none. After `close`, the run
    ends once everything queued has been answered."""

    def __init__(self) -> None:
        self._waiting: deque[BatchRequest] = deque()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, request: BatchRequest) -> None:
        with self._ready:
            if self._closed:
                raise GenerationError("the engine has stopped taking requests")
            self._waiting.append(request)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def __len__(self) -> int:
        """Requests waiting for a row."""
        return len(self._waiting)

    def take(self, wait: bool) -> BatchRequest | None:
        """The next request; None when none is waiting (`wait`: after waiting for one until the queue is closed)."""
        with self._ready:
            while wait and not self._waiting and not self._closed:
                # in slices: Ctrl+C may be delivered to another thread, and Python runs its handler (on the main
                # thread) only when that thread returns to the interpreter
                self._ready.wait(WAIT_SLICE_S)
            return self._waiting.popleft() if self._waiting else None

    @property
    def ended(self) -> bool:
        with self._ready:
            return self._closed and not self._waiting


class _Listed:
    """A fixed list of requests as RequestQueue's reader sees one: closed from the start."""

    def __init__(self, requests: Iterable[BatchRequest]) -> None:
        self._it = iter(requests)
        self.ended = False

    def take(self, wait: bool) -> BatchRequest | None:
        request = next(self._it, None)
        self.ended = request is None
        return request


class BatchEngine:
    """Runs requests `max_batch` at a time, each step at most `step_tokens` tokens (a step's decode tokens always run;
    prompts fill what the budget leaves, at least one chunk when nothing is decoding)."""

    def __init__(self, model: MoEModel, eos_ids: Iterable[int], max_batch: int, step_tokens: int = 256,
                 micro_batches: int = 1, host_cache: bool = False, reuse: bool = False,
                 store: PrefixStore | None = None) -> None:
        """On an accelerator: `micro_batches` > 1 pipelines each step (one micro-batch's attention while the
        accelerator runs another's experts); `host_cache` keeps the batch's KV cache in RAM, attention on the CPU.
        `reuse`: a request joins the free row holding the longest prefix of its prompt and prefills only the rest
        (runtime/prefix.py); rows free longest are overwritten first, their prefix kept in `store` when given."""
        if max_batch < 1 or step_tokens < 1 or micro_batches < 1:
            raise ValueError("BatchEngine needs max_batch, step_tokens and micro_batches of at least 1")
        self.model = model.with_batch(max_batch, host_cache)
        self.model.micro_batches = micro_batches
        if model.prefill_chunk:  # on an accelerator: no pass beyond the activations it keeps back
            step_tokens = min(step_tokens, max(model.prefill_chunk, max_batch))
        self.eos_ids = frozenset(eos_ids)
        self.max_batch, self.step_tokens, self.reuse, self.store = max_batch, step_tokens, reuse, store
        self.stats = BatchStats()
        self._stopping: set[str] = set()

    def finish(self, key: str) -> None:
        """End request `key` before its next step (its consumer found a stop sequence in the text, or went away):
        it leaves with finish reason "stop" and the tokens it has. Safe from another thread; a request still
        waiting in a RequestQueue leaves when it is taken."""
        self._stopping.add(key)

    def run(self, requests: Iterable[BatchRequest] | RequestQueue) -> Iterator[TokenEvent | DoneEvent]:
        """Every request's tokens as they come, and one DoneEvent each when it ends (refused ones at once, with the
        reason): in the order the steps produce them. Requests are taken from `requests` as rows free up; from a
        RequestQueue, also as they arrive, until it is closed."""
        source = requests if isinstance(requests, RequestQueue) else _Listed(requests)
        free = list(range(self.max_batch))
        active: list[_Sequence] = []
        self.model.dispatcher.begin_request()
        while True:
            while free:
                request = source.take(wait=not active)
                if request is None:
                    break
                if request.key in self._stopping:  # stopped before it joined
                    self._stopping.discard(request.key)
                    yield DoneEvent(BatchResult(request.key, [], len(request.prompt), "stop"))
                    continue
                problem = self.refusal(request)
                if problem:
                    yield DoneEvent(BatchResult(request.key, [], len(request.prompt), "error", problem))
                    continue
                seq = self._join(request, free, active)
                if seq.budget == 0:  # nothing asked for: done without a pass
                    free.insert(0, seq.row)
                    yield DoneEvent(BatchResult(request.key, [], seq.pos, "length"))
                    continue
                active.append(seq)
            for seq in [s for s in active if s.request.key in self._stopping]:
                self._stopping.discard(seq.request.key)
                active.remove(seq)
                free.append(seq.row)
                yield self._done(seq, "stop")
            if not active:
                if source.ended:
                    return
                continue
            start = time.perf_counter()
            fed, logits = self._step(active)
            events = list(self._advance(fed, logits))
            self.stats.seconds += time.perf_counter() - start  # (not the consumer's time between events)
            for seq, event in events:
                if isinstance(event, DoneEvent):
                    active.remove(seq)
                    free.append(seq.row)
                    self._stopping.discard(seq.request.key)
                yield event

    def refusal(self, request: BatchRequest) -> str:
        """Why a request cannot run ("" when it can), as Engine.generate would refuse it."""
        try:
            request.params.check()
        except GenerationError as e:
            return str(e)
        context, vocab = self.model.context, self.model.cfg.vocab_size
        if request.params.beams > 1:
            return "beam search is not available in batch mode; leave beams at 1"
        if not request.prompt:
            return "the prompt is empty; give at least one token"
        if len(request.prompt) >= context:
            return (f"the prompt has {len(request.prompt)} tokens but the context holds {context}; shorten the prompt "
                    "or raise --context")
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            return f"prompt token ids must be in [0, {vocab}); the tokenizer does not match the model"
        return ""

    def _join(self, request: BatchRequest, free: list[int], active: list[_Sequence]) -> _Sequence:
        """`request` as a sequence, in the free row that holds the longest prefix of its prompt (with reuse on),
        else the row free longest (the first of `free`, from which its row is taken); with reuse on, following the
        active sequence whose prompt shares more of its own than any row or saved prefix holds."""
        generator = torch.Generator()
        if request.params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.params.seed)
        n, context = len(request.prompt), self.model.context
        history = torch.empty(context, dtype=torch.long)
        history[:n] = torch.tensor(request.prompt)
        switch = self.model.rope_switch
        long = switch is not None and n > switch
        held = self.model.cache.held
        reusable = [held.reusable(r, history[:n], long) if self.reuse else 0 for r in free]
        best = max(range(len(free)), key=lambda i: (reusable[i], -i))
        row, fed = free.pop(best), reusable[best]
        if self.reuse and self.store is not None:
            fed = self.store.take(self.model.cache, row, history[:n], long, fed)
        if self.model.recurrent and fed > 0:  # where the reused part ends: an edited last message takes up there
            self.model.cache.mark(row, fed)  # type: ignore[union-attr]
        seq = _Sequence(request, row, history, n, min(request.params.max_new_tokens, context - n), generator,
                        long=long, joined=time.perf_counter(), fed=fed, cached=fed)
        if self.reuse:
            seq.leader, seq.share = _leader(seq, active)
        return seq

    def _take_shares(self, active: list[_Sequence]) -> None:
        """Followers whose leader's row now holds what they share take a copy of it; those whose leader left (or
        was rotated otherwise: LongRoPE's switch) compute it themselves."""
        for seq in active:
            leader = seq.leader
            if leader is None:
                continue
            if not any(s is leader for s in active) or leader.long != seq.long:
                seq.leader = None
            elif leader.fed >= seq.share:
                seq.leader = None
                cache = self.model.cache
                cache.copy_rows([(seq.row, leader.row)], seq.share)
                # (what the copy holds of the prompt, as the record has it: the same check a held row gets)
                held = cache.held.reusable(seq.row, seq.history[: seq.pos], seq.long)
                if held > seq.fed:
                    seq.cached += held - seq.fed
                    seq.fed = held

    def _step(self, active: list[_Sequence]) -> tuple[list[_Sequence], torch.Tensor]:
        """One ragged pass over what the active sequences have not fed yet: decode tokens first (one each), then
        prompt chunks within the budget. Returns the sequences in the pass, in its order, and their last token's
        logits [S, V]. Followers take their leader's share first (and again after the pass: a leader may finish
        in the step that completes its share); those still waiting for it are left out."""
        self._take_shares(active)
        decoding = [s for s in active if s.pos - s.fed == 1]
        prefilling = [s for s in active if s.pos - s.fed > 1 and s.leader is None]
        room = max(self.step_tokens - len(decoding), 0 if decoding else 1)
        chosen: list[tuple[_Sequence, int]] = [(s, 1) for s in decoding]
        # a recurrent state holds at one position: a prompt stops before its last token, whose state is marked there
        # (a retry or an edited last message takes up again there: runtime/state.py), the last token decoding next
        recurrent = self.model.recurrent
        for s in prefilling:
            if room == 0:
                break
            take = min(s.pos - s.fed - (1 if recurrent else 0), room)
            chosen.append((s, take))
            room -= take
        segments = [Segment(s.row, s.fed, take, s.long) for s, take in chosen]
        ids = torch.cat([s.history[s.fed : s.fed + take] for s, take in chosen])  # [N]
        # a prompt's tokens (the last one alone too, when its row held the rest: prefix reuse) are prefill
        prompting = [s.fed < len(s.request.prompt) for s, _ in chosen]
        phase = "prefill" if any(prompting) else "decode"
        logits = self.model.forward_rows(ids, segments, phase)  # [S, V]
        for (s, take), prompt in zip(chosen, prompting, strict=True):
            if prompt:
                self.stats.prompt_tokens += take
            s.fed += take
            if recurrent and prompt and s.fed == s.pos - 1:
                self.model.cache.mark(s.row, s.fed)  # type: ignore[union-attr]
        self.stats.steps += 1
        self.stats.busiest = max(self.stats.busiest, len(chosen))
        self._take_shares(active)
        return [s for s, _ in chosen], logits

    def _advance(self, fed: list[_Sequence], logits: torch.Tensor
                 ) -> Iterator[tuple[_Sequence, TokenEvent | DoneEvent]]:
        """Sample the next token of each sequence whose history is now all in its cache, as Engine._run does; each
        event with its sequence."""
        for seq, row_logits in zip(fed, logits, strict=True):
            if seq.fed < seq.pos:  # a prompt chunk: its logits are not the last position's
                continue
            params = seq.request.params
            try:
                check_scores(row_logits, len(seq.tokens))
                token = next_token(row_logits, params, seq.history[: seq.pos], seq.generator)
            except GenerationError as e:
                yield seq, self._done(seq, "error", str(e))
                continue
            if token in self.eos_ids:
                yield seq, self._done(seq, "eos")
                continue
            seq.history[seq.pos] = token
            seq.pos += 1
            seq.budget -= 1
            seq.tokens.append(token)
            self.stats.new_tokens += 1
            yield seq, TokenEvent(seq.request.key, token)
            if seq.budget == 0:
                yield seq, self._done(seq, "length" if len(seq.tokens) == params.max_new_tokens else "context")
            elif self.model.rope_switch is not None and seq.pos - 1 == self.model.rope_switch:
                # the cached keys were rotated with the short tables: the whole sequence again with the long ones,
                # once, as Engine._rope_switches does
                seq.fed, seq.long = 0, True

    @staticmethod
    def _done(seq: _Sequence, reason: str, error: str = "") -> DoneEvent:
        return DoneEvent(BatchResult(seq.request.key, seq.tokens, len(seq.request.prompt), reason, error,
                                     time.perf_counter() - seq.joined, seq.cached))


SHARE_LEAST = 16  # tokens: a shorter common prefix is not worth waiting for


def _leader(seq: _Sequence, active: list[_Sequence]) -> tuple[_Sequence | None, int]:
    """The active sequence (rotated as `seq` is) whose prompt shares the longest prefix with `seq`'s, and that
    length (at most all of `seq`'s prompt but its last token), when it is at least SHARE_LEAST beyond what `seq`'s
    row holds already; else (None, 0)."""
    n = seq.pos - 1
    found, most = None, seq.fed + SHARE_LEAST - 1
    for other in active:
        m = min(n, len(other.request.prompt))
        if other.long != seq.long or m <= most:
            continue
        match = common_length(other.history[:m], seq.history[:m])
        if match > most:
            found, most = other, match
    return (found, most) if found is not None else (None, 0)
