"""One builder per TorchServe-style archive: stage the files, make the model, run the archiver.

Each is written the way TorchServe's examples and docs build that kind of archive (the command
lines in their READMEs), so what both servers are given is what TorchServe users have.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.integration.ts_examples.archiver import archive
from tests.integration.ts_examples.examples import stage, write_json


def _models() -> ModuleType:
    """The torch side, imported when an archive is built, never when pytest collects."""
    from tests.integration.ts_examples import models

    return models


def build_mnist(store: Path, work: Path) -> None:
    """examples/image_classifier/mnist: --model-file mnist.py --serialized-file mnist_cnn.pt
    --handler mnist_handler.py (an ImageClassifier subclass)."""
    s = stage(work, "mnist", "mnist.py", "mnist_handler.py")
    _models().save_mnist_state_dict(s / "mnist_cnn.pt")
    archive(
        s,
        store,
        "--model-name",
        "mnist",
        "--version",
        "1.0",
        "--model-file",
        "mnist.py",
        "--serialized-file",
        "mnist_cnn.pt",
        "--handler",
        "mnist_handler.py",
    )


def build_base_handler(store: Path, work: Path) -> None:
    """--handler base_handler (the built-in by name) with a TorchScript model."""
    s = stage(work, "base_builtin")
    _models().save_scripted_linear(s / "model.pt", 4, 3)
    archive(
        s,
        store,
        "--model-name",
        "base_builtin",
        "--version",
        "1.0",
        "--serialized-file",
        "model.pt",
        "--handler",
        "base_handler",
    )


def build_image_classifier(store: Path, work: Path) -> None:
    """--handler image_classifier with a TorchScript model and index_to_name.json."""
    s = stage(work, "image_builtin")
    _models().save_scripted_image_model(s / "model.pt", classes=6)
    write_json(s / "index_to_name.json", {str(i): f"class_{i}" for i in range(6)})
    archive(
        s,
        store,
        "--model-name",
        "image_builtin",
        "--version",
        "1.0",
        "--serialized-file",
        "model.pt",
        "--handler",
        "image_classifier",
        "--extra-files",
        "index_to_name.json",
    )


TEXT_WORDS = ["<unk>", "good", "bad", "movie", "good movie", "bad movie", "a", "a good", "a bad"]


def build_text_classifier(store: Path, work: Path) -> None:
    """--handler text_classifier: TorchScript EmbeddingBag model, source_vocab.pt and
    index_to_name.json as extra files (ts/torch_handler/text_handler.py reads both). The handler
    imports captum, not torchtext (TorchServe copied the torchtext helpers it needs)."""
    s = stage(work, "text_builtin")
    _models().save_scripted_text_model(s / "model.pt", vocab=len(TEXT_WORDS), classes=2)
    _models().save_vocab(s / "source_vocab.pt", TEXT_WORDS)
    write_json(s / "index_to_name.json", {"0": "negative", "1": "positive"})
    archive(
        s,
        store,
        "--model-name",
        "text_builtin",
        "--version",
        "1.0",
        "--serialized-file",
        "model.pt",
        "--handler",
        "text_classifier",
        "--extra-files",
        "index_to_name.json,source_vocab.pt",
    )


def build_handle_module(store: Path, work: Path) -> None:
    """A module-level `handle(data, context)` handler file (docs/custom_service.md)."""
    s = stage(work, "module_handle", "handle_module.py")
    _models().save_scripted_linear(s / "model.pt", 3, 2, seed=6)
    archive(
        s,
        store,
        "--model-name",
        "module_handle",
        "--version",
        "1.0",
        "--serialized-file",
        "model.pt",
        "--handler",
        "handle_module.py",
    )


def build_custom_function(store: Path, work: Path) -> None:
    """--handler mymod:my_fn, a function entry point; no serialized file."""
    s = stage(work, "custom_fn", "mymod.py")
    archive(s, store, "--model-name", "custom_fn", "--version", "1.0", "--handler", "mymod:my_fn")


def build_errors(store: Path, work: Path) -> None:
    """A handler raising PredictionException("custom message", 513) and a plain ValueError."""
    s = stage(work, "errors", "errors_handler.py")
    archive(s, store, "--model-name", "errors", "--version", "1.0", "--handler", "errors_handler.py")


MODEL_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 4
maxBatchDelay: 1000
responseTimeout: 60
handler:
  greeting: hello from model-config.yaml
  threshold: 0.5
"""


def build_model_config(store: Path, work: Path) -> None:
    """--config-file model-config.yaml read by the handler (context.model_yaml_config)."""
    s = stage(work, "with_config", "config_handler.py")
    (s / "model-config.yaml").write_text(MODEL_CONFIG)
    archive(
        s,
        store,
        "--model-name",
        "with_config",
        "--version",
        "2.0",
        "--handler",
        "config_handler.py",
        "--config-file",
        "model-config.yaml",
    )


def _stage_deps(work: Path, name: str) -> Path:
    s = stage(work, name, "deps_handler.py", "helper_mod.py")
    (s / "requirements.txt").write_text("numpy\n")
    return s


def _deps_archive(store: Path, work: Path, name: str, *flags: str) -> None:
    """deps_handler.py with helper_mod.py as an extra file, archived as `name` with `flags`."""
    s = _stage_deps(work, name)
    archive(
        s,
        store,
        "--model-name",
        name,
        "--version",
        "1.0",
        "--handler",
        "deps_handler.py",
        "--extra-files",
        "helper_mod.py",
        *flags,
    )


def build_deps(store: Path, work: Path) -> None:
    """--requirements-file requirements.txt and --extra-files helper_mod.py (imported by the handler)."""
    _deps_archive(store, work, "with_deps", "--requirements-file", "requirements.txt")


def build_no_archive(store: Path, work: Path) -> None:
    """--archive-format no-archive: a directory in the store, registered with url=<dir>."""
    _deps_archive(store, work, "plain_dir", "--archive-format", "no-archive")


def build_tgz(store: Path, work: Path) -> None:
    """--archive-format tgz: plain_tgz.tar.gz in the store, registered with url=<file>."""
    _deps_archive(store, work, "plain_tgz", "--archive-format", "tgz")


def build_onnx(store: Path, work: Path) -> None:
    """An ONNX file (torch.onnx.export) served by a BaseHandler subclass, as TorchServe's ONNX test."""
    s = stage(work, "onnx_linear", "onnx_handler.py")
    _models().export_onnx_linear(s / "linear.onnx", 4, 2)
    archive(
        s,
        store,
        "--model-name",
        "onnx_linear",
        "--version",
        "1.0",
        "--serialized-file",
        "linear.onnx",
        "--handler",
        "onnx_handler.py",
    )


# -- archives for the envelope servers (service_envelope is a server-wide key) ----------------
def build_envelope_handler(store: Path, work: Path) -> None:
    """A BaseHandler subclass with a TorchScript model, behind service_envelope (json/kservev2)."""
    s = stage(work, "enveloped", "envelope_handler.py")
    _models().save_scripted_linear(s / "model.pt", 4, 2, seed=7)
    archive(
        s,
        store,
        "--model-name",
        "enveloped",
        "--version",
        "1.0",
        "--serialized-file",
        "model.pt",
        "--handler",
        "envelope_handler.py",
    )
