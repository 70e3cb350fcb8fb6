"""Lint the container images without building them (no Docker engine here).

What a build or a pod would trip over, checked from the files: every COPY source exists and survives
.dockerignore, `pip install .` gets everything pyproject.toml needs, the entrypoint is a console
script that really starts `mariner serve`, the final stage runs as a numeric non-root user (the one
the Deployment sets) with no build tools, the config file baked in is a valid Mariner config, the
token files it names exist as placeholders (so a container without the Secret refuses to start with
the server's own message), and the exposed ports are the server's defaults.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import yaml

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_loading import load_config
from mariner.server.common.listeners import check_exposure
from mariner.server.contracts.errors import Code, ServingError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
# Packages that compile things; none may be installed in the final stage.
BUILD_TOOLS = re.compile(
    r"(?<![\w.-])(gcc|g\+\+|clang|make|cmake|ninja-build|build-essential|cargo|rustc|git|"
    r"[\w.+-]+-dev|[\w.+-]+-devel)(?![\w.+-])"
)
MARINER_CONFIG = "/etc/mariner/mariner.yaml"
ADDRESS_FIELDS = (
    "inference_address",
    "management_address",
    "metrics_address",
    "grpc_inference_address",
    "grpc_management_address",
)


# -- a small Dockerfile reader -------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass(frozen=True)
class Stage:
    base: str  # after ARG substitution
    name: str | None
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs of this stage, later ones winning."""
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            for part in shlex.split(ins.args):
                key, sep, value = part.partition("=")
                assert sep, f"line {ins.line}: use ENV key=value (got {part!r})"
                out[key] = value
        return out


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: tuple[Stage, ...]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages if s.name]


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Instructions with backslash continuations joined; comment lines dropped (also mid-instruction)."""
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        yield start, buf
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    current: list[Instruction] | None = None
    base, name = "", None
    for line, text in _logical_lines(path.read_text()):
        keyword, _, args = text.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            if current is not None:
                stages.append(Stage(base, name, tuple(current)))
            parts = args.split()
            parts = [p for p in parts if not p.startswith("--")]
            base = _substitute(parts[0], global_args)
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            current = []
        elif current is None:
            assert keyword == "ARG", f"{path.name}:{line}: only ARG may come before the first FROM"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            current.append(Instruction(keyword, args, line))
    assert current is not None, f"{path.name} has no FROM"
    stages.append(Stage(base, name, tuple(current)))
    return Dockerfile(path, global_args, tuple(stages))


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    dest: str
    from_stage: str | None
    line: int


def copies(stage: Stage) -> list[Copy]:
    out = []
    for ins in stage.all("COPY") + stage.all("ADD"):
        parts = json.loads(ins.args) if ins.args.startswith("[") else shlex.split(ins.args)
        flags = {p.split("=", 1)[0]: p.split("=", 1)[-1] for p in parts if p.startswith("--")}
        paths = [p for p in parts if not p.startswith("--")]
        assert len(paths) >= 2, f"line {ins.line}: COPY needs a source and a destination"
        out.append(Copy(tuple(paths[:-1]), paths[-1], flags.get("--from"), ins.line))
    return out


# -- .dockerignore, with Docker's matching rules ------------------------------------------------
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax: `*` and `?` within one path element, `**` across elements."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body[:1] in ("!", "^") else body) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


@dataclass(frozen=True)
class DockerIgnore:
    rules: tuple[tuple[bool, re.Pattern[str]], ...]  # (is_exception, pattern)

    @classmethod
    def load(cls, path: Path) -> DockerIgnore:
        rules = []
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = line[1:].strip() if negate else line
            rules.append((negate, _glob_regex(pattern.strip("/"))))
        return cls(tuple(rules))

    def excluded(self, rel: str) -> bool:
        """Whether the build context leaves `rel` out: the last rule matching it or a parent wins."""
        parts = rel.strip("/").split("/")
        candidates = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        verdict = False
        for negate, rx in self.rules:
            if any(rx.match(c) for c in candidates):
                verdict = not negate
        return verdict


def _source_files(rel: str) -> list[str]:
    """Files under `rel` that a checkout carries: tracked or new, not git-ignored (generated stubs are)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", rel],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if (REPO / line).is_file()]


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dockerignore() -> DockerIgnore:
    return DockerIgnore.load(REPO / ".dockerignore")


