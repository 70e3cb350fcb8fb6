"""AOTInductor packages are machine code: checked for device and CPU ISA before loading.

Fake packages (a zip holding AOTInductor's metadata json) and a fake /proc/cpuinfo stand in
for other machines; the loader is replaced so nothing is compiled. One test builds a real tiny
package to check what the export records (portable -march, AVX2) is what the handler reads.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import mariner.handlers.digits_handler as dh
import mariner.handlers.handler_support as dd
from mariner.handlers.digits_handler import DigitsHandler
from mariner.server.worker.context import Context
from mariner.training import export, package
from mariner.training.model import DigitsCNN

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HOST_AVX2 = frozenset(dd.MARCH_CPU_FLAGS["x86-64-v3"] | {"sse2", "avx"})
HOST_AVX512 = HOST_AVX2 | dd.ISA_CPU_FLAGS["AVX512"] | dd.ISA_CPU_FLAGS["AVX512_VNNI"]
NATIVE_AVX512 = {"AOTI_DEVICE_KEY": "cpu", "AOTI_MACHINE": "x86_64", "AOTI_CPU_ISA": "AVX512 AVX512_VNNI"}
PORTABLE = {
    "AOTI_DEVICE_KEY": "cpu",
    "AOTI_MACHINE": "x86_64",
    "AOTI_CPU_ISA": "AVX2",
    dd.META_MARCH: "x86-64-v3",
    dd.META_CPU_FLAGS: " ".join(sorted(dd.MARCH_CPU_FLAGS["x86-64-v3"])),
}
CUDA_PKG = {"AOTI_DEVICE_KEY": "cuda", "AOTI_MACHINE": "x86_64", "AOTI_CPU_ISA": "AVX2"}
CPU, GPU = torch.device("cpu"), torch.device("cuda:1")


def _fake_package(path: Path, meta: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("m/data/aotinductor/model/abc.wrapper_metadata.json", json.dumps(meta))
        zf.writestr("m/data/aotinductor/model/abc.wrapper.so", b"\x7fELF")
    return path


# -- the checks ---------------------------------------------------------------------------------


def test_metadata_is_read_from_the_package(tmp_path: Path) -> None:
    assert dd.aoti_metadata(_fake_package(tmp_path / "p.pt2", PORTABLE)) == PORTABLE


def test_a_zip_without_aoti_metadata_is_refused(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "x.pt2", "w") as zf:
        zf.writestr("weights.bin", b"0")
    with pytest.raises(ValueError, match="no AOTInductor metadata"):
        dd.aoti_metadata(tmp_path / "x.pt2")


def test_cuda_package_on_a_cpu_instance_is_refused() -> None:
    with pytest.raises(RuntimeError, match="compiled for CUDA but this instance is on the CPU"):
        dd.check_aoti_package(CUDA_PKG, CPU, HOST_AVX512, "p.pt2")


def test_cpu_package_on_a_cuda_instance_is_refused() -> None:
    with pytest.raises(RuntimeError, match="compiled for the CPU but this instance is configured for cuda:1"):
        dd.check_aoti_package(PORTABLE, GPU, HOST_AVX512, "p.pt2")


def test_cuda_package_on_a_cuda_instance_passes() -> None:
    dd.check_aoti_package(CUDA_PKG, GPU, HOST_AVX2, "p.pt2")


def test_avx512_package_on_an_avx2_host_is_refused_naming_the_missing_flags() -> None:
    with pytest.raises(RuntimeError, match=r"needs CPU features this host lacks: avx512_vnni, avx512bw"):
        dd.check_aoti_package(NATIVE_AVX512, CPU, HOST_AVX2, "p.pt2")


def test_portable_package_runs_on_any_x86_64_v3_host() -> None:
    dd.check_aoti_package(PORTABLE, CPU, HOST_AVX2, "p.pt2")
    dd.check_aoti_package(PORTABLE, CPU, HOST_AVX512, "p.pt2")


def test_recorded_flags_are_checked_not_only_the_isa_name() -> None:
    older = HOST_AVX2 - {"movbe"}  # an AVX2 CPU that is not x86-64-v3
    with pytest.raises(RuntimeError, match="x86-64-v3.*lacks: movbe"):
        dd.check_aoti_package(PORTABLE, CPU, older, "p.pt2")


def test_unreadable_cpuinfo_skips_the_isa_check(tmp_path: Path) -> None:
    assert dd.host_cpu_flags(tmp_path / "missing") is None
    dd.check_aoti_package(NATIVE_AVX512, CPU, None, "p.pt2")


def test_host_flags_come_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: spectre\n")
    assert dd.host_cpu_flags(info) == {"fpu", "sse2", "avx2", "fma"}


# -- through the handler ------------------------------------------------------------------------


@pytest.fixture
def aoti_dir(tmp_path: Path) -> Path:
    (tmp_path / "norm.json").write_text(json.dumps({"mean": 4.9, "std": 6.0}))
    return tmp_path


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the AOTI loader: record how it was called, return a small eager model.

    (The handler imports its helper by path, as in an archive: patch `dh._support`, not `dd`.)"""
    calls: list[dict[str, Any]] = []
    model = DigitsCNN(width=8, hidden=32).eval()

    def load(path: str, **kwargs: Any) -> Any:
        calls.append({"path": path, **kwargs})
        return model

    monkeypatch.setattr(torch._inductor, "aoti_load_package", load)
    return calls


def _ctx(model_dir: Path, device: str, gpu_id: int | None = None) -> Context:
    manifest = {"model": {"modelName": "a", "serializedFile": "m.pt2", "handler": "digits_handler.py"}}
    cfg = {"batchSize": 2, "handler": {"format": "aoti", "device": device}}
    return Context("a", str(model_dir), manifest, batch_size=2, gpu_id=gpu_id, model_yaml_config=cfg)


