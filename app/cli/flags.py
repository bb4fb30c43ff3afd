"""Command-line flag values: each numeric flag is read by a type function that refuses what cannot work.

A value is refused while the arguments are read, before any model loads, so a typo costs nothing. Every
refusal is a `UsageError` (printed as one `error: ...` line, exit status 2), never argparse's own exit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, get_args

from tandem.kernels.errors import TandemError, UsageError
from tandem.kernels.names import GROUPS, ISAS, Quant
from tandem.runtime.choices import DTYPE_NAMES, AcceleratorKind, PredictorKind, Strategy
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.latency import LatencyModel
from tandem.runtime.paths import read_bounded

SEED_MAX = 2**63 - 1  # torch's generators take a signed 64-bit seed; larger ones overflow inside torch


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing the usage and exiting (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _describe(low: float | None, high: float | None, low_open: bool = False) -> str:
    def show(x: float | None) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if high is None:
        return f"more than {show(low)}" if low_open else f"at least {show(low)}"
    if low is None:
        return f"at most {show(high)}"
    return f"more than {show(low)} and at most {show(high)}" if low_open else f"between {show(low)} and {show(high)}"


def whole(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A whole number in [low, high] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_describe(low, high)} (got {text})")
        return value

    parse.__name__ = "whole number"
    return parse


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] ((low, high] with `low_open`). NaN and infinities are refused: they pass
    every comparison test silently and then poison the arithmetic they reach (sampling, byte budgets)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
        if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_describe(low, high, low_open)} (got {text})")
        return value

    parse.__name__ = "number"
    return parse


def cpu_threads_available() -> int:
    """The most threads worth asking for: the CPU threads this machine has (more only oversubscribes)."""
    return os.cpu_count() or 1


def threads(text: str) -> int:
    """A thread count from 1 to this machine's CPU threads (a count outside that never reaches the kernels)."""
    limit = cpu_threads_available()
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if not 1 <= value <= limit:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {limit}, the number of CPU threads this machine has (got {text})")
    return value


