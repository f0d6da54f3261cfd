"""docker-compose.yml, Dockerfile and .dockerignore, checked statically (no Docker engine needed).

The compose file is parsed and interpolated the way Compose does it, then every command a
project service runs is parsed by the real command line it names: `tokenmill ...` through the
click group in `ops.cli` (Flower too: `tokenmill flower`, its password in the environment),
`celery -A app ...` through Celery's own click group (with the app that `-A app` finds).
Nothing is executed.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"

# what a user must provide (.env); everything else has a default in the file
TEST_ENV = {"FLOWER_PASSWORD": "test-only-password", "SGLANG_API_KEY": "test-only-key"}
TOP_LEVEL_KEYS = {"name", "services", "volumes", "networks", "configs", "secrets", "include"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
PROJECT_EXECUTABLES = {"tokenmill", "celery", "python"}
CELERY_SUBCOMMANDS = {"worker", "beat"}
SHARED_ENV_ANCHOR = "x-tokenmill-env"
MIN_WORKER_GRACE_S = 60.0


# --- Compose-style interpolation --------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_]\w*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.DOTALL)


class InterpolationError(ValueError):
    """A required variable (`${NAME:?message}`) is missing, or an expression is malformed."""


def interpolate_text(text: str, env: dict[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("plain"):
            return env.get(match.group("plain"), "")
        expr = _BRACED.fullmatch(match.group("braced"))
        if expr is None:
            raise InterpolationError(f"invalid interpolation {match.group(0)!r}")
        name, op, arg = expr.group("name"), expr.group("op") or "", expr.group("arg") or ""
        value = env.get(name)
        missing = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if missing else str(value)
        if op.endswith("?"):
            if missing:
                raise InterpolationError(f"{name}: {arg}")
            return str(value)
        if op.endswith("+"):
            return "" if missing else arg
        return value or ""

    return _VARIABLE.sub(substitute, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate_text(node, env)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


# --- the loaded files --------------------------------------------------------------------------


@functools.cache
def raw_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml must be a mapping"
    return data


@functools.cache
def compose() -> dict[str, Any]:
    data = interpolate(raw_compose(), TEST_ENV)
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    found = compose()["services"]
    assert isinstance(found, dict) and found, "no services"
    return found


def project_services() -> dict[str, dict[str, Any]]:
    """The services built from this repository's Dockerfile."""
    return {name: svc for name, svc in services().items() if "build" in svc}


def is_one_shot(service: dict[str, Any]) -> bool:
    return service.get("restart") == "no"


def argv(service: dict[str, Any]) -> list[str]:
    """What the container runs: entrypoint + command (exec form only for project services)."""
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key)
        if value is None:
            continue
        assert isinstance(value, list), f"{key} must be a list (exec form), not {value!r}"
        parts.extend(str(item) for item in value)
    return parts


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    kind, *rest = test
    if kind == "CMD-SHELL":
        assert len(rest) == 1, "CMD-SHELL takes one shell string"
        return shlex.split(rest[0])
    assert kind == "CMD", f"healthcheck test must start with CMD or CMD-SHELL, not {kind!r}"
    return [str(item) for item in rest]


def command_cases(executable: str) -> list[Any]:
    return [
        pytest.param(name, argv(svc), id=name)
        for name, svc in project_services().items()
        if argv(svc) and argv(svc)[0] == executable
    ]


def duration_s(text: str) -> float:
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"bad duration {text!r}"
    return sum(float(amount) * units[unit] for amount, unit in parts)


def option_value(args: list[str], option: str) -> str:
    for i, arg in enumerate(args):
        if arg == option:
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{option} not in {args}")


def service_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment must be a mapping (to share it with an anchor)"
    return {str(k): str(v) for k, v in env.items()}


# --- click plumbing ------------------------------------------------------------------------


