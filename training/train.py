"""Train the digits CNN reproducibly.

`python -m mariner.training.train --out build/train` writes `last.pt` (resume point, every epoch) and
`best.pt` (best validation accuracy). Both are plain dicts of tensors and builtins so they load
with `torch.load(..., weights_only=True)`. Two runs with the same seed on CPU give identical
weights; `--resume` continues a run from `last.pt` bit-for-bit as if never interrupted: the
checkpoint carries every RNG state the run draws from (torch's CPU generator, the loader's
shuffling generator and, when training on CUDA, every GPU's generator, which dropout uses there).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mariner.training.data import DigitsDataset, load_splits, make_loader
from mariner.training.model import DigitsCNN


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    epochs: int = 40
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-2
    label_smoothing: float = 0.05
    clip_norm: float = 1.0
    patience: int = 15
    width: int = 32
    hidden: int = 128
    dropout: float = 0.25
    workers: int = 0


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float


def set_seed(seed: int) -> None:
    """Seed every RNG training touches and force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def amp_settings(device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype, use GradScaler): bf16 where supported, fp16+scaler otherwise, fp32 on CPU."""
    if device.type != "cuda":
        return None, False
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, False
    return torch.float16, True


def rng_state(gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """Every RNG state a resumed run needs to continue bit-for-bit."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "loader": gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], gen: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    gen.set_state(state["loader"])
    if device.type != "cuda":
        return
    saved = state.get("cuda")
    if not saved:
        warnings.warn(
            "resuming on CUDA from a checkpoint written without CUDA RNG state (a CPU run): "
            "dropout draws will differ from an uninterrupted run",
            stacklevel=2,
        )
        return
    count = torch.cuda.device_count()
    if len(saved) != count:
        warnings.warn(
            f"checkpoint holds RNG state for {len(saved)} GPUs, this machine has {count}; "
            "restoring the ones both have",
            stacklevel=2,
        )
    torch.cuda.set_rng_state_all(saved[:count])


@torch.inference_mode()
def evaluate(model: nn.Module, loader: Any, device: torch.device) -> EvalResult:
    """Mean loss and accuracy with the model in eval mode (BN running stats, no dropout)."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total, correct, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += float(loss_fn(logits.float(), y))
        correct += int((logits.argmax(1) == y).sum())
        total += len(y)
    return EvalResult(loss=loss_sum / total, accuracy=correct / total)


def build_model(cfg: TrainConfig) -> DigitsCNN:
    return DigitsCNN(width=cfg.width, hidden=cfg.hidden, dropout=cfg.dropout)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Checkpoints are dicts of tensors and builtins: never unpickle arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def train(cfg: TrainConfig, out: Path, *, resume: bool = False, progress: bool | None = None) -> Path:
    """Train, keep the best epoch by validation accuracy, stop early; return best.pt's path."""
    out.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_dtype, use_scaler = amp_settings(device)
    pinned = device.type == "cuda"  # page-locked batches, so the copies below can be async

    splits = load_splits(seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train_dl = make_loader(
        DigitsDataset(splits.train, splits.norm),
        cfg.batch_size,
        shuffle=True,
        generator=gen,
        workers=cfg.workers,
        pin_memory=pinned,
    )
    val_dl = make_loader(
        DigitsDataset(splits.val, splits.norm),
        256,
        shuffle=False,
        generator=torch.Generator().manual_seed(cfg.seed),
        workers=0,
    )

    model = build_model(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # OneCycle is defined per optimizer step, so it is stepped once per batch, after the step.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * len(train_dl)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    start_epoch, best_acc, best_loss, stale = 0, -1.0, math.inf, 0
    best_state: dict[str, torch.Tensor] = {}
    last_path, best_path = out / "last.pt", out / "best.pt"
    if resume and last_path.exists():
        ck = load_checkpoint(last_path)
        if ck["config"] != asdict(cfg):
            changed = sorted(k for k, v in asdict(cfg).items() if ck["config"].get(k) != v)
            raise ValueError(
                f"--resume needs the settings of the interrupted run; these differ: {', '.join(changed)}"
            )
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        restore_rng_state(ck["rng"], gen, device)
        start_epoch = ck["epoch"] + 1
        best_acc, best_loss, stale = ck["best"]["acc"], ck["best"]["loss"], ck["best"]["stale"]
        best_state = ck["best"]["model"]

    bar = tqdm(
        range(start_epoch, cfg.epochs),
        desc="train",
        unit="epoch",
        disable=None if progress is None else not progress,
    )
    for epoch in bar:
        if stale >= cfg.patience:
            break
        model.train()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=pinned), y.to(device, non_blocking=pinned)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        val = evaluate(model, val_dl, device)
        if val.accuracy > best_acc or (val.accuracy == best_acc and val.loss < best_loss):
            best_acc, best_loss, stale = val.accuracy, val.loss, 0
            best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            torch.save(_checkpoint(cfg, splits.norm, best_state, epoch, val), best_path)
        else:
            stale += 1
        bar.set_postfix(val_acc=f"{val.accuracy:.4f}", val_loss=f"{val.loss:.4f}", stale=stale)
        ck = _checkpoint(cfg, splits.norm, model.state_dict(), epoch, val)
        ck.update(
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(),
            scaler=scaler.state_dict(),
            rng=rng_state(gen, device),
            best={"acc": best_acc, "loss": best_loss, "stale": stale, "model": best_state},
        )
        torch.save(ck, last_path)
    return best_path


def _checkpoint(
    cfg: TrainConfig, norm: Any, state: dict[str, torch.Tensor], epoch: int, val: EvalResult
) -> dict[str, Any]:
    return {
        "model": state,
        "epoch": epoch,
        "config": asdict(cfg),
        "norm": asdict(norm),
        "val": asdict(val),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/train"))
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    cfg = replace(defaults, **{k: getattr(args, k) for k in asdict(defaults)})
    best = train(cfg, args.out, resume=args.resume)
    ck = load_checkpoint(best)
    print(f"best epoch {ck['epoch']}: val acc {ck['val']['accuracy']:.4f} -> {best}")


if __name__ == "__main__":
    main()
