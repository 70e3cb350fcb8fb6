"""Stage each MiniLM variant's files and package them with the real torch-model-archiver.

Every archive carries the handler and its helpers (`minilm_text.py`, `handler_support.py` for
what every handler needs, `accel.py` for autocast/CUDA graphs), the artefact, the tokenizer and
`model-config.yaml`; the eager variants add the model code (`minilm_model.py`), `config.json`
and the pooling config it checks. The tokenizer.json shipped is the checkpoint's with its
built-in truncation (128) and fixed padding (128) removed, so whoever reads it (the handler, the
frontend's token counter, a user) counts every word piece; the handler applies `maxLength`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mariner.training import package as shared

if TYPE_CHECKING:
    from mariner.training.export import Artefact

HANDLER = shared.ROOT / "handlers" / "minilm_handler.py"
HELPERS = (shared.ROOT / "handlers" / "minilm_text.py", shared.HANDLER_SUPPORT, shared.ACCEL)
MODEL_CODE = shared.ROOT / "training" / "minilm" / "model.py"
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this checkpoint
# Padded tokens (rows x longest row) per batch. It must bind below batchSize x maxLength (32 x 256
# = 8192) or the batcher has no reason to group by length: TEI's default of 16384 never bound
# here, batches were as mixed as arrival order (47% padding), and length-aware batching bought
# 1.37x over padding every text to 256; at 4096 it bought 1.97x (docs/benchmark.md). On a CPU a
# forward's cost is its padded tokens, so smaller batches of similar length lose nothing; a GPU
# wants bigger ones (raise it in the archive's model-config). Bigger batches are split by the
# handler, never refused.
MAX_BATCH_TOKENS = 4096
MAX_TEXTS_PER_REQUEST = 64
SIGNATURE: dict[str, Any] = {
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}],
}


def model_config(
    fmt: str, device: str, *, batch_size: int, max_batch_delay_ms: int, padding: str = "longest"
) -> dict[str, Any]:
    """TorchServe's model-config keys, the token-budget keys the frontend reads, the handler section."""
    handler = {
        "format": fmt,
        "device": device,
        "padding": padding,
        "maxLength": MAX_LENGTH,
        "truncate": True,
        "maxTextsPerRequest": MAX_TEXTS_PER_REQUEST,
    }
    # The token-budget keys the frontend reads; the signature: texts in (UTF-8 BYTES), unit vectors out.
    budget = {
        "maxBatchTokens": MAX_BATCH_TOKENS,
        "tokenCounter": {"tokenizer": "tokenizer.json", "maxLength": MAX_LENGTH},
    }
    return shared.family_model_config(
        handler, SIGNATURE, device, (batch_size, max_batch_delay_ms, 60), budget
    )


def write_tokenizer(source: Path, target: Path) -> None:
    """The checkpoint's tokenizer.json without its built-in truncation and padding."""
    raw = json.loads(source.read_text(encoding="utf-8"))
    raw["truncation"] = None
    raw["padding"] = None
    target.write_text(json.dumps(raw, ensure_ascii=False), encoding="utf-8")


def stage(
    exported: Artefact,
    *,
    weights_dir: Path,
    work: Path,
    batch_size: int,
    max_batch_delay_ms: int,
    padding: str = "longest",
    name: str | None = None,
) -> shared.Staged:
    """Copy the artefact and the side files into `work/<model_name>/`."""
    variant, fmt, device, artefact = exported.variant, exported.format, exported.device, exported.path
    model_name = name or f"minilm_{variant}"
    d, art = shared.fresh_stage_dir(work, model_name, artefact)
    cfg = model_config(
        fmt, device, batch_size=batch_size, max_batch_delay_ms=max_batch_delay_ms, padding=padding
    )
    (d / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    write_tokenizer(weights_dir / "tokenizer.json", d / "tokenizer.json")
    # The eager variant's model code, with the checkpoint's config and the pooling config it checks.
    code = (
        {
            "minilm_model.py": MODEL_CODE,
            "config.json": weights_dir / "config.json",
            "pooling_config.json": weights_dir / "1_Pooling" / "config.json",
        }
        if fmt == "eager"
        else {}
    )
    extras = [d / "tokenizer.json", *shared.ship_code(d, HANDLER, HELPERS, code)]
    manifest = shared.manifest_for(model_name, art, HANDLER)
    return shared.Staged(variant, model_name, d, art, manifest, cfg, tuple(extras), handler=HANDLER.name)
