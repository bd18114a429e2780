"""The container image (Dockerfile) where no image can be built: its static properties, and its install steps.

CI machines reach no container registry, so the CUDA base image cannot be pulled (deploy/docker/buildah-smoke.sh
builds the whole Dockerfile on a Debian stand-in base, by hand: minutes and gigabytes). The Dockerfile installs Baton
by running deploy/docker/install.sh, and the test below runs that same script on the same build context (the
repository less .dockerignore) into a fresh venv, then smoke-tests the `baton` it installed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = ROOT / "deploy" / "docker" / "install.sh"
PINS = ROOT / "deploy" / "requirements" / "pins.env"
CHART = ROOT / "deploy" / "helm" / "baton"
# A requirement with a version written out, e.g. triton==3.9.0.
PIN = re.compile(r"\b(torch|nixl[\w-]*|triton)\s*[=<>~!]=\s*\d")
PIN_NAMES = ["TORCH_CPU", "TORCH_GPU", "NIXL_CORE", "NIXL_FRONT", "TRITON_CPU"]


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def pins() -> dict[str, str]:
    out = {}
    for line in PINS.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def install_step() -> tuple[str, str, str]:
    """The Dockerfile's (venv, source dir, torch build) arguments to deploy/docker/install.sh."""
    runs = [args for word, args in instructions() if word == "RUN" and "install.sh" in args]
    assert len(runs) == 1, runs
    m = re.search(r"\bbash (\S+)/deploy/docker/install\.sh (\S+) (\S+) (\S+)$", runs[0])
    assert m, runs[0]
    assert m.group(1) == m.group(3), "install.sh runs from the source it installs"
    return m.group(2), m.group(3), m.group(4)


def test_base_image_is_cuda_runtime_named_without_a_registry_host():
    (arg,) = [args for word, args in instructions() if word == "ARG" and args.startswith("BASE_IMAGE=")]
    image = arg.partition("=")[2]
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", image), image
    froms = [args for word, args in instructions() if word == "FROM"]
    assert froms[0].startswith("${BASE_IMAGE}"), froms


def test_image_runs_baton_as_the_charts_non_root_user():
    final = final_stage()
    users = [args for word, args in final if word == "USER"]
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"] == values["securityContext"]["runAsUser"]
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    assert [json.loads(args) for word, args in final if word == "ENTRYPOINT"] == [["baton"]]
    assert [json.loads(args) for word, args in final if word == "CMD"] == [["--help"]]
    # The chart's pods start `python -m baton.<role>.server`: the venv's python must come first on PATH.
    venv, _, _ = install_step()
    env = " ".join(args for word, args in final if word == "ENV")
    assert f"PATH={venv}/bin:$PATH" in env, env
    assert f"COPY --from=build {venv} {venv}" in [f"{w} {a}" for w, a in final]


def test_image_installs_serving_dependencies_with_the_makefiles_pins():
    venv, src, build = install_step()
    assert build == "cuda"
    assert f"COPY . {src}" in [f"{w} {a}" for w, a in instructions()]
    code = [line for path in (DOCKERFILE, INSTALL) for line in path.read_text().splitlines()
            if not line.lstrip().startswith("#")]
    assert not [line for line in code if "[dev]" in line], "the image takes the serving dependencies only"
    assert not [line for line in code if PIN.search(line)], "pins live in deploy/requirements/pins.env"
    assert sorted(pins()) == sorted(PIN_NAMES)
    script = INSTALL.read_text()
    for name in PIN_NAMES:
        assert f"${name}" in script, name
    # The Makefile reads the same file and spells no pin of its own.
    makefile = (ROOT / "Makefile").read_text()
    assert "include $(PINS)" in makefile and "PINS := deploy/requirements/pins.env" in makefile
    assert not PIN.search(makefile), "a pin written in the Makefile"
    for name in PIN_NAMES:
        assert f"$({name})" in makefile, name
    if shutil.which("make"):
        probe = "pins:; @printf '%s\\n' " + " ".join(f"'$({n})'" for n in PIN_NAMES)
        made = subprocess.run(["make", "-s", "-C", str(ROOT), f"--eval={probe}", "pins"],
                              capture_output=True, text=True, check=True).stdout.split()
        assert made == [pins()[n] for n in PIN_NAMES]