@pytest.fixture(scope="module", params=DOCKERFILES)
def dockerfile(request: pytest.FixtureRequest) -> Dockerfile:
    return parse_dockerfile(REPO / request.param)


def _default_ports() -> dict[str, int]:
    cfg = ServerConfig()
    return {f: int(getattr(cfg, f).rpartition(":")[2]) for f in ADDRESS_FIELDS}


# -- the reader itself ----------------------------------------------------------------------------
def test_reader_joins_continuations_and_skips_comments(tmp_path: Path) -> None:
    df = tmp_path / "Dockerfile"
    df.write_text(
        "ARG IMG=python:3.11-slim\nFROM ${IMG} AS build\nRUN a \\\n# note\n && b\n"
        "FROM build\nUSER 1:1\nCOPY --from=build /x /y\n"
    )
    parsed = parse_dockerfile(df)
    assert [s.base for s in parsed.stages] == ["python:3.11-slim", "build"]
    assert parsed.stages[0].all("RUN")[0].args == "a  && b"
    assert copies(parsed.final)[0] == Copy(("/x",), "/y", "build", 8)


def test_dockerignore_matching_follows_docker_rules(tmp_path: Path) -> None:
    ignore_file = tmp_path / ".dockerignore"
    ignore_file.write_text("k8s\n!k8s/base/mariner.yaml\n**/__pycache__\n*.egg-info\n")
    ignore = DockerIgnore.load(ignore_file)
    assert ignore.excluded("k8s/base/deployment.yaml")
    assert not ignore.excluded("k8s/base/mariner.yaml")
    assert ignore.excluded("server/__pycache__/cli.cpython-311.pyc")
    assert ignore.excluded("mariner.egg-info/PKG-INFO")
    assert not ignore.excluded("server/cli.py")


# -- the images -----------------------------------------------------------------------------------
def test_every_copy_source_exists_and_is_in_the_build_context(
    dockerfile: Dockerfile, dockerignore: DockerIgnore
) -> None:
    problems = []
    for stage in dockerfile.stages:
        for cp in copies(stage):
            if cp.from_stage is not None:
                continue
            for src in cp.sources:
                rel = src.rstrip("/")
                matches = sorted(REPO.glob(rel)) if any(ch in rel for ch in "*?[") else [REPO / rel]
                if not matches or not all(m.exists() for m in matches):
                    problems.append(f"line {cp.line}: {src} does not exist")
                    continue
                for m in matches:
                    inner = [m] if m.is_file() else [p for p in m.rglob("*") if p.is_file()]
                    kept = [p for p in inner if not dockerignore.excluded(str(p.relative_to(REPO)))]
                    if dockerignore.excluded(str(m.relative_to(REPO))) and not kept:
                        problems.append(f"line {cp.line}: {src} is excluded by .dockerignore")
                    elif not kept:
                        problems.append(f"line {cp.line}: nothing under {src} survives .dockerignore")
    assert not problems, f"{dockerfile.path.name}:\n" + "\n".join(problems)


def test_copy_from_names_an_earlier_stage(dockerfile: Dockerfile) -> None:
    seen: list[str] = []
    for stage in dockerfile.stages:
        for cp in copies(stage):
            if cp.from_stage is not None:
                assert cp.from_stage in seen, (
                    f"line {cp.line}: --from={cp.from_stage} is not an earlier stage"
                )
        if stage.name:
            assert stage.name not in seen, f"stage name {stage.name} is used twice"
            seen.append(stage.name)


