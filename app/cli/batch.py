"""`tandem batch IN.jsonl --out OUT.jsonl`: every request of the file through continuous batching on one model, with
a progress line, results appended as they finish, and a second run picking up where an interrupted one stopped."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from tandem.app.cli.batch_file import Line, ResultsFile, check_files, error_record, read_requests, result_record
from tandem.app.cli.from_flags import LoadFor, configure_from_args, load_configured, resolve_model
from tandem.app.serve.openai_api import Answer
from tandem.autotune.batch_plan import BatchMachine, BatchPolicy, BatchShape, Workload, plan_batch
from tandem.autotune.configure import Configured
from tandem.autotune.measurements import Measurements
from tandem.autotune.plan import ModelShape
from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent
from tandem.runtime.layers import cache_in_ram_serves
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import StreamDecoder, Tokenizer

Note = Callable[[str], None]


class BatchProgress:
    """Requests done, generated tokens/s and the time left, on one line of stderr: rewritten in place on a terminal
    (at most every half second), a line at each tenth of the work in a log."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.done, self.tokens = total, 0, 0
        self.stream = stream or sys.stderr
        self.start = self.shown = time.perf_counter()
        self.tenth = 0

    def token(self) -> None:
        self.tokens += 1
        self._show()

    def finished(self) -> None:
        self.done += 1
        self._show(force=self.done == self.total)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        left = "?"
        if self.done:
            seconds = elapsed / self.done * (self.total - self.done)
            left = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
        width = 24
        bar = "#" * (width * self.done // max(1, self.total))
        return f"[{bar:<{width}}] {self.done}/{self.total} requests, {rate:.1f} tok/s, ETA {left}"

    def _show(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.stream.isatty():
            if force or now - self.shown >= 0.5:
                self.shown = now
                print(f"\r{self.line()}", end="\n" if self.done == self.total else "", file=self.stream, flush=True)
        elif force or self.done * 10 // max(1, self.total) > self.tenth:
            self.tenth = self.done * 10 // max(1, self.total)
            print(self.line(), file=self.stream, flush=True)


def sampling_defaults(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed)


def batch_context(lines: list[Line], limit: int) -> int:
    """The context a run needs: its longest prompt plus its answer, within the model's limit."""
    longest = max(len(x.request.prompt) + x.request.params.max_new_tokens for x in lines if x.request)
    return max(2, min(limit, longest))


def workload(lines: list[Line], context: int) -> Workload:
    """The requests as the policy sees them: a request makes at most what its context leaves after its prompt (a
    max_tokens of a billion is no billion steps to simulate)."""
    reqs = [x.request for x in lines if x.request]
    prompts = [min(len(r.prompt), context) for r in reqs]
    news = [max(1, min(r.params.max_new_tokens, context - p)) for r, p in zip(reqs, prompts, strict=True)]
    return Workload(len(reqs), round(sum(prompts) / len(reqs)), round(sum(news) / len(reqs)))


def batch_measurements(configured: Configured, notify: Note) -> Measurements:
    """The measurements of the profile the settings came from, if one was used, else a second's probe (said so)."""
    from tandem.autotune.microbench import quick_measurements

    options, ckpt = configured.options, configured.checkpoint
    if configured.measurements is not None:
        return configured.measurements
    notify("no profile of this model on this machine: the batch policy uses a one-second probe "
           "(`tandem autotune` measures it properly)")
    shape = ModelShape.from_checkpoint(ckpt, options.torch_dtype.itemsize)
    # at the thread count the experts will run at (none given: torch's, as CpuExecutor takes it)
    return quick_measurements(shape, options.cpu_torch_dtype, options.cpu.threads or torch.get_num_threads())


def choose_policy(configured: Configured, lines: list[Line], meas: Measurements, batch: int | None = None
                  ) -> BatchPolicy:
    """The batch policy for these requests: the KV cache may take KV_SHARE of the RAM the model leaves free."""
    from tandem.autotune.batch_plan import KV_SHARE
    from tandem.runtime.accelerator import accelerator_budget
    from tandem.runtime.memory import accelerator_bytes, available_ram, estimate_memory

    options, ckpt = configured.options, configured.checkpoint
    model_bytes = estimate_memory(ckpt, options.torch_dtype, options.context, 1, options.cpu).total
    budget = int(KV_SHARE * max(0, available_ram() - model_bytes))
    shape = ModelShape.from_checkpoint(ckpt, options.torch_dtype.itemsize)
    bs = BatchShape.from_config(ckpt.config, shape, options.torch_dtype.itemsize)
    machine = BatchMachine.from_measurements(meas, options.cpu.threads, crossover=options.cpu.crossover)
    vram = accelerator_budget(options.accelerator, options.vram_gb, options.gpu)
    vram_free = None if vram is None else max(0, vram - accelerator_bytes(ckpt, options.torch_dtype,
                                                                         options.context, 1))
    return plan_batch(bs, machine, workload(lines, options.context), budget, options.context, vram_free,
                      host_attention=cache_in_ram_serves(ckpt.config), batch=batch)


@dataclass(frozen=True)
class BatchSetup:
    """A run decided: the settings resolved for the policy's batch, and the policy."""

    configured: Configured  # for the policy's batch (nothing to run: for one sequence)
    policy: BatchPolicy | None  # None: nothing to run


def read_batch(args: argparse.Namespace) -> tuple[str, Tokenizer, list[Line]]:
    """The model to run (resolved), its tokenizer and every request of the input file."""
    check_files(Path(args.input), Path(args.out))  # before any work: an output that is the input, or not a file
    model = resolve_model(args.model)
    tokenizer = Tokenizer.from_model(model)
    return model, tokenizer, read_requests(Path(args.input), tokenizer, sampling_defaults(args))


def configure_batch(args: argparse.Namespace, say: Note, read: tuple[str, Tokenizer, list[Line]] | None = None,
                    done: set[object] | frozenset[object] = frozenset()) -> BatchSetup:
    """Resolve the flags for the requests not `done` yet (the context the longest needs when --context is not
    given), choose the batch policy, and resolve again for its batch: the checkpoint opened and the machine probed
    once each. `read`: `read_batch`'s, when the caller has it."""
    from tandem.runtime.checkpoint import open_checkpoint

    model, _, lines = read or read_batch(args)
    runnable = [x for x in lines if x.request and x.key not in done]
    ckpt = open_checkpoint(model)
    context = batch_context(runnable, ckpt.config.max_position_embeddings) if runnable else None
    configured = configure_from_args(args, LoadFor(context=context), model=model, checkpoint=ckpt)
    if not runnable:
        return BatchSetup(configured, None)
    policy = choose_policy(configured, runnable, batch_measurements(configured, say), args.batch_size)
    on_host = policy.attention == "cpu" and configured.options.accelerator != "none"
    # the accelerator keeps room for the batch's KV cache when attention runs there (loaded with it, before the
    # expert slots take the rest); in RAM, the engine makes it
    return BatchSetup(configured.again(batch=1 if on_host else policy.batch, ragged=True), policy)


def run_batch(args: argparse.Namespace, say: Note) -> int:
    """The command (`say`: its notices)."""
    read = read_batch(args)
    _, tokenizer, lines = read
    results = ResultsFile(Path(args.out), avoid=_identity(Path(args.input)))
    todo = [x for x in lines if x.key not in results.done]
    if len(todo) < len(lines):
        say(f"{len(lines) - len(todo)} of {len(lines)} requests already answered in {args.out}: going on with the rest")
    try:
        for x in todo:
            if x.error:
                results.write(error_record(x, x.error))
        runnable = [x for x in todo if x.request]
        if not runnable:
            return 0
        setup = configure_batch(args, say, read, results.done)
        return _answer(args, runnable, results, tokenizer, setup, say)
    except KeyboardInterrupt:
        print(f"\ninterrupted: answers so far are in {args.out}; run the same command again to go on",
              file=sys.stderr)
        raise
    finally:
        results.close()


def _answer(args: argparse.Namespace, runnable: list[Line], results: ResultsFile, tokenizer: Tokenizer,
            setup: BatchSetup, say: Note) -> int:
    configured, policy = setup.configured, setup.policy
    assert policy is not None
    size = policy.batch
    step = args.step_tokens or policy.step_tokens
    on_host = policy.attention == "cpu" and configured.options.accelerator != "none"
    where = ""
    if configured.options.accelerator != "none":
        where = f", attention on the {'CPU' if on_host else 'accelerator'}"
        where += f" in {policy.micro_batches} pipelined micro-batches" if policy.micro_batches > 1 else ""
    say(f"batch of {size} sequences, steps of up to {step} tokens{where} "
        f"({'chosen' if args.batch_size is None else 'asked'}; predicted {policy.predicted.tok_s:.1f} tok/s)")
    loaded = load_configured(configured, tokenizer, notify=say)
    engine = BatchEngine(loaded.model, loaded.engine.eos_ids, size, step, policy.micro_batches, on_host,
                         configured.options.prefix_reuse, loaded.engine.store)
    by_key = {x.key: x for x in runnable}
    answers = {x.key: Answer(x.stops) for x in runnable}
    decoders = {x.key: StreamDecoder(tokenizer) for x in runnable}
    progress = BatchProgress(len(runnable))
    name = configured.options.model.name
    try:
        for event in engine.run(_requests(runnable)):
            if isinstance(event, DoneEvent):
                r = event.result
                answers[r.key].add(decoders[r.key].flush(), token=False)
                results.write(result_record(by_key[r.key], r, answers[r.key], name))
                del decoders[r.key]
                progress.finished()
            else:
                if answers[event.key].add(decoders[event.key].push(event.token)):
                    engine.finish(event.key)
                progress.token()
    finally:
        loaded.model.dispatcher.close()
    return 0


def _identity(path: Path) -> tuple[int, int] | None:
    """The file's device and inode (what names it however it is spelt or linked), or None when it has none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _requests(lines: list[Line]) -> list[BatchRequest]:
    return [x.request for x in lines if x.request is not None]