def path(text: str) -> str:
    """A file or folder name: an empty one is refused (`--model ""` from an unset shell variable must not quietly
    mean the default model, nor "" mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, not an empty string")
    return text


path.__name__ = "path"

MAX_VRAM_GB = 1e6  # a petabyte of accelerator memory: beyond any device, and bytes that still fit an int64

seed = whole(0, SEED_MAX)
seed.__name__ = "seed"


def cost(text: str) -> LatencyModel:
    """`--cost A,B,GPU,T`: four finite, non-negative latencies in ms."""
    try:
        return LatencyModel.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def names(known: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """A comma list of names, each one of `known` (an unknown name is refused, never replaced by a default)."""

    def parse(text: str) -> tuple[str, ...]:
        given = tuple(n.strip() for n in text.split(","))
        unknown = [n for n in given if n not in known]
        if unknown or not given:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(repr(n) for n in unknown)}; choose from {', '.join(known)}")
        return given

    parse.__name__ = what
    return parse


def whole_list(low: int, high: int) -> Callable[[str], tuple[int, ...]]:
    """A comma list of whole numbers, each in [low, high]."""
    one = whole(low, high)

    def parse(text: str) -> tuple[int, ...]:
        values = []
        for part in text.split(","):
            try:
                values.append(one(part.strip()))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"a comma list of whole numbers from {low} to {high}: {e}") from None
        return tuple(values)

    parse.__name__ = "list of whole numbers"
    return parse


DTYPE_CHOICES = ["auto", *DTYPE_NAMES]

# Every flag of every command, declared once: (names, argparse keywords). A command lists the flags it takes
# (`declare`), overriding a keyword only where its meaning differs (a required --model, --tokens counting other
# things). Defaults that the profile may fill are None: "not given" must be told apart from a value.
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    # the model and the prompt
    "--model": (("--model",), dict(type=path, default=None,
                                   help="Hugging Face model folder (config.json + *.safetensors), a .gguf file or an "
                                        "Ollama model's name (`tandem models` lists them); default: the built-in "
                                        "model")),
    "--prompt": (("-p", "--prompt"), dict(default=None, help="the prompt text")),
    "--chat": (("--chat",), dict(action="store_true", help="wrap the prompt in the model's chat template")),
    "--models-dir": (("--models-dir",), dict(action="append", default=[], metavar="DIR",
                                             help="a folder of models (folders, .gguf files) for the picker (Ctrl+O) "
                                                  "and `tandem models`; repeatable (default: ~/models)")),
    # sampling
    "--max-new-tokens": (("--max-new-tokens",), dict(type=whole(0), default=256)),
    "--temperature": (("--temperature",), dict(type=real(0), default=0.0, help="0 = greedy (default)")),
    "--top-k": (("--top-k",), dict(type=whole(0), default=0, help="0 = off")),
    "--top-p": (("--top-p",), dict(type=real(0, 1, low_open=True), default=1.0, help="1 = off")),
    "--repetition-penalty": (("--repetition-penalty",), dict(type=real(0, low_open=True), default=1.0,
                                                             help="1 = off")),
    "--seed": (("--seed",), dict(type=seed, default=None)),
    "--beams": (("--beams",), dict(type=whole(1), default=1, help="beam search width (1 = off)")),
    "--batch-size": (("--batch-size",), dict(type=whole(1, 4096), default=None, metavar="N",
                                             help="sequences in flight at once (default: the batch policy's choice)")),
    "--step-tokens": (("--step-tokens",), dict(type=whole(1, 1 << 16), default=None, metavar="N",
                                               help="tokens a step takes at most, decode tokens and prompt chunks "
                                                    "together (default: the batch policy's choice)")),
    # the load
    "--dtype": (("--dtype",), dict(choices=DTYPE_CHOICES, default="auto",
                                   help="compute dtype (auto: on a GPU, bf16 from Ampere on and fp16 before; on the "
                                        "CPU, bf16 where it has native bf16, else fp32)")),
    "--context": (("--context",), dict(type=whole(2), default=None,
                                       help="context length to allocate (default: min(model, 4096))")),
    "--force": (("--force",), dict(action="store_true", help="load even if the RAM estimate says it will not fit")),
    "--show-config": (("--show-config",), dict(action="store_true",
                                               help="print the settings this would run with (and where each comes "
                                                    "from: flag, profile, default or this machine), then stop")),
    "--no-profile": (("--no-profile",), dict(action="store_true",
                                             help="ignore this machine's tuning profile (flags given explicitly always "
                                                  "win over it)")),
    "--accelerator": (("--accelerator",), dict(choices=list(get_args(AcceleratorKind)), default=None,
                                               help="auto (default): CUDA when usable, else CPU only; emulated: the "
                                                    "CPU plays a GPU (needs --vram-gb)")),
    "--vram-gb": (("--vram-gb",), dict(type=real(0, MAX_VRAM_GB, low_open=True), default=None,
                                       help=f"accelerator memory budget in GB, at most {MAX_VRAM_GB:g} (caps CUDA)")),
    "--gpu": (("--gpu",), dict(type=whole(0), default=None, metavar="N",
                               help="which CUDA GPU, numbered as nvidia-smi and `tandem probe` do (PCI bus order); "
                                    "default 0")),
    "--strategy": (("--strategy",), dict(choices=[str(s) for s in Strategy], default=None,
                                         help="fiddler: per-expert choice by latency; cpu: never copy weights; "
                                              "fetch: always copy")),
    "--cache-ways": (("--cache-ways",), dict(type=whole(0), default=None,
                                             help="ways per index of the expert cache (0: no cache, only static "
                                                  "placement)")),
    "--cache-policy": (("--cache-policy",), dict(choices=[str(p) for p in CachePolicy], default=None,
                                                 help="default: lru")),
    "--max-inflight": (("--max-inflight",), dict(type=whole(1), default=None,
                                                 help="background expert copies in flight at most (default: 4)")),
    "--prefetch": (("--prefetch",), dict(choices=[str(p) for p in PredictorKind], default=None,
                                         help="copy the experts the next MoE layers are predicted to ask for into "
                                              "the accelerator's cache ahead of their routers: previous-token, "
                                              "stale-gate (the next routers on this layer's input) or eam "
                                              "(MoE-Infinity's activation matrices); default: the tuned plan's, "
                                              "else none")),
    "--prefetch-depth": (("--prefetch-depth",), dict(type=whole(1), default=None, metavar="D",
                                                     help="MoE layers ahead to prefetch for, 1-4 (default: the "
                                                          "tuned plan's, else 1)")),
    "--readahead": (("--readahead",), dict(action="store_true",
                                           help="without a GPU, where experts stay in their files (a model larger "
                                                "than RAM): read each layer's experts ahead once routed (decode then "
                                                "runs layer by layer)")),
    "--placement": (("--placement",), dict(type=path, metavar="FILE",
                                           help="pin the most popular experts of a recorded trace")),
    "--cost": (("--cost",), dict(type=cost, metavar="A,B,GPU,T",
                                 help="latency model in ms: cpu_lat(s)=A+B*s, gpu_lat, transfer_lat (default: from "
                                      "sizes)")),
    "--threads": (("--threads",), dict(type=threads, default=None,
                                       help="threads for CPU experts (default: all cores)")),
    "--quant": (("--quant",), dict(choices=["none", *get_args(Quant)], default=None,
                                   help="weight-only quantization of CPU experts, done at load (opt-in); q8_0 and "
                                        "q4_k (the ones to choose): GGUF's block formats, made once and kept in the "
                                        "cache folder")),
    "--quant-group": (("--quant-group",), dict(type=int, choices=list(GROUPS), default=None,
                                               help="int4 group size (default: 64)")),
    "--kernel-crossover": (("--kernel-crossover",), dict(type=whole(0), default=None,
                                                         help="up to this many tokens per expert use the compiled "
                                                              "kernel; more use torch (default: 16 with AMX, else 8)")),
    "--resident": (("--resident",), dict(action=argparse.BooleanOptionalAction, default=None,
                                         help="read the experts into RAM at load instead of streaming them from the "
                                              "memory-mapped files (faster decode, a longer load; default: when they "
                                              "fit in 70%% of the available RAM)")),
    "--no-prefix-reuse": (("--no-prefix-reuse",), dict(dest="prefix_reuse", action="store_false",
                                                       help="prefill every prompt whole, even where a KV cache row "
                                                            "holds its first tokens already (a chat's earlier "
                                                            "turns, a shared system prompt): to measure prefill, or "
                                                            "to rule reuse out")),
    "--prefix-store-gb": (("--prefix-store-gb",), dict(type=float, default=None, metavar="GB",
                                                       help="RAM for the KV cache of prompts another one overwrote "
                                                            "(a chat switched away from, a server's other "
                                                            "conversations), copied back when they come again "
                                                            "(default: an eighth of the available RAM, at most 2)")),
    "--prefix-disk-gb": (("--prefix-disk-gb",), dict(type=float, default=None, metavar="GB",
                                                      help="disk for conversations' KV caches, kept across restarts "
                                                           "under the cache folder (a chat reopened answers without "
                                                           "reading its history again; the least recently used go "
                                                           "first; default: 0, none)")),
    "--kernel-isa": (("--kernel-isa",), dict(choices=["auto", *ISAS],
                                             default=None,
                                             help="force a kernel variant (auto, the default: the best this CPU "
                                                  "supports)")),
    # serving, and the chat on a server
    "--host": (("--host",), dict(default="127.0.0.1",
                                 help="address to listen on (default: loopback only; any other needs --api-key)")),
    "--port": (("--port",), dict(type=whole(0, 65535), default=8080, help="port to listen on (default: 8080)")),
    "--api-key": (("--api-key",), dict(default=None, metavar="KEY",
                                       help="the key clients send as 'Authorization: Bearer KEY' (default: the "
                                            "TANDEM_API_KEY environment variable)")),
    "--remote": (("--remote",), dict(default=None, metavar="URL",
                                     help="chat with a model on an OpenAI-compatible server (vLLM, SGLang, "
                                          "llama-server, Ollama, tandem serve), e.g. http://host:8080/v1")),
    "--remote-model": (("--remote-model",), dict(default=None, metavar="NAME",
                                                 help="the server's model to chat with (default: its first)")),
    # outputs and inputs
    "--json": (("--json",), dict(action="store_true", help="print JSON")),
    "--record-trace": (("--record-trace",), dict(type=path, metavar="FILE",
                                                 help="save the expert activation trace to exactly FILE (numpy .npz "
                                                      "format, whatever the name)")),
    "--record": (("--record",), dict(type=path, metavar="FILE",
                                     help="also save the raw readings (e.g. for a bug report)")),
    "--from": (("--from",), dict(dest="source", type=path, metavar="FILE",
                                 help="read recorded readings instead of this machine")),
    "--hardware": (("--hardware",), dict(type=path, required=True, metavar="HW.json",
                                         help="see the README for the schema")),
    "--trace": (("--trace",), dict(type=path, help="a routing trace recorded with --record-trace (default: "
                                                   "synthetic)")),
    "--out": (("--out",), dict(required=True, help="folder to create")),
    "--plot": (("--plot",), dict(metavar="FILE.png", help="draw the results (needs matplotlib)")),
    # benchmarks and tools
    "--quick": (("--quick",), dict(action="store_true", help="fewer measurements")),
    "--prompt-tokens": (("--prompt-tokens",), dict(type=whole(1), default=32)),
    "--new-tokens": (("--new-tokens",), dict(type=whole(1), default=64)),
    "--tokens": (("--tokens",), dict(type=whole(1))),
    "--repeats": (("--repeats",), dict(type=whole(1), default=3)),
    "--peer": (("--peer",), dict(choices=["transformers", "llama.cpp"], default=None,
                                 help="transformers on the same checkpoint, or llama.cpp's llama-bench on the same "
                                      "GGUF file (--llama-bench PATH)")),
    "--llama-bench": (("--llama-bench",), dict(type=path, default=None, metavar="PATH",
                                               help="llama.cpp's llama-bench binary, for --peer llama.cpp")),
    "--peer-process": (("--peer-process",), dict(choices=["auto", "same", "child"], default="auto",
                                                 help="where the peer runs: beside Tandem, alternating (when both "
                                                      "copies fit in RAM), or in a child process after Tandem's rows "
                                                      "(auto: the first that fits)")),
    "--scenario": (("--scenario",), dict(choices=["decode", "prefill", "beam", "all"], default="all")),
    "--expert-fraction": (("--expert-fraction",), dict(type=real(0, 1, low_open=True), default=0.25,
                                                       help="share of all experts that fit")),
    "--shapes": (("--shapes",), dict(help="real-model shapes (a comma list)")),
    "--dtypes": (("--dtypes",), dict(default="bf16,fp16,fp32,int8,int4,mxfp4")),
    "--paths": (("--paths",), dict(default=None,
                                   help="comma list of paths (default: every one this CPU can take)")),
    "--masks": (("--masks",), dict(action="store_true",
                                   help="then every path again as each CPU with fewer features this one can play")),
    "--reference": (("--reference",), dict(default=None, help=argparse.SUPPRESS)),  # fp32 top-1 tokens, for --masks
    "--shape": (("--shape",), dict(required=True, help="a real model's shape")),
    "--layers": (("--layers",), dict(type=whole(1), default=None, help="fewer layers than the real model")),
    "--experts": (("--experts",), dict(type=whole(1), default=None,
                                       help="fewer routed experts per layer than the real model (at least top-k): "
                                            "every layer kept, each expert its real size")),
    "--attention-heads": (("--attention-heads",), dict(type=whole(1), default=None,
                                                       help="fewer query heads than the real model (a multiple of "
                                                            "its key/value heads): narrower attention, every layer "
                                                            "kept")),
    "--family": (("--family",), dict(default="mixtral", help="model_type")),
}


def declare(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, **overrides: object) -> None:
    """Add the flags `names` from FLAGS; `overrides` change keywords of each (used with one name)."""
    for name in names:
        aliases, keywords = FLAGS[name]
        parser.add_argument(*aliases, **(keywords | overrides))  # type: ignore[arg-type]


MAX_JSON_BYTES = 16 * 2**20  # a hand-written description or config.json; a device or a huge file is refused


def read_json(path: str, what: str) -> Any:
    """A small JSON file named on the command line: a regular file read up to a bound (`read_bounded`), nested
    no deeper than the parser's recursion allows; a folder or a missing file is named as such."""
    p = Path(path)
    try:
        if not p.is_file():
            kind = "a folder" if p.is_dir() else "missing" if not p.exists() else "not a regular file"
            raise TandemError(f"{what} {path} is {kind}")
        return json.loads(read_bounded(p, MAX_JSON_BYTES).decode("utf-8"))
    except RecursionError:
        raise TandemError(f"cannot read {what} {path}: its JSON is nested too deeply to be a real one") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TandemError(f"cannot read {what} {path}: {e}") from None