def test_build_stage_copies_what_pip_install_needs(
    dockerfile: Dockerfile, pyproject: dict, dockerignore: DockerIgnore
) -> None:
    """`pip install .` needs pyproject.toml, setup.py, the readme, proto/ and every folder setup.py maps."""
    build = next(s for s in dockerfile.stages if any("pip install ." in r.args for r in s.all("RUN")))
    copied = {src.rstrip("/") or "." for cp in copies(build) if cp.from_stage is None for src in cp.sources}
    needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"], "proto"}
    folders = ast.literal_eval(re.search(r"^FOLDERS = (\(.*\))$", (REPO / "setup.py").read_text(), re.M)[1])
    assert folders, "setup.py names no folders"
    needed |= {p for p in folders if (REPO / p).is_dir()}
    for rel in sorted(needed):
        assert "." in copied or rel in copied, f"{dockerfile.path.name}: the build stage does not copy {rel}"
        for name in _source_files(rel):
            if name.endswith((".py", ".proto", ".toml", ".md")):
                assert not dockerignore.excluded(name), (
                    f"{name} is needed by `pip install .` but .dockerignore drops it"
                )


def test_torch_pin_matches_pyproject(dockerfile: Dockerfile, pyproject: dict) -> None:
    pinned = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    runs = " ".join(r.args for s in dockerfile.stages for r in s.all("RUN"))
    assert re.findall(r"\btorch==[\w.+]+", runs) == [pinned], (
        f"{dockerfile.path.name} must install exactly {pinned} (as pyproject.toml pins it)"
    )


def test_vision_pins_match_pyproject(dockerfile: Dockerfile, pyproject: dict) -> None:
    """Both images carry pyproject's `vision` extra at its pins (TorchServe's vision handlers need
    all of it), torchvision from the torch index beside torch, so the two builds match."""
    build = next(s for s in dockerfile.stages if any("pip install ." in r.args for r in s.all("RUN")))
    args = _stage_args(build)
    runs = [_substitute(r.args, args) for r in build.all("RUN")]
    vision = pyproject["project"]["optional-dependencies"]["vision"]
    for pin in vision:
        assert sum(len(re.findall(rf"(?<![\w-]){re.escape(pin)}(?![\w.])", r)) for r in runs) == 1, (
            f"{dockerfile.path.name} must install {pin} once (as pyproject's `vision` extra pins it)"
        )
    (torchvision,) = [d for d in vision if d.startswith("torchvision==")]
    (torch_run,) = [r for r in runs if re.search(r"\btorch==", r)]
    assert torchvision in torch_run, f"{dockerfile.path.name}: {torchvision} is not installed beside torch"


def _stage_args(stage: Stage) -> dict[str, str]:
    """ARG defaults declared inside a stage."""
    return dict(a.args.split("=", 1) for a in stage.all("ARG") if "=" in a.args)


def test_runtime_virtualenv_gets_the_serving_set_only(dockerfile: Dockerfile, pyproject: dict) -> None:
    """/opt/venv (what the runtime stage copies) gets `pip install .` with no extras and no
    generator; grpcio-tools lives in a build-only virtualenv pinned as pyproject's `protogen` extra."""
    build = next(s for s in dockerfile.stages if any("pip install ." in r.args for r in s.all("RUN")))
    args = _stage_args(build)
    commands = [_substitute(cmd.strip(), args) for r in build.all("RUN") for cmd in re.split(r"&&|;", r.args)]
    into_venv = [c for c in commands if re.match(r"^(pip|python3?[\d.]* -m pip) install\b", c)]
    assert into_venv, f"{dockerfile.path.name}: no pip install into /opt/venv"
    for cmd in into_venv:
        assert not re.search(r"\[|-r ", cmd), f"{dockerfile.path.name}: {cmd!r} installs extras"
        assert "grpcio-tools" not in cmd, f"{dockerfile.path.name}: {cmd!r} puts the generator in /opt/venv"
    assert any(re.fullmatch(r"pip install \.", c) for c in into_venv), into_venv
    (tools,) = pyproject["project"]["optional-dependencies"]["protogen"]
    generator_installs = [c for c in commands if "grpcio-tools" in c]
    assert generator_installs == [f'/opt/protogen/bin/pip install "{tools}"'], generator_installs
    assert "/opt/protogen/bin/python server/protogen.py" in commands
    copied = [src for cp in copies(dockerfile.final) if cp.from_stage == build.name for src in cp.sources]
    assert copied == ["/opt/venv"], f"{dockerfile.path.name}: the runtime stage copies {copied}"