def test_chart_default_image_is_this_images_name_and_version():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["repository"] == "baton-serve"
    assert values["image"]["tag"] == "", "the tag defaults to the chart's appVersion"
    assert values["image"]["python"] == "python"
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version


def test_build_scripts_parse():
    for script in sorted((ROOT / "deploy" / "docker").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) for each .dockerignore line: `**/` is any depth (or none), `*` and `?` stay in one folder."""
    out = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        rx = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pattern[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pattern[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pattern[i]), i + 1
        out.append((negated, re.compile(rx)))
    return out


def build_context(dest: Path) -> int:
    """Copies the repository less .dockerignore (Docker's rules: the last matching line wins, and an excluded
    folder takes everything under it) to dest; returns the bytes copied."""
    patterns = dockerignore_patterns()

    def ignored(rel: str) -> bool:
        verdict = False
        for negated, rx in patterns:
            if rx.fullmatch(rel):
                verdict = not negated
        return verdict

    size = 0
    for folder, dirs, files in os.walk(ROOT):
        rel_dir = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirs[:] = [d for d in dirs if not ignored(prefix + d)]
        for name in files:
            if ignored(prefix + name):
                continue
            target = dest / prefix / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(folder) / name, target, follow_symlinks=False)
            size += target.stat().st_size
    return size


def test_dockerignore_keeps_the_package_and_drops_environments_and_models(tmp_path):
    size = build_context(tmp_path)
    kept = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    for needed in ["pyproject.toml", "README.md", "deploy/docker/install.sh", "deploy/requirements/pins.env",
                   "engine/__init__.py", "cli/main.py"]:
        assert needed in kept, needed
    for dropped in [".venv", ".git", "models", "benchmarks", "deploy/grafana/node_modules"]:
        assert dropped not in kept, dropped
    assert not [p for p in kept if "__pycache__" in p or p.endswith(".safetensors")]
    assert size < 20 * 2**20, f"build context of {size} bytes"


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied afterwards: pytest keeps the last runs' folders, and the venv is gigabytes."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_install_script_builds_a_venv_whose_baton_serves_a_tiny_model(scratch):
    """deploy/docker/install.sh as the Dockerfile runs it, less the CUDA build of torch: CPU machines install the
    CPU wheel of the same pins (`make venv`'s choice there), so that the rest of the steps run unchanged."""
    tmp_path = scratch
    _, src, _ = install_step()
    context = tmp_path / src.strip("/")
    build_context(context)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHON"] = getattr(sys, "_base_executable", sys.executable)
    # pip's byte-compiling of every installed file is the image's start-up concern; this venv runs a few commands.
    env["PIP_NO_COMPILE"] = "1"
    proc = subprocess.run(["bash", str(context / "deploy/docker/install.sh"), str(venv), str(context), "cpu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    def baton(*args: str) -> str:
        done = subprocess.run([str(venv / "bin" / "baton"), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout

    # Installed as a wheel into the venv, not linked to this checkout.
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import baton.cli, nixl._api, triton, torch; print(baton.cli.__file__, torch.__version__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(venv)), where
    assert where[1].split("+")[0] == pins()["TORCH_CPU"].split("==")[1]
    frozen = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=True).stdout
    for pin in ("NIXL_CORE", "NIXL_FRONT", "TRITON_CPU"):
        assert pins()[pin] in frozen.splitlines(), pin
    assert not re.search(r"^(pytest|ruff|transformers)==", frozen, re.M), "dev dependencies in the serving venv"

    usage = baton("--help")
    assert "make-model" in usage and "generate" in usage
    baton("make-model", str(tmp_path / "tiny"), "--preset", "tiny", "--seed", "0")
    out = json.loads(baton("generate", "--model", str(tmp_path / "tiny"), "--prompt-ids", "1 2 3",
                           "--max-tokens", "4", "--ignore-eos", "--json"))
    assert out["prompt_ids"] == [1, 2, 3] and len(out["token_ids"]) == 4

