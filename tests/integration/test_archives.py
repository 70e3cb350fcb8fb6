"""The built model store: every .mar is intact, well-formed, safe, verified and serves correctly.

Needs `model_store/` built (`make models`); without it test_model_store_is_built fails saying so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from mariner.server.worker.context import Context
from mariner.training.data import DigitsSplits, load_splits
from mariner.training.model import DigitsCNN

pytestmark = [
    pytest.mark.integration,
    # TorchScript archives (torchscript, int8_dynamic) are what TorchServe users deploy.
    pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "model_store"
INDEX_PATH = STORE / "index.json"
VARIANTS = {"eager", "compiled", "torchscript", "aoti", "onnx", "int8_dynamic", "int8_pt2e"}
QUANTIZED = {"int8_dynamic", "int8_pt2e"}
FORMATS = {"eager", "compiled", "torchscript", "aoti", "onnx"}
HANDLER_FILE = "digits_handler.py"
FP32_MAX_ABS_DIFF = 1e-4
INT8_MAX_ACC_DROP = 0.01
N_SAMPLES = 10

BUILD_HINT = "model_store/index.json is missing: build the store with `make models`"

# Read at import so each archive is its own test case. Without a store the per-archive cases
# are empty and test_model_store_is_built fails (not skips), like the shared fixtures do.
INDEX: dict[str, Any] = json.loads(INDEX_PATH.read_text()) if INDEX_PATH.is_file() else {}
# Every archive of the store (sha256 and safe paths are checked for all); this module's other
# checks are the digits family's (the minilm/resnet archives have tests of their own).
ALL_ENTRIES: list[dict[str, Any]] = INDEX.get("archives", [])
ENTRIES: list[dict[str, Any]] = [e for e in ALL_ENTRIES if e["model"].startswith("digits_")]


def _variant(entry: dict[str, Any]) -> str:
    return entry["model"].removeprefix("digits_")


def _params(*, mark_slow: bool = False, every_family: bool = False) -> list[Any]:
    params = []
    for e in ALL_ENTRIES if every_family else ENTRIES:
        marks = [pytest.mark.slow] if mark_slow and e["format"] == "compiled" else []
        params.append(pytest.param(e, id=_variant(e), marks=marks))
    return params


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_member(mar: Path, name: str) -> bytes:
    with zipfile.ZipFile(mar) as z:
        return z.read(name)


def _is_safe_member(name: str) -> bool:
    if not name or name.startswith(("/", "\\")) or "\\" in name:
        return False
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        return False
    # "C:..." on Windows is absolute too
    return not (len(name) > 1 and name[1] == ":")


@pytest.fixture(scope="module")
def splits() -> DigitsSplits:
    if not INDEX:
        pytest.fail(BUILD_HINT)
    return load_splits(seed=INDEX["training"]["config"]["seed"])


@pytest.fixture(scope="module")
def eager_model() -> DigitsCNN:
    """The reference: the eager archive's state_dict in training/model.py's class, no handler."""
    if not INDEX:
        pytest.fail(BUILD_HINT)
    entry = next(e for e in ENTRIES if e["format"] == "eager")
    mar = STORE / entry["file"]
    manifest = json.loads(_read_member(mar, "MAR-INF/MANIFEST.json"))
    state = torch.load(
        io.BytesIO(_read_member(mar, manifest["model"]["serializedFile"])),
        map_location="cpu",
        weights_only=True,
    )
    cfg = INDEX["training"]["config"]
    model = DigitsCNN(width=cfg["width"], hidden=cfg["hidden"], dropout=cfg["dropout"])
    model.load_state_dict(state)
    return model.eval()


# -- the index ----------------------------------------------------------------------------


def test_model_store_is_built() -> None:
    assert INDEX_PATH.is_file(), BUILD_HINT


def test_index_lists_every_variant_once() -> None:
    if not INDEX:
        pytest.fail(BUILD_HINT)
    names = [_variant(e) for e in ENTRIES]
    assert sorted(names) == sorted(VARIANTS)
    assert INDEX["default_model"] in {e["model"] for e in ENTRIES}
    assert len({e["file"] for e in ALL_ENTRIES}) == len(ALL_ENTRIES)


@pytest.mark.parametrize("entry", _params(every_family=True))
def test_archive_exists_and_sha256_matches(entry: dict[str, Any]) -> None:
    mar = STORE / entry["file"]
    assert mar.is_file(), f"{mar} listed in index.json but missing"
    assert mar.stat().st_size == entry["bytes"]
    assert _sha256(mar) == entry["sha256"]


# -- archive layout -----------------------------------------------------------------------


@pytest.mark.parametrize("entry", _params())
def test_archive_layout(entry: dict[str, Any]) -> None:
    mar = STORE / entry["file"]
    assert zipfile.is_zipfile(mar)
    with zipfile.ZipFile(mar) as z:
        assert z.testzip() is None  # every member's CRC checks out
        names = set(z.namelist())
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        model = manifest["model"]
        assert model["modelName"] == entry["model"]
        assert model["modelVersion"] == entry["version"]
        assert model["handler"] == HANDLER_FILE
        assert HANDLER_FILE in names
        assert model["serializedFile"] in names
        assert z.getinfo(model["serializedFile"]).file_size > 0
        assert model["configFile"] == "model-config.yaml"
        assert {"model-config.yaml", "norm.json", "labels.json", "verification.json"} <= names

        cfg = yaml.safe_load(z.read("model-config.yaml"))
        assert isinstance(cfg["batchSize"], int)
        assert cfg["batchSize"] >= 1
        assert isinstance(cfg["maxBatchDelay"], int)
        assert cfg["maxBatchDelay"] >= 0
        assert cfg["responseTimeout"] > 0
        assert 1 <= cfg["minWorkers"] <= cfg["maxWorkers"]
        assert cfg["handler"]["format"] == entry["format"]
        assert cfg["handler"]["format"] in FORMATS
        if entry["format"] in ("eager", "compiled"):
            assert "digits_model.py" in names
            assert set(cfg["handler"]["model_kwargs"]) == {"width", "hidden", "dropout"}
        if entry["device"] == "cpu":
            assert cfg.get("deviceType") == "cpu"

        norm = json.loads(z.read("norm.json"))
        assert norm["std"] > 0
        labels = json.loads(z.read("labels.json"))
        assert labels == [str(i) for i in range(10)]

        verification = json.loads(z.read("verification.json"))
        assert verification["passed"] is True
        assert verification["variant"] == _variant(entry)
        assert verification == entry["verification"]


@pytest.mark.parametrize("entry", _params(every_family=True))
def test_archive_members_have_safe_paths(entry: dict[str, Any]) -> None:
    with zipfile.ZipFile(STORE / entry["file"]) as z:
        bad = [n for n in z.namelist() if not _is_safe_member(n)]
    assert bad == []


def test_safe_path_check_rejects_escapes() -> None:
    """The helper above must catch what it claims to catch."""
    for name in ("/etc/passwd", "../x", "a/../../x", "a\\..\\x", "C:/x", ""):
        assert not _is_safe_member(name), name
    for name in ("MAR-INF/MANIFEST.json", "norm.json", "a/b..c"):
        assert _is_safe_member(name), name


@pytest.mark.parametrize("entry", _params())
def test_archive_norm_matches_the_training_split(entry: dict[str, Any], splits: DigitsSplits) -> None:
    norm = json.loads(_read_member(STORE / entry["file"], "norm.json"))
    assert norm["mean"] == pytest.approx(splits.norm.mean, rel=1e-6)
    assert norm["std"] == pytest.approx(splits.norm.std, rel=1e-6)


# -- verification records -------------------------------------------------------------------


@pytest.mark.parametrize("entry", _params())
def test_verification_within_tolerance(entry: dict[str, Any]) -> None:
    rec = json.loads(_read_member(STORE / entry["file"], "verification.json"))
    assert rec["quantized"] is (_variant(entry) in QUANTIZED)
    if rec["quantized"]:
        assert rec["eager_accuracy"] - rec["accuracy"] <= INT8_MAX_ACC_DROP + 1e-12
    else:
        assert rec["max_abs_logit_diff"] <= FP32_MAX_ABS_DIFF
        assert rec["top1_agreement"] == 1.0
    assert rec["eager_accuracy"] >= 0.98


# -- serving each archive -------------------------------------------------------------------


def _load_from_archive(mar: Path, dest: Path) -> tuple[Any, Context]:
    """Unpack like a server does and initialise the handler the archive itself carries."""
    with zipfile.ZipFile(mar) as z:
        assert all(_is_safe_member(n) for n in z.namelist())
        z.extractall(dest)
    manifest = json.loads((dest / "MAR-INF" / "MANIFEST.json").read_text())
    cfg = yaml.safe_load((dest / manifest["model"]["configFile"]).read_text())
    spec = importlib.util.spec_from_file_location(
        f"archive_handler_{mar.stem}", dest / manifest["model"]["handler"]
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ctx = Context(
        manifest["model"]["modelName"],
        str(dest),
        manifest,
        batch_size=int(cfg.get("batchSize", 1)),
        gpu_id=None,
        model_yaml_config=cfg,
    )
    handler = module.DigitsHandler()
    handler.initialize(ctx)
    return handler, ctx


@pytest.mark.parametrize("entry", _params(mark_slow=True))
def test_archive_serves_like_the_eager_model(
    entry: dict[str, Any], tmp_path: Path, splits: DigitsSplits, eager_model: DigitsCNN
) -> None:
    handler, ctx = _load_from_archive(STORE / entry["file"], tmp_path / "model")
    px = splits.test.x[:N_SAMPLES]
    batch: list[Any] = [{"body": json.dumps(row.tolist()).encode()} for row in px]
    batch.append({"body": b"[1, 2, 3]"})  # a bad item must not disturb the others
    ctx.begin_batch([str(i) for i in range(len(batch))], [{} for _ in batch])
    out = handler.handle(batch, ctx)

    assert len(out) == len(batch)
    assert out[-1]["code"] == 400
    assert ctx.get_response_status(len(batch) - 1)[0] == 400
    labels = np.array([r["label"] for r in out[:-1]])

    x = (torch.from_numpy(px).reshape(-1, 1, 8, 8) - splits.norm.mean) / splits.norm.std
    with torch.inference_mode():
        probs = torch.softmax(eager_model(x), dim=1)
    want = probs.argmax(1).numpy()
    if _variant(entry) in QUANTIZED:
        assert (labels == want).mean() >= 0.9, (labels, want)
    else:
        np.testing.assert_array_equal(labels, want)
        for r, p in zip(out[:-1], probs, strict=True):
            top = r["topk"][0]
            assert top["probability"] == pytest.approx(float(p.max()), abs=1e-4)
    # The trained model is good: the eager reference gets these samples right.
    assert (want == splits.test.y[:N_SAMPLES]).mean() >= 0.9


def test_trained_checkpoint_matches_the_eager_archive(eager_model: DigitsCNN) -> None:
    """build/train/best.pt (when present) is what the store was built from."""
    best = ROOT / "build" / "train" / "best.pt"
    if not best.exists():
        pytest.skip("build/train/best.pt not present")
    ck = torch.load(best, map_location="cpu", weights_only=True)
    assert ck["epoch"] == INDEX["training"]["epoch"]
    state = eager_model.state_dict()
    assert ck["model"].keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(ck["model"][k], v), k