def test_stub_generator_runs_from_a_bare_source_tree(tmp_path: Path) -> None:
    """The build stage runs server/protogen.py with nothing installed but grpcio-tools: it must
    need nothing of the project, and write a package of stubs for every .proto."""
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    (tmp_path / "server").mkdir()
    shutil.copy2(REPO / "server" / "protogen.py", tmp_path / "server" / "protogen.py")
    proc = subprocess.run(
        [sys.executable, "-I", "server/protogen.py"],  # -I: no cwd or user site on sys.path
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "server" / "_proto"
    assert (out / "__init__.py").is_file()
    for proto in (tmp_path / "proto").rglob("*.proto"):
        rel = proto.relative_to(tmp_path / "proto").with_suffix("")
        assert (out / rel.parent / f"{rel.name}_pb2.py").is_file(), rel


def test_base_images_are_pinned(dockerfile: Dockerfile) -> None:
    earlier: list[str] = []
    for stage in dockerfile.stages:
        if stage.base not in earlier:
            assert "$" not in stage.base, f"FROM {stage.base}: an ARG without a default"
            image = stage.base.split("@")[0]
            tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
            assert "@sha256:" in stage.base or (tag and tag != "latest"), (
                f"{dockerfile.path.name}: FROM {stage.base} must name a version tag or a digest"
            )
        if stage.name:
            earlier.append(stage.name)


def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile: Dockerfile) -> None:
    users = dockerfile.final.all("USER")
    assert users, f"{dockerfile.path.name}: the final stage has no USER, so it runs as root"
    uid, _, gid = users[-1].args.partition(":")
    # Numeric, because the kubelet can only prove runAsNonRoot for a numeric USER.
    assert uid.isdigit(), f"USER {users[-1].args}: need a numeric uid"
    assert int(uid) != 0, f"USER {users[-1].args}: runs as root"
    assert gid.isdigit(), f"USER {users[-1].args}: need a numeric group"
    assert int(gid) != 0, f"USER {users[-1].args}: runs with the root group"


def test_pod_runs_as_the_image_user(dockerfile: Dockerfile) -> None:
    uid, _, gid = dockerfile.final.all("USER")[-1].args.partition(":")
    deployment = yaml.safe_load((REPO / "k8s/base/deployment.yaml").read_text())
    pod_sc = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (pod_sc["runAsUser"], pod_sc["runAsGroup"]) == (int(uid), int(gid or uid))


def test_final_stage_has_no_build_tools(dockerfile: Dockerfile) -> None:
    final = dockerfile.final
    assert not re.search(r"-devel\b|-dev\b", final.base), f"FROM {final.base}: a development image"
    for run in final.all("RUN"):
        assert "pip install" not in run.args, f"line {run.line}: install Python packages in the build stage"
        for command in re.split(r"&&|;|\|\|", run.args):
            if re.search(r"\b(apt-get|apt|apk|dnf|yum|microdnf)\b.*\binstall\b", command):
                tool = BUILD_TOOLS.search(command.split("install", 1)[1])
                assert tool is None, f"line {run.line}: {tool and tool.group(1)} in the final stage"


