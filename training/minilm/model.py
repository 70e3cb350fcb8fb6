"""all-MiniLM-L6-v2 as one module: BERT encoder + mean pooling + L2 normalisation.

sentence-transformers runs the same model as three modules (Transformer, Pooling, Normalize)
and a Python loop; an archive needs one `nn.Module` with tensor inputs and a tensor output, so
that eager, ONNX, AOTInductor and int8 are the same function exported four ways. This file is
shipped in the archives as `minilm_model.py` (the eager variants build the module from it), so
it imports only torch, transformers and safetensors, never `mariner`.

Everything is read from the weights package's local files (config.json, model.safetensors,
1_Pooling/config.json): no hub, no URL. The pooling config is checked rather than assumed, so a
different checkpoint with CLS pooling fails loudly instead of serving wrong vectors.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

EMBEDDING_DIM = 384


def check_pooling(pooling_config: Path) -> None:
    """Refuse any pooling other than the mean over tokens (what this module implements)."""
    cfg = json.loads(pooling_config.read_text())
    wanted = {
        "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    wrong = {k: cfg.get(k) for k, v in wanted.items() if bool(cfg.get(k, False)) != v}
    if wrong:
        raise ValueError(f"{pooling_config}: only mean-token pooling is implemented, config has {wrong}")
    if int(cfg.get("word_embedding_dimension", EMBEDDING_DIM)) != EMBEDDING_DIM:
        raise ValueError(f"{pooling_config}: expected {EMBEDDING_DIM}-d embeddings")


class MiniLMEncoder(nn.Module):
    """(input_ids, attention_mask[, token_type_ids]) int64 [B, T] -> unit-length [B, 384] float32.

    Mean pooling counts only the tokens the mask marks, so padding a batch (to its longest text
    or to a fixed length) does not change any row's vector beyond float rounding.
    """

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        return nn.functional.normalize(summed / counts, p=2.0, dim=1)


def bert_from_config(config_json: Path) -> nn.Module:
    """An uninitialised BertModel (no pooler head: mean pooling replaces it) from config.json."""
    # transformers imports torchvision when it is installed (the `vision` extra), and the
    # registry's torchvision does not import beside the CPU torch without Mariner's shim. This
    # file also ships in the archive (minilm_model.py), where Mariner may be absent (stock
    # TorchServe): there the shim is skipped, and Mariner's workers have run it already.
    try:
        from mariner.server.worker.torchvision_ops import ensure_torchvision_importable
    except ImportError:
        pass
    else:
        ensure_torchvision_importable()
    from transformers import BertConfig, BertModel

    try:  # random init of 22M weights costs seconds and every one is overwritten by the load
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers release: initialise, only slower
        no_init_weights = contextlib.nullcontext

    config = BertConfig.from_json_file(str(config_json))
    with no_init_weights():
        return BertModel(config, add_pooling_layer=False)


def load_encoder(model_dir: Path, weights: Path | None = None) -> MiniLMEncoder:
    """The encoder in eval mode on the CPU, from a directory holding config.json and the weights.

    `weights` defaults to model_dir/model.safetensors. safetensors holds tensors only (no
    pickle), which is the weights_only guarantee for this format; the checkpoint's unused
    pooler head and position-id buffer are the only keys allowed to go unused.
    """
    from safetensors.torch import load_file

    bert = bert_from_config(model_dir / "config.json")
    state = load_file(str(weights or model_dir / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    missing, unexpected = bert.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]
    missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return MiniLMEncoder(bert).eval()
