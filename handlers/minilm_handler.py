"""TorchServe-contract handler for the all-MiniLM-L6-v2 sentence encoder, every variant.

The archive's model-config `handler:` section says what it carries and how to tokenize:

    format: eager | onnx | aoti | torchscript   (torchscript: the dynamic-int8 variant)
    device: any | cpu                           (cpu: artefacts that only run there)
    padding: longest | max_length               (pad a batch to its longest text, or always to maxLength)
    maxLength: 256                              (word pieces incl. [CLS]/[SEP], as sentence-transformers)
    truncate: true | false                      (false: an over-long text is refused with 400)
    maxTextsPerRequest: 64                      (texts in one JSON list)
    autocast / cudaGraphs                       (eager only; see accel.py)

Texts from every request of a batch are tokenized together and go through the model in one
forward pass, split only when rows x padded length would pass the archive's `maxBatchTokens`.
Decoding rules and answers are in `minilm_text.py`; a bad request gets {"error", "code": 400}
for its index only, never a 500. The module defines exactly one class (TorchServe's loader
requires it) and imports nothing from `ts`, so the same archive runs on TorchServe and Mariner.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMATS = ("eager", "onnx", "aoti", "torchscript")
DEFAULT_MAX_BATCH_TOKENS = 16384
EMBEDDING_DIM = 384
DECIMALS = 7  # JSON answers: float32 carries about 7 significant digits


# The helper every handler shares, beside this file in the repo and in the archive alike, loaded
# by path as it loads the other siblings (see its load_module_from: why by path, why registered).
_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mariner_minilm_support", _HERE / "handler_support.py")
if _spec is None or _spec.loader is None:
    raise ImportError(f"handler_support.py must ship beside {__file__}")
_support = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_support)
_text = _support.load_module_from(_HERE / "minilm_text.py", "mariner_minilm_text")


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"handler.{name} must be true or false, got {value!r}")


class MiniLMHandler:
    """Loads the archive's artefact once; answers batches of texts with unit-length embeddings."""

    def __init__(self) -> None:
        self.initialized = False
        self.format = ""
        self.device = torch.device("cpu")
        self.rules: Any = None
        self.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
        self.max_texts = _text.MAX_TEXTS_PER_REQUEST
        self._run: Any = None  # (ids, mask) int64 host tensors -> [B, 384] float32 host tensor
        self._accel: Any = None
        self._buckets: list[int] = []

    # -- TorchServe contract -------------------------------------------------------------
    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = Path(props.get("model_dir") or ".")
        cfg = getattr(context, "model_yaml_config", None) or {}
        section = _support.config_section(context)
        self.format = _support.artefact_format(section, FORMATS)
        self.rules = _text.TokenizerRules(
            model_dir / str(section.get("tokenizer", "tokenizer.json")),
            max_length=int(section.get("maxLength", 256)),
            padding=str(section.get("padding", "longest")),
            truncate=_flag(section.get("truncate", True), "truncate"),
        )
        self.max_texts = int(section.get("maxTextsPerRequest", _text.MAX_TEXTS_PER_REQUEST))
        self.max_batch_tokens = int(cfg.get("maxBatchTokens", DEFAULT_MAX_BATCH_TOKENS))
        if self.max_batch_tokens < self.rules.max_length:
            raise ValueError(
                f"maxBatchTokens ({self.max_batch_tokens}) must hold at least one text of maxLength "
                f"({self.rules.max_length}) tokens"
            )
        serialized = _support.serialized_file(context)
        self.device = _support.pick_device(context, str(section.get("device", "any")))
        self._run = self._load(model_dir / serialized, model_dir, section, int(props.get("batch_size") or 1))
        self._warm_up()
        self.initialized = True
        log.info(
            "minilm handler ready: format=%s device=%s padding=%s",
            self.format,
            self.device,
            self.rules.padding,
        )

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        """Decode every request, one forward for all their texts, answers split back in order."""
        results: list[Any] = [None] * len(data)
        decoded: list[tuple[int, Any, list[list[int]]]] = []
        for i, row in enumerate(data):
            try:
                texts = _text.decode_request(row, self.max_texts)
                ids = self.rules.encode(list(texts.texts))
                over = [k for k, row_ids in enumerate(ids) if self.rules.too_long(row_ids)]
                if over:
                    raise ValueError(
                        f"text {over[0]} has {len(ids[over[0]])} word pieces; this model takes at most "
                        f"{self.rules.max_length} (including [CLS] and [SEP]) and does not truncate"
                    )
            except ValueError as exc:
                _support.refuse(results, context, i, str(exc))
                continue
            decoded.append((i, texts, ids))
        if not decoded:
            return results
        vectors = self.embed_ids([row_ids for _, _, ids in decoded for row_ids in ids])
        start = 0
        for i, texts, ids in decoded:
            block = vectors[start : start + len(ids)]
            start += len(ids)
            if texts.kind == "tensor":
                results[i] = {"tensors": {"embedding": block}}
            elif texts.kind == "one":
                results[i] = {"embedding": np.round(block[0].astype(np.float64), DECIMALS).tolist()}
            else:
                results[i] = {"embeddings": np.round(block.astype(np.float64), DECIMALS).tolist()}
        return results

    # -- model API (verification and benchmarks call it too) -----------------------------
    def embed(self, texts: list[str]) -> np.ndarray:
        """Texts -> [N, 384] float32, with this archive's tokenization rules (raises if too long)."""
        ids = self.rules.encode(texts)
        if any(self.rules.too_long(r) for r in ids):
            raise ValueError(f"a text is longer than {self.rules.max_length} word pieces")
        return self.embed_ids(ids)

    def embed_ids(self, rows: list[list[int]]) -> np.ndarray:
        """Token id rows -> [N, 384] float32, in chunks of at most maxBatchTokens padded tokens."""
        lengths = [len(r) for r in rows]
        fixed = self.rules.max_length if self.rules.padding == "max_length" else None
        out = np.empty((len(rows), EMBEDDING_DIM), dtype=np.float32)
        for group in _text.chunks(lengths, fixed, self.max_batch_tokens):
            batch = self.rules.pad([rows[k] for k in group])
            out[group] = self._forward(batch.input_ids, batch.attention_mask)
        return out

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        n = len(ids)
        if self._buckets:  # CUDA graphs: every batch at a recorded (bucket, maxLength) shape
            rows = next((b for b in self._buckets if b >= n), n)
            if rows > n:
                ids = np.concatenate([ids, np.zeros((rows - n, ids.shape[1]), np.int64)])
                mask = np.concatenate([mask, np.zeros((rows - n, mask.shape[1]), np.int64)])
                mask[n:, 0] = 1  # a padding row attends to one token, so its softmax stays finite
        return self._run(ids, mask)[:n]

    # -- loading --------------------------------------------------------------------------
    def _load(self, artefact: Path, model_dir: Path, section: dict[str, Any], batch_size: int) -> Any:
        wants_accel = section.get("autocast") is not None or bool(section.get("cudaGraphs", False))
        if wants_accel and self.format != "eager":
            raise ValueError("handler.autocast and handler.cudaGraphs apply to the eager format only")
        if self.format == "onnx":
            session = _support.load_artefact(self.format, artefact, self.device)

            def run_onnx(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
                return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

            return run_onnx
        if self.format == "eager":
            module = _support.load_module_from(model_dir / "minilm_model.py", "mariner_minilm_model")
            pooling = model_dir / "pooling_config.json"
            if pooling.exists():
                module.check_pooling(pooling)
            model: Any = module.load_encoder(model_dir, artefact).to(self.device)
        else:  # torchscript (the dynamic-int8 variant) or aoti
            model = _support.load_artefact(self.format, artefact, self.device)
        fn = model
        if wants_accel:
            accel_mod = _support.load_module_from(_HERE / "accel.py", "mariner_minilm_accel")
            self._accel = (accel_mod, accel_mod.settings(section))
            accel = self._accel[1]
            if accel.cuda_graphs and self.device.type == "cuda":
                self.rules.padding = "max_length"  # one recorded shape per batch bucket
                self._buckets = sorted(
                    {min(2**k, batch_size) for k in range(batch_size.bit_length())} | {batch_size}
                )
                length = self.rules.max_length

                def example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
                    ids = torch.zeros((b, length), dtype=torch.int64, device=self.device)
                    return ids, torch.ones_like(ids)

                fn = accel_mod.graphed(model, accel, self.device, self._buckets, example)
        device = self.device

        def run_torch(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            with torch.inference_mode(), self._autocast():
                out = fn(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device))
            return out.float().cpu().numpy()

        return run_torch

    def _autocast(self) -> Any:
        if self._accel is None:
            return contextlib.nullcontext()
        accel_mod, accel = self._accel
        return accel_mod.autocast(accel, self.device)

    def _warm_up(self) -> None:
        """One short and one long batch, so the first requests do not pay first-call costs."""
        short = self.rules.encode(["warm up"])
        self.embed_ids(short)
        self.embed_ids(short * 4)
