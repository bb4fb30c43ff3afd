"""`ChatBackend` declares everything the app uses: the runtime's backend and the tests' fakes have every member, with
the same signature, and say "not available" the declared way."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from tandem.app.chat.backend import ChatBackend, RuntimeBackend, TuningTarget
from tandem.runtime.loader import LoadedModel, load_model
from tandem.runtime.sampling import SamplingParams
from tests.fakes import FakeBackend, TunableFake
from tests.test_tui_faults import Silent

ATTRIBUTES = sorted(ChatBackend.__annotations__)
METHODS = sorted(n for n, v in vars(ChatBackend).items() if callable(v) and not n.startswith("_"))
PROPERTIES = sorted(n for n, v in vars(ChatBackend).items() if isinstance(v, property))


def signature(function: object) -> tuple[list[tuple[str, object, object]], object]:
    """Parameters (name, kind, annotation as written) and the return annotation."""
    sig = inspect.signature(function)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.annotation) for p in sig.parameters.values()], sig.return_annotation


def test_the_protocol_lists_what_the_app_uses() -> None:
    assert ATTRIBUTES == ["family", "name", "placement", "remote"] and PROPERTIES == ["context"]
    assert {"stream", "prompt_tokens", "usage", "activity", "close", "where", "vram", "tuning_target",
            "loaded_model"} == set(METHODS)


@pytest.fixture(scope="module")
def runtime_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeBackend]:
    from tandem.runtime.synth import tiny_config, write_test_model

    folder = write_test_model(tmp_path_factory.mktemp("model") / "tiny", tiny_config("mixtral"))
    backend = RuntimeBackend(load_model(folder, dtype="fp32", context=64))
    yield backend
    backend.close()


@pytest.mark.parametrize("kind", [RuntimeBackend, FakeBackend, TunableFake, Silent])
def test_every_backend_has_every_member_with_the_protocols_signature(kind: type, runtime_backend) -> None:
    backend = runtime_backend if kind is RuntimeBackend else kind(False) if kind is Silent else kind()
    for name in ATTRIBUTES:
        value = getattr(backend, name)
        assert isinstance(value, str) or (name == "remote" and value is None), name  # remote: None, run here
    for name in PROPERTIES:
        assert isinstance(getattr(backend, name), int), name
    for name in METHODS:
        assert signature(getattr(kind, name)) == signature(getattr(ChatBackend, name)), f"{kind.__name__}.{name}"


def test_the_remote_backend_has_every_method_with_the_protocols_signature() -> None:
    """(Its attributes, read off a server: tests/test_serve.py.)"""
    from tandem.app.chat.remote import RemoteBackend

    for name in METHODS:
        assert signature(getattr(RemoteBackend, name)) == signature(getattr(ChatBackend, name)), name
    assert isinstance(vars(RemoteBackend)["context"], property)


def test_the_runtime_backend_answers_every_optional_member(runtime_backend: RuntimeBackend) -> None:
    assert runtime_backend.vram() is None  # CPU only: no accelerator memory
    assert runtime_backend.remote is None
    target = runtime_backend.tuning_target()
    assert isinstance(target, TuningTarget) and target.dtype == "fp32" and target.path.endswith("tiny")
    assert target.raw_config["model_type"] == "mixtral"
    assert isinstance(runtime_backend.loaded_model(), LoadedModel)
    "".join(runtime_backend.stream([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=4)))
    where = runtime_backend.where()
    assert where is not None and len(where) == len(runtime_backend.activity())
    assert {w for row in where for w in row} <= {"cpu", ""}  # no accelerator: every expert ran on the CPU


def test_a_fake_says_not_available() -> None:
    fake = FakeBackend()
    assert fake.where() is None and fake.tuning_target() is None and fake.loaded_model() is None
    assert TunableFake().tuning_target() == TuningTarget("/models/fake", "bf16",
                                                         {"model_type": "mixtral", "hidden_size": 64})


def test_an_engine_error_reaches_the_thread_that_asked(runtime_backend: RuntimeBackend,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.kernels.errors import GenerationError

    def failing(*args, **kwargs):
        yield 5
        raise GenerationError("the engine failed")

    monkeypatch.setattr(runtime_backend.loaded.engine, "generate", failing)
    with pytest.raises(GenerationError, match="the engine failed"):
        "".join(runtime_backend.stream([{"role": "user", "content": "hello"}], SamplingParams(max_new_tokens=4)))