def test_handler_refuses_a_package_for_a_cpu_this_host_is_not(
    aoti_dir: Path, loads: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(aoti_dir / "m.pt2", NATIVE_AVX512)
    monkeypatch.setattr(dh._support, "host_cpu_flags", lambda: HOST_AVX2)
    with pytest.raises(RuntimeError, match="lacks: avx512"):
        DigitsHandler().initialize(_ctx(aoti_dir, "cpu"))
    assert loads == []  # refused before the machine code was mapped


def test_handler_loads_a_portable_cpu_package(
    aoti_dir: Path, loads: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(aoti_dir / "m.pt2", PORTABLE)
    monkeypatch.setattr(dh._support, "host_cpu_flags", lambda: HOST_AVX2)
    h = DigitsHandler()
    h.initialize(_ctx(aoti_dir, "cpu", gpu_id=0))  # offered a GPU: a CPU-only artefact stays on the CPU
    assert h.device == CPU
    assert loads == [{"path": str(aoti_dir / "m.pt2"), "device_index": -1}]


def test_handler_refuses_a_cpu_package_configured_for_cuda(
    aoti_dir: Path, loads: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(aoti_dir / "m.pt2", PORTABLE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="compiled for the CPU but this instance is configured for cuda:1"):
        DigitsHandler().initialize(_ctx(aoti_dir, "cuda", gpu_id=1))
    assert loads == []


def test_handler_loads_a_cuda_package_on_the_instance_gpu(
    aoti_dir: Path, loads: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load passes device_index=gpu_id (not the default, GPU 0)."""
    _fake_package(aoti_dir / "m.pt2", CUDA_PKG)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    h = DigitsHandler()
    monkeypatch.setattr(h, "_warm_up", lambda: None)  # the fake model cannot run on cuda:1 here
    monkeypatch.setattr(dh._support, "HostStaging", lambda *a, **k: None)  # pinning needs CUDA
    h.initialize(_ctx(aoti_dir, "cuda", gpu_id=1))
    assert h.device == GPU
    assert loads[0]["device_index"] == 1


# -- what the pipeline builds -------------------------------------------------------------------


def test_export_builds_for_the_portable_baseline_not_native() -> None:
    cfg = export.aoti_cpu_configs()
    assert cfg["cpp.march"] == "x86-64-v3"
    assert cfg["cpp.simdlen"] == 256
    recorded = set(cfg["aot_inductor.metadata"][dd.META_CPU_FLAGS].split())
    assert dd.ISA_CPU_FLAGS["AVX2"] <= recorded
    assert not any(f.startswith(("avx512", "amx")) for f in recorded)
    assert cfg["aot_inductor.metadata"][dd.META_MARCH] == "x86-64-v3"


def test_without_the_march_knob_the_package_records_every_native_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Older torch compiles with -march=native: the package must then demand the build CPU's flags."""
    monkeypatch.delattr(torch._inductor.config.cpp, "march")
    monkeypatch.setattr(export, "host_cpu_flags", lambda: HOST_AVX512 | {"fpu", "vme"})
    cfg = export.aoti_cpu_configs()
    assert "cpp.march" not in cfg
    recorded = set(cfg["aot_inductor.metadata"][dd.META_CPU_FLAGS].split())
    assert dd.ISA_CPU_FLAGS["AVX512"] <= recorded
    assert not {"fpu", "vme"} & recorded
    assert cfg["aot_inductor.metadata"][dd.META_MARCH] == "native"
    with pytest.raises(RuntimeError, match="avx512"):
        dd.check_aoti_package({"AOTI_DEVICE_KEY": "cpu", **cfg["aot_inductor.metadata"]}, CPU, HOST_AVX2, "p")


@pytest.mark.slow
def test_a_real_package_records_the_baseline_and_passes_the_check(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DigitsCNN(width=8, hidden=32).eval()
    path = tmp_path / "p.pt2"
    export.aoti_cpu_package(export.export_program(model), path)
    meta = dd.aoti_metadata(path)
    assert meta["AOTI_CPU_ISA"] == "AVX2"
    assert meta[dd.META_MARCH] == "x86-64-v3"
    assert export.aoti_target(path) == "cpu -march=x86-64-v3 (AVX2)"
    dd.check_aoti_package(meta, CPU, HOST_AVX2, path.name)
    x = torch.randn(3, 1, 8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(torch._inductor.aoti_load_package(str(path))(x), model(x))


def test_staged_archive_carries_the_device_helper_beside_the_handler(tmp_path: Path) -> None:
    art = tmp_path / "w.pt"
    art.write_bytes(b"0")
    staged = package.stage(
        export.Artefact("compiled", art, "compiled", "any", 0.0), work=tmp_path / "stage",
        norm={"mean": 0.0, "std": 1.0}, model_kwargs={}, batch_size=8, max_batch_delay_ms=5,
    )  # fmt: skip
    helper = staged.dir / "handler_support.py"
    assert helper in staged.extra_files
    assert helper.read_bytes() == (ROOT / "handlers" / "handler_support.py").read_bytes()
    assert (staged.dir / "digits_handler.py").exists()
    assert staged.model_config["handler"]["compile"]["dynamic"] is False


def test_handler_in_a_staged_dir_imports_its_helper_from_there(tmp_path: Path) -> None:
    """In the archive the helper is found beside the handler, not in the repo."""
    import importlib.util

    for name in ("digits_handler.py", "handler_support.py"):
        shutil.copy2(ROOT / "handlers" / name, tmp_path / name)
    spec = importlib.util.spec_from_file_location("staged_handler", tmp_path / "digits_handler.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert Path(mod._support.__file__) == tmp_path / "handler_support.py"