def test_entrypoint_is_the_mariner_console_script(
    dockerfile: Dockerfile, pyproject: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    entrypoints = dockerfile.final.all("ENTRYPOINT")
    assert entrypoints, f"{dockerfile.path.name}: no ENTRYPOINT"
    argv = json.loads(entrypoints[-1].args)  # exec form: signals reach the server, not a shell
    assert isinstance(argv, list)
    scripts = pyproject["project"]["scripts"]
    assert argv[0] in scripts, f"ENTRYPOINT {argv[0]!r} is not a console script of pyproject.toml"
    module, _, func = scripts[argv[0]].partition(":")
    main = getattr(__import__(module, fromlist=[func]), func)
    # The same call the container makes, asking for help instead of serving: exits 0 through
    # `mariner serve`'s own option parser.
    with pytest.raises(SystemExit) as exc:
        main([*argv[1:], "--help"])
    assert exc.value.code == 0
    assert "--model-store" in capsys.readouterr().out


def test_mariner_env_names_are_server_settings(dockerfile: Dockerfile) -> None:
    known = {f"MARINER_{f.name.upper()}" for f in fields(ServerConfig)}
    for stage in dockerfile.stages:
        unknown = {k for k in stage.env() if k.startswith("MARINER_")} - known
        assert not unknown, f"{dockerfile.path.name}: {sorted(unknown)} are not Mariner settings"


def test_baked_in_config_file_is_the_one_mariner_reads(dockerfile: Dockerfile, tmp_path: Path) -> None:
    env = dockerfile.final.env()
    config_path = env["MARINER_CONFIG_FILE"]
    sources = [cp.sources for cp in copies(dockerfile.final) if cp.dest == config_path]
    assert sources, f"{dockerfile.path.name}: nothing is copied to MARINER_CONFIG_FILE={config_path}"
    (source,) = sources[-1]
    cfg = load_config([], env={"MARINER_CONFIG_FILE": str(REPO / source)})
    # The image must be reachable from outside its own network namespace.
    for field_name in ADDRESS_FIELDS:
        host = getattr(cfg, field_name).rpartition(":")[0]
        assert host in ("0.0.0.0", "[::]"), f"{source}: {field_name} binds {host}, unreachable from outside"
    # The directories the config names exist in the image (created in the final stage).
    made = " ".join(r.args for r in dockerfile.final.all("RUN"))
    assert cfg.model_store is not None
    assert cfg.work_dir is not None
    assert str(cfg.model_store) in made, f"the image does not create {cfg.model_store}"
    # The server makes its private work dir itself; the image creates it or the directory above it.
    assert any(re.search(rf"{re.escape(str(d))}(\s|$)", made) for d in (cfg.work_dir, cfg.work_dir.parent)), (
        f"the image creates neither {cfg.work_dir} nor a directory above it"
    )


def _baked_config(dockerfile: Dockerfile) -> Path:
    (source,) = next(cp.sources for cp in reversed(copies(dockerfile.final)) if cp.dest == MARINER_CONFIG)
    return REPO / source


def _placeholder_paths(dockerfile: Dockerfile) -> tuple[Path, Path]:
    """The token files the baked-in config names, which the image must create (placeholders)."""
    cfg = load_config([], env={"MARINER_CONFIG_FILE": str(_baked_config(dockerfile))})
    assert cfg.inference_token_file is not None, "the baked-in config names no inference token file"
    assert cfg.management_token_file is not None, "the baked-in config names no management token file"
    return cfg.inference_token_file, cfg.management_token_file


def test_image_without_tokens_refuses_to_start_and_says_why(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """`docker run` without the Secret: the baked-in config loads, the token files it names exist
    (placeholders holding no token), and the server refuses its 0.0.0.0 listeners with the message
    that says what to set, rather than failing on a missing file or starting open."""
    assert dockerfile.final.env()["MARINER_CONFIG_FILE"] == MARINER_CONFIG
    made = " ".join(r.args for r in dockerfile.final.all("RUN"))
    placeholders = _placeholder_paths(dockerfile)
    for path in placeholders:
        assert str(path) in made, f"{dockerfile.path.name}: the image does not create {path}"
        assert not any(cp.dest.startswith(str(path.parent)) for cp in copies(dockerfile.final)), (
            "no token file may be copied into the image"
        )
    # The placeholders, as the image has them: no token line (comments only, or empty).
    local = {}
    for path in placeholders:
        local[path] = tmp_path / path.name
        local[path].write_text("# No token: mount the mariner-tokens Secret over this directory.\n")
    base = {
        "MARINER_CONFIG_FILE": str(_baked_config(dockerfile)),
        "MARINER_INFERENCE_TOKEN_FILE": str(local[placeholders[0]]),
        "MARINER_MANAGEMENT_TOKEN_FILE": str(local[placeholders[1]]),
    }
    with pytest.raises(ServingError) as info:
        check_exposure(load_config([], env=base))
    assert info.value.code == Code.PERMISSION_DENIED
    assert "refusing to listen beyond loopback without authentication" in info.value.message
    assert "MARINER_INFERENCE_TOKEN_FILE" in info.value.message, "the refusal must say what to set"
    # `-e MARINER_INSECURE=true`, for local experiments: starts (without tokens).
    inference, management = check_exposure(load_config([], env={**base, "MARINER_INSECURE": "true"}))
    assert not inference
    assert not management
    # Token files mounted over the placeholders: starts, and every line of a file is a token.
    local[placeholders[0]].write_text("old-token\nnew-token\n")
    local[placeholders[1]].write_text("admin-token\n")
    inference, management = check_exposure(load_config([], env=base))
    assert inference.accepts("Bearer old-token")
    assert inference.accepts("Bearer new-token")
    assert management.accepts("Bearer admin-token")
    assert not inference.accepts("Bearer admin-token")


def test_placeholders_sit_where_kubernetes_mounts_the_secret(dockerfile: Dockerfile) -> None:
    """The Deployment mounts the token Secret over the directory holding the image's placeholders."""
    (tokens_dir,) = {p.parent for p in _placeholder_paths(dockerfile)}
    deployment = yaml.safe_load((REPO / "k8s/base/deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    (server,) = [c for c in spec["containers"] if c["name"] == "mariner"]
    (mount,) = [m for m in server["volumeMounts"] if Path(m["mountPath"]) == tokens_dir]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "mariner-tokens"


def test_exposed_ports_are_the_server_defaults(dockerfile: Dockerfile) -> None:
    exposed = {int(p.split("/")[0]) for e in dockerfile.final.all("EXPOSE") for p in e.args.split()}
    assert exposed == set(_default_ports().values())


def test_models_stage_feeds_the_init_container(dockerignore: DockerIgnore) -> None:
    """The model image holds the archives and index.json where the Deployment's initContainer copies from."""
    parsed = parse_dockerfile(REPO / "Dockerfile")
    models = next(s for s in parsed.stages if s.name == "models")
    (cp,) = copies(models)
    assert cp.sources == ("model_store/",)
    for rel in ("model_store/index.json", "model_store/digits_torchscript.mar"):
        assert not dockerignore.excluded(rel), f"{rel} is excluded from the model image"
    deployment = yaml.safe_load((REPO / "k8s/base/deployment.yaml").read_text())
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:3] == ["cp", "-R", cp.dest.rstrip("/") + "/."]
    assert parsed.final.name != "models", "`docker build .` must build the server, not the model image"


def test_dockerignore_keeps_local_state_out(dockerignore: DockerIgnore) -> None:
    for rel in (".git/HEAD", ".venv/bin/python", "server/_proto/__init__.py", "build/train/best.pt"):
        assert dockerignore.excluded(rel), f"{rel} would be sent to the build"


def _venv_commands(dockerfile: Dockerfile) -> list[str]:
    """The build stage's shell commands, in order, with its ARG defaults filled in."""
    build = next(s for s in dockerfile.stages if any("pip install ." in r.args for r in s.all("RUN")))
    args = _stage_args(build)
    return [_substitute(cmd.strip(), args) for r in build.all("RUN") for cmd in re.split(r"&&|;", r.args)]


def test_gpu_image_swaps_onnxruntime_for_the_gpu_extra(pyproject: dict) -> None:
    """Dockerfile.gpu installs the serving set, then replaces the CPU onnxruntime with pyproject's
    `gpu` extra at the same pins (never both in one install: they are the same package)."""
    commands = _venv_commands(parse_dockerfile(REPO / "Dockerfile.gpu"))
    serving = commands.index("pip install .")
    removal = commands.index("pip uninstall -y onnxruntime")
    extra = [c for c in commands if c.startswith("pip install ") and "onnxruntime-gpu" in c]
    assert len(extra) == 1, extra
    pins = sorted(shlex.split(extra[0])[2:])
    assert pins == sorted(pyproject["project"]["optional-dependencies"]["gpu"])
    assert serving < removal < commands.index(extra[0])
    assert not any("onnxruntime" in d for d in pyproject["project"]["optional-dependencies"]["dev"])


def test_cpu_image_has_no_gpu_packages() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "onnxruntime-gpu" not in text
    assert "nvidia-ml-py" not in text


# -- building here (make image / make image-gpu) ------------------------------------------------
def _build_script_args() -> set[str]:
    """The base-image build arguments scripts/image_build.sh passes (the locally made base)."""
    text = (REPO / "scripts" / "image_build.sh").read_text()
    return set(re.findall(r'--build-arg "(\w+_IMAGE)=\$base"', text))


def test_base_images_are_build_arguments(dockerfile: Dockerfile) -> None:
    """Every base is an ARG with a public default, and `make image` can replace each one with the
    local base: a FROM that names an image directly could not be built without a registry."""
    raw_froms = [
        line.split()[1]
        for _, line in _logical_lines(dockerfile.path.read_text())
        if line.upper().startswith("FROM ")
    ]
    passed = _build_script_args()
    stage_names = set(dockerfile.stage_names())
    for ref in raw_froms:
        if ref in stage_names:
            continue
        m = re.fullmatch(r"\$\{(\w+)\}", ref)
        assert m, f"{dockerfile.path.name}: FROM {ref} is not a build argument"
        assert m[1] in dockerfile.global_args, f"{dockerfile.path.name}: ARG {m[1]} has no default"
        assert m[1] in passed, f"scripts/image_build.sh does not pass {m[1]}"


def test_build_stage_trims_the_virtualenv(dockerfile: Dockerfile, dockerignore: DockerIgnore) -> None:
    commands = _venv_commands(dockerfile)
    trim = "sh scripts/image_trim.sh /opt/venv"
    assert trim in commands, f"{dockerfile.path.name}: the virtualenv is copied untrimmed"
    assert commands.index(trim) > commands.index("pip install ."), "trimmed before the install"
    assert not dockerignore.excluded("scripts/image_trim.sh")


def test_package_index_settings_come_from_the_builder(dockerfile: Dockerfile) -> None:
    """The machine-specific pip settings are build arguments without defaults: no index host, wheel
    directory or certificate path of a build machine is written into the repository."""
    build = next(s for s in dockerfile.stages if any("pip install ." in r.args for r in s.all("RUN")))
    declared = {a.args for a in build.all("ARG")}
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        assert name in declared, f"{dockerfile.path.name}: ARG {name} (no default) is not declared"
    text = dockerfile.path.read_text()
    assert not re.search(r"file://|/opt/(pypi|wheels)", text)
    urls = set(re.findall(r"https?://[^\s\"']+", text))
    assert urls <= {"https://download.pytorch.org/whl/cpu", "https://download.pytorch.org/whl/cu128"}, urls