def _rest_of(ctx: click.Context) -> list[str]:
    """Arguments a group left for its subcommand after parsing its own options."""
    protected = getattr(ctx, "_protected_args", None)
    if protected is None:
        protected = ctx.protected_args
    return [*protected, *ctx.args]


def parse_click(
    group: click.Group,
    prog: str,
    args: list[str],
    on_group: Callable[[click.Context], None] | None = None,
) -> tuple[list[str], click.Command, click.Context]:
    """Parse ARGS as the shell would hand them to GROUP, without invoking any command.

    Returns the command path, the leaf command and its context. Unknown commands or options,
    bad values and missing required parameters raise click.UsageError.
    """
    path = [prog]
    command: click.Command = group
    parent: click.Context | None = None
    name = prog
    while True:
        ctx = command.make_context(name, list(args), parent=parent, resilient_parsing=False)
        if not isinstance(command, click.Group):
            return path, command, ctx
        if on_group is not None and parent is None:
            on_group(ctx)
        rest = _rest_of(ctx)
        if not rest:
            raise click.UsageError(f"{' '.join(path)}: missing command", ctx=ctx)
        sub_name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None
        path.append(sub_name)
        command, parent, name = sub, ctx, sub_name


def used_options(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("-") and arg != "-"]


# --- the file itself -------------------------------------------------------------------------


def test_compose_file_is_a_compose_spec_file() -> None:
    data = raw_compose()
    assert "version" not in data, "the compose spec has no `version:` key"
    unknown = {k for k in data if k not in TOP_LEVEL_KEYS and not k.startswith("x-")}
    assert not unknown, f"unknown top-level keys {unknown}"
    assert isinstance(data.get("services"), dict) and data["services"]
    for name, service in services().items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"


def test_interpolation_matches_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate_text("$$HOME ${SET} $SET", env) == "$HOME x x"
    assert interpolate_text("${EMPTY:-d} ${EMPTY-d} ${UNSET-d}", env) == "d  d"
    assert interpolate_text("${SET:+alt} ${EMPTY:+alt}|", env) == "alt |"
    with pytest.raises(InterpolationError, match="UNSET: needed"):
        interpolate_text("${UNSET:?needed}", env)


def test_flower_cannot_start_without_a_password() -> None:
    with pytest.raises(InterpolationError, match="FLOWER_PASSWORD"):
        interpolate(raw_compose(), {"SGLANG_API_KEY": "k"})
    assert interpolate(raw_compose(), {"FLOWER_PASSWORD": "p", "SGLANG_API_KEY": "k"})


def test_the_server_cannot_start_without_an_api_key_and_workers_send_it() -> None:
    with pytest.raises(InterpolationError, match="SGLANG_API_KEY"):
        interpolate(raw_compose(), {"FLOWER_PASSWORD": "p"})
    emulator = services()["emulator"]
    assert option_value(argv(emulator), "--host") == "0.0.0.0"
    key = service_environment(emulator)["TOKENMILL_EMULATOR_API_KEY"]
    assert key == TEST_ENV["SGLANG_API_KEY"]
    assert "--api-key" not in argv(emulator), "a key on the command line shows in ps"
    assert service_environment(services()["worker"])["TOKENMILL_SGLANG_API_KEY"] == key


def test_every_service_has_a_healthcheck_or_is_a_one_shot_job() -> None:
    for name, service in services().items():
        if is_one_shot(service):
            continue
        assert service.get("restart") in {"always", "unless-stopped", "on-failure"}, (
            f"{name}: long-running services restart (restart: unless-stopped)"
        )
        check = service.get("healthcheck")
        assert check and not check.get("disable"), f"{name}: no healthcheck and not one-shot"
        argv_ = healthcheck_argv(service)
        assert argv_ and argv_[0] != "NONE", f"{name}: empty healthcheck"
        for key in ("interval", "timeout", "start_period"):
            if key in check:
                duration_s(str(check[key]))


def test_every_dependency_exists_with_a_valid_condition() -> None:
    all_services = services()
    for name, service in all_services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: use the long depends_on form with conditions"
        for target, spec in depends.items():
            assert target in all_services, f"{name} depends on unknown service {target}"
            assert target != name
            condition = spec.get("condition")
            assert condition in CONDITIONS, f"{name} -> {target}: bad condition {condition!r}"
            dependency = all_services[target]
            if condition == "service_healthy":
                assert "healthcheck" in dependency, f"{name} waits for {target} to be healthy"
            if condition == "service_completed_successfully":
                assert is_one_shot(dependency), f"{name} waits for {target} to exit"
            if not service.get("profiles"):
                assert not dependency.get("profiles"), f"{name} needs profiled {target}"


def test_dependencies_have_no_cycle() -> None:
    graph = {name: set(svc.get("depends_on", {})) for name, svc in services().items()}
    done: set[str] = set()

    def visit(node: str, stack: tuple[str, ...]) -> None:
        assert node not in stack, f"dependency cycle {' -> '.join((*stack, node))}"
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, (*stack, node))
        done.add(node)

    for node in sorted(graph):
        visit(node, ())


def test_project_services_run_one_image_built_from_the_dockerfile() -> None:
    built = project_services()
    assert {"migrate", "emulator", "worker", "beat", "flower"} <= set(built)
    images = {svc.get("image") for svc in built.values()}
    assert len(images) == 1 and None not in images, f"one image name for all: {images}"
    (image,) = images
    for name, service in built.items():
        build = service["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert (ROOT / context).resolve() == ROOT, f"{name}: build context must be the repo"
        assert (ROOT / context / dockerfile).resolve() == DOCKERFILE
        assert argv(service) or DOCKERFILE.exists(), f"{name}: runs the image's CMD"
        if argv(service):
            assert argv(service)[0] in PROJECT_EXECUTABLES, f"{name}: runs {argv(service)[0]}"
    for name, service in services().items():
        if name in built:
            continue
        assert service.get("image") != image, f"{name} uses the project image without build"
        ref = service["image"]
        tag = ref.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"{name}: pin the image {ref!r} to a tag"


def test_project_services_share_the_tokenmill_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.core.settings import Settings
    from emulator.cli import emulator as emulator_command

    shared = {str(k): str(v) for k, v in compose()[SHARED_ENV_ANCHOR].items()}
    assert {"TOKENMILL_DATABASE_URL", "TOKENMILL_BROKER_URL", "TOKENMILL_STORAGE_URL"} <= set(
        shared
    )
    assert urlsplit(shared["TOKENMILL_BROKER_URL"]).hostname in services()
    assert urlsplit(shared["TOKENMILL_DATABASE_URL"]).hostname in services()
    assert urlsplit(shared["AWS_ENDPOINT_URL"]).hostname in services()
    fields = set(Settings.model_fields)
    # the emulator's flags are also TOKENMILL_EMULATOR_* variables (click envvars)
    emulator_envvars = {p.envvar for p in emulator_command.params}
    for name, service in project_services().items():
        env = service_environment(service)
        missing = {k: v for k, v in shared.items() if env.get(k) != v}
        assert not missing, f"{name} does not carry the shared environment: {missing}"
        for key in env:
            if key.startswith("TOKENMILL_EMULATOR_"):
                assert key in emulator_envvars, f"{name}: {key} is not an emulator flag"
            elif key.startswith("TOKENMILL_"):
                field = key.removeprefix("TOKENMILL_").lower()
                assert field in fields, f"{name}: {key} is not a tokenmill setting"
        for key in [k for k in os.environ if k.startswith("TOKENMILL_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = Settings()  # validates every value the way the container will read it
        assert not settings.embedded, f"{name} would fall back to the embedded SQLite ledger"


# --- tokenmill commands ------------------------------------------------------------------------


def test_the_tokenmill_console_script_is_the_click_group() -> None:
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts["tokenmill"] == "ops.cli:main"


@pytest.mark.parametrize(("service", "args"), command_cases("tokenmill"))
def test_tokenmill_commands_are_real_commands_and_options(service: str, args: list[str]) -> None:
    from ops.cli import cli

    assert isinstance(cli, click.Group)
    try:
        path, command, ctx = parse_click(cli, "tokenmill", args[1:])
    except click.exceptions.Exit as exc:  # an eager --help/--version: valid, exits 0
        assert exc.exit_code == 0
        return
    except click.UsageError as exc:
        pytest.fail(f"{service}: `{shlex.join(args)}` does not parse: {exc.format_message()}")
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for option in used_options(args[len(path) :]):
        assert option in known, f"{service}: {' '.join(path)} has no option {option}"
    ctx.close()


def test_expected_tokenmill_services_exist() -> None:
    runs = {name: argv(svc)[:3] for name, svc in project_services().items()}
    assert runs["migrate"] == ["tokenmill", "db", "upgrade"]
    assert runs["emulator"][:2] == ["tokenmill", "emulator"]
    emulator = argv(services()["emulator"])
    assert option_value(emulator, "--host") == "0.0.0.0"


# --- celery commands -------------------------------------------------------------------------


def celery_app_of(args: list[str]) -> Any:
    from celery import Celery
    from celery.app.utils import find_app

    app_name = option_value(args, "-A") if "-A" in args else option_value(args, "--app")
    assert app_name == "app", "project processes find the Celery app with `-A app`"
    found = find_app(app_name)
    assert isinstance(found, Celery), f"-A {app_name} resolves to {found!r}, not a Celery app"
    return found


def parse_celery(args: list[str]) -> tuple[list[str], click.Command, click.Context]:
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery as celery_group

    app = celery_app_of(args)

    def attach_app(ctx: click.Context) -> None:  # what the group callback would do
        ctx.obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)

    return parse_click(celery_group, "celery", args[1:], on_group=attach_app)


def subprocess_env(service: dict[str, Any]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(service_environment(service))
    return env


@functools.cache
def celery_help_options(subcommand: str, service_name: str) -> frozenset[str]:
    """Options listed by `python -m celery -A app SUBCOMMAND --help`, in the service's env."""
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", subcommand, "--help"],
        cwd=ROOT,
        env=subprocess_env(services()[service_name]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"celery -A app {subcommand} --help: {result.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", result.stdout))


@pytest.mark.parametrize(("service", "args"), command_cases("celery"))
def test_celery_commands_are_real_commands_and_options(service: str, args: list[str]) -> None:
    assert args[1:3] == ["-A", "app"], f"{service}: start with `celery -A app`"
    subcommand = args[3]
    assert subcommand in CELERY_SUBCOMMANDS, f"{service}: celery {subcommand}"
    try:
        path, _, ctx = parse_celery(args)
    except click.UsageError as exc:
        pytest.fail(f"{service}: `{shlex.join(args)}` does not parse: {exc.format_message()}")
    assert path == ["celery", subcommand]
    documented = celery_help_options(subcommand, service)
    for option in used_options(args[4:]):
        assert option in documented, f"{service}: celery {subcommand} has no option {option}"
    ctx.close()


def test_flower_takes_its_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenmill flower` beyond loopback, the credentials in TOKENMILL_FLOWER_*: what it
    would run carries them in the environment only, and runs ops.flower_app (which puts
    /metrics behind them)."""
    from app.core.settings import Settings
    from ops.flower_cmd import flower_launch

    flower = services()["flower"]
    args = argv(flower)
    assert args[:2] == ["tokenmill", "flower"]
    assert not any(TEST_ENV["FLOWER_PASSWORD"] in arg for arg in args)
    env = service_environment(flower)
    assert env["TOKENMILL_FLOWER_PASSWORD"] == TEST_ENV["FLOWER_PASSWORD"]
    for key in [k for k in os.environ if k.startswith("TOKENMILL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = flower_launch(Settings(), option_value(args, "--host"), 5555)
    assert launch.argv[1:3] == ["-m", "ops.flower_app"]
    assert launch.env == {"FLOWER_BASIC_AUTH": f"admin:{TEST_ENV['FLOWER_PASSWORD']}"}
    assert not any(TEST_ENV["FLOWER_PASSWORD"] in arg for arg in launch.argv)


def test_the_emulator_renders_with_the_mounted_tokenizer() -> None:
    """One tokenizer folder, at one path, where the emulator renders, the worker templates
    later turns and the CLI enqueues (the run pins the path)."""
    emulator = argv(services()["emulator"])
    folder = option_value(emulator, "--tokenizer")
    for name in ("emulator", "worker", "cli"):
        mounts = [str(v).split(":") for v in services()[name].get("volumes", [])]
        assert [folder, "ro"] in [m[1:] for m in mounts], f"{name} does not mount {folder}"
    (source,) = {m[0] for n in ("emulator", "worker", "cli") for m in _mounts(n, folder)}
    assert source == "./tokenizer"  # TOKENIZER_DIR's default
    trust = service_environment(services()["emulator"])["TOKENMILL_EMULATOR_TRUST_REMOTE_CODE"]
    assert trust == "false"  # TOKENIZER_TRUST_REMOTE_CODE's default


def _mounts(service: str, target: str) -> list[list[str]]:
    mounts = [str(v).split(":") for v in services()[service].get("volumes", [])]
    return [m for m in mounts if m[1] == target]


def test_worker_is_bound_to_the_emulator_and_drains_on_stop() -> None:
    worker = services()["worker"]
    args = argv(worker)
    assert args[3] == "worker" and ("-E" in args or "--task-events" in args)
    env = service_environment(worker)
    url = urlsplit(env["TOKENMILL_SGLANG_URL"])
    assert url.hostname in services(), f"{url.hostname} is not a service"
    server_args = argv(services()[str(url.hostname)])
    assert str(url.port) == option_value(server_args, "--port")
    assert env.get("TOKENMILL_SERVER_NAME")
    assert duration_s(str(worker["stop_grace_period"])) >= MIN_WORKER_GRACE_S
    for dependency in ("redis", "postgres", "migrate", "emulator"):
        assert dependency in worker["depends_on"], f"worker must wait for {dependency}"


def test_worker_sizes_its_window_by_its_server_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's default (`auto`) is what the compose worker runs; a fixed window is opt-in."""
    from app.core.settings import Settings

    for key in [k for k in os.environ if k.startswith("TOKENMILL_")]:
        monkeypatch.delenv(key)
    for key, value in service_environment(services()["worker"]).items():
        monkeypatch.setenv(key, value)
    assert Settings().inflight == "auto" == Settings.model_fields["inflight"].default
    fixed = interpolate(raw_compose(), {**TEST_ENV, "TOKENMILL_INFLIGHT": "64"})
    assert service_environment(fixed["services"]["worker"])["TOKENMILL_INFLIGHT"] == "64"


# --- healthchecks that run project code ----------------------------------------------------------


def healthcheck_cases() -> Iterator[Any]:
    for name, service in project_services().items():
        if "healthcheck" in service:
            yield pytest.param(name, healthcheck_argv(service), id=name)


@pytest.mark.parametrize(("service", "args"), list(healthcheck_cases()))
def test_project_healthchecks_run_real_commands(service: str, args: list[str]) -> None:
    svc = services()[service]
    if args[0] == "python":
        assert args[1] == "-c", f"{service}: python healthchecks are `python -c CODE`"
        code = args[2]
        ast.parse(code)
        ports = re.findall(r"http://127\.0\.0\.1:(\d+)/", code)
        assert ports, f"{service}: the healthcheck should probe this container"
        own = argv(svc)
        port = option_value(own, "--port")
        assert set(ports) == {port}, f"{service} listens on {port}, probed {ports}"
    elif args[0] == "celery":
        path, _, ctx = parse_celery([a.replace("$HOSTNAME", "host") for a in args])
        assert path == ["celery", "inspect"] and ctx.params["command"] == "ping"
        destination = option_value(args, "--destination")
        own = argv(svc)
        node = option_value(own, "--hostname") if "--hostname" in own else None
        # a worker's default name is <server>@<node> (workers/engine/identity.py)
        server = svc.get("environment", {}).get("TOKENMILL_SERVER_NAME")
        expected = {"worker": f"{server}@%h", "beat": "celerybeat@%h"}[own[3]]
        assert destination == (node or expected).replace("%h", "$HOSTNAME")
        ctx.close()
    else:
        pytest.fail(f"{service}: healthcheck runs {args[0]}, not python or celery")


# --- infrastructure services --------------------------------------------------------------


def test_redis_is_durable_and_never_evicts() -> None:
    command = " ".join(services()["redis"]["command"])
    assert "--appendonly yes" in command
    assert "--maxmemory-policy noeviction" in command


def test_stateful_services_keep_data_in_declared_volumes() -> None:
    declared = set(compose().get("volumes") or {})
    mounts = {"redis": "/data", "postgres": "/var/lib/postgresql/data", "minio": "/data"}
    for name, target in mounts.items():
        volumes = [str(v) for v in services()[name].get("volumes", [])]
        assert any(v.split(":")[1] == target for v in volumes), f"{name}: no volume at {target}"
    for name, service in services().items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} not declared"


def test_postgres_matches_the_database_url() -> None:
    env = service_environment(services()["postgres"])
    url = urlsplit(compose()[SHARED_ENV_ANCHOR]["TOKENMILL_DATABASE_URL"])
    assert url.username == env["POSTGRES_USER"] == "tokenmill"
    assert url.password == env["POSTGRES_PASSWORD"]
    assert url.path == "/" + env["POSTGRES_DB"]


def test_the_bucket_is_created_by_a_one_shot_job() -> None:
    bucket = urlsplit(compose()[SHARED_ENV_ANCHOR]["TOKENMILL_STORAGE_URL"]).netloc
    init = services()["minio-init"]
    assert is_one_shot(init)
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    script = " ".join(argv(init))
    assert "mb --ignore-existing" in script
    assert service_environment(init)["BUCKET"] == bucket


def test_published_ports_are_loopback_only() -> None:
    for name, service in services().items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} publicly"


# --- Dockerfile and .dockerignore -------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line.rstrip("/") for line in lines if line and not line.startswith("#")]


def is_dockerignored(relative: str, patterns: list[str]) -> bool:
    """Whether Docker leaves RELATIVE out of the build context: it, or a parent, matches.

    Close to Docker's rules (last match wins, `!` re-includes, `**/` matches at any depth);
    fnmatch's `*` also crosses `/`, so this errs towards "ignored", the safe side for a test.
    """
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        alternatives = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(p, alt) for p in prefixes for alt in alternatives):
            ignored = not negate
    return ignored


def test_dockerignore_matcher() -> None:
    patterns = ["**/__pycache__", ".git", "*.egg-info", "tests"]
    assert is_dockerignored("app/x/__pycache__/m.pyc", patterns)
    assert is_dockerignored(".git/HEAD", patterns)
    assert is_dockerignored("tokenmill.egg-info", patterns)
    assert not is_dockerignored("app/tests.py", patterns)
    assert not is_dockerignored("app/core/settings.py", patterns)
    assert not is_dockerignored(".github/x", patterns)
    assert not is_dockerignored("tests/x", [*patterns, "!tests"])


def test_dockerfile_builds_the_project_for_a_non_root_user() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(rest for keyword, rest in steps if keyword == "RUN")
    assert re.search(r"pip install \S*/tmp/tokenmill\b", runs), "install the project"
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "run as a non-root user"
    workdirs = [rest for keyword, rest in steps if keyword == "WORKDIR"]
    assert workdirs and workdirs[-1] == "/srv"
    cmd = [rest for keyword, rest in steps if keyword == "CMD"]
    assert cmd and ast.literal_eval(cmd[-1]) == ["tokenmill", "--help"]


def image_uid_gid() -> tuple[int, int]:
    """The uid and gid the Dockerfile's USER runs as (its useradd / groupadd)."""
    runs = " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "RUN")
    uid = re.search(r"useradd [^&]*--uid (\d+)", runs)
    gid = re.search(r"groupadd [^&]*--gid (\d+)", runs)
    assert uid and gid, "the Dockerfile makes its user with a fixed uid and gid"
    return int(uid.group(1)), int(gid.group(1))


def test_data_init_makes_the_cli_data_folder_writable_by_the_image_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """./data is bind-mounted where the CLI writes; a one-shot job that runs as root gives it
    to the image's group (setgid, group-writable) before the CLI starts, leaving its owner."""
    init, cli_service = services()["data-init"], services()["cli"]
    assert init.get("user") == "0:0" and is_one_shot(init)
    assert cli_service["depends_on"]["data-init"]["condition"] == "service_completed_successfully"
    (mount,) = [v for v in cli_service["volumes"] if str(v).startswith("./data:")]
    assert mount in init["volumes"]
    target = str(mount).split(":")[1]
    args = argv(init)
    assert args[:2] == ["python", "-c"] and target in args[2]
    folder = tmp_path / "data"
    folder.mkdir(mode=0o700)
    chowned: list[tuple[str, int, int]] = []
    monkeypatch.setattr(os, "chown", lambda path, uid, gid: chowned.append((path, uid, gid)))
    exec(args[2].replace(target, str(folder)), {})
    _, gid = image_uid_gid()
    assert chowned == [(str(folder), -1, gid)]
    mode = folder.stat().st_mode
    assert mode & 0o2070 == 0o2070, oct(mode)  # setgid, group rwx


def test_no_hugging_face_cache_is_mounted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers load from local folders only (a hub id is refused, nothing downloaded), so no
    service needs a Hugging Face cache volume."""
    from app.core.errors import TokenizerError
    from app.prompts.tokenization import load_tokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(TokenizerError, match=r"'moonshotai/Kimi-K2\.5' does not exist"):
        load_tokenizer("moonshotai/Kimi-K2.5")
    assert "hf-cache" not in (compose().get("volumes") or {})
    for name, service in services().items():
        for volume in service.get("volumes", []):
            assert "huggingface" not in str(volume), f"{name} mounts {volume}"


def test_dockerfile_copies_everything_the_package_needs() -> None:
    project = tomllib.loads(PYPROJECT.read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed |= {pattern.rstrip("*").rstrip(".") for pattern in includes}
    patterns = dockerignore_patterns()
    copied: set[str] = set()
    for keyword, rest in dockerfile_instructions():
        if keyword != "COPY":
            continue
        sources = [s for s in shlex.split(rest)[:-1] if not s.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not is_dockerignored(source, patterns), f"COPY {source} is .dockerignored"
            copied.add(source.rstrip("/"))
    assert needed <= copied, f"not copied into the image: {needed - copied}"


def test_dockerignore_keeps_state_and_caches_out() -> None:
    patterns = dockerignore_patterns()
    for path in (
        ".git/HEAD",
        ".tokenmill/ledger.sqlite3",
        "app/__pycache__/x.pyc",
        ".mypy_cache/x",
        ".ruff_cache/x",
        ".pytest_cache/x",
        ".venv/bin/python",
    ):
        assert is_dockerignored(path, patterns), f"{path} would be sent to the build"


def test_flower_is_a_core_dependency() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert any(req.replace(" ", "").startswith("flower>=2") for req in project["dependencies"])
