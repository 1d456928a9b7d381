"""docker-compose.yml checked without a Docker engine (none runs here).

- the compose-spec schema, through `check-jsonschema --builtin-schema vendor.compose-spec` (a dev dependency);
- cross-checks against the code: depends_on targets, RSD_* variables = config fields (and valid values),
  `python -m X` / `python -c` commands, gRPC healthchecks, ports on 127.0.0.1, GPU device ids, model paths;
- the `ray` profile: a Ray head and the verifier pool's driver (deploy/ray_pool.py, RSD_POOL_* and
  RSD_VERIFIER_* variables) in place of the verifier;
- the process launcher (rsd_tools/launcher.py, `rsd cluster --tiny`) starts the same topology with the
  same settings as the compose `cpu` profile.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.ray_pool import PoolConfig, parse_args
from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from rsd_service.serving import load_config
from rsd_tools import cluster as cluster_mod
from rsd_tools import launcher
from rsd_tools.provision import MODELS
from verifier_service.config import VerifierConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
MODEL_CACHE = "/home/rsd/.cache/rsd/models"  # ~/.cache/rsd/models of the image's user (deploy/Dockerfile)
# The module each service container runs -> (config dataclass, service name in RSD_<SERVICE>_<FIELD>, gRPC service).
SERVICES = {
    "verifier_service": (VerifierConfig, "verifier", "rsd.v1.Verifier"),
    "drafter_service": (DrafterConfig, "drafter", "rsd.v1.Drafter"),
    "gateway": (GatewayConfig, "gateway", "rsd.v1.Gateway"),
}
POOL = "deploy.ray_pool"  # the Ray pool's driver: PoolConfig (RSD_POOL_*) + VerifierConfig (RSD_VERIFIER_*)
RAY_HEAD = "ray.scripts.scripts"  # `ray start --head`, as python -m (the image's entrypoint is python)
PROFILES = ("gpu", "cpu", "ray")
# RSD_* variables read outside the service configs (rsd_tools.provision.default_cache_dir).
OTHER_RSD_VARS = {"RSD_MODEL_CACHE"}
# Fields compose sets that the launcher leaves at their default: container networking only.
CONTAINER_NETWORKING = {"host", "advertise_address"}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value):
    """${VAR:-default} -> default, as compose does with VAR unset; a variable without default fails."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, str):

        def default(match: re.Match) -> str:
            assert match.group(2) is not None, f"${{{match.group(1)}}} needs a default in {COMPOSE.name}"
            return match.group(2)

        return _VAR.sub(default, value)
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _module(service: dict) -> str | None:
    """X of a `-m X` command (the image's entrypoint is the venv's python)."""
    command = service.get("command") or []
    return command[command.index("-m") + 1] if "-m" in command else None


def _profiles(service: dict) -> set[str]:
    return set(service.get("profiles") or [])


def _profile_services(services: dict, profile: str) -> dict[str, dict]:
    """What `docker compose --profile PROFILE up` starts: the services without profiles and the profile's."""
    return {name: s for name, s in services.items() if not _profiles(s) or profile in _profiles(s)}


def _long_running(services: dict) -> dict[str, dict]:
    return {name: s for name, s in services.items() if s.get("restart") != "no"}


def _fields(service: dict, name: str = "") -> dict[str, str]:
    """{config field: value} of the RSD_<SERVICE>_<FIELD> variables of a service container (the pool's
    driver: name "pool" or "verifier")."""
    name = name or SERVICES[_module(service)][1]
    prefix = f"RSD_{name.upper()}_"
    return {k[len(prefix) :].lower(): v for k, v in _env(service).items() if k.startswith(prefix)}


def _by_module(services: dict, profile: str) -> dict[str, dict[str, str]]:
    """{service module: its config fields} of one profile's service containers."""
    return {_module(s): _fields(s) for s in _profile_services(services, profile).values() if _module(s) in SERVICES}


def _check_imports(code: str) -> None:
    """Every `from X import a, b` / `import X` in a `python -c` snippet resolves."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


# ----------------------------------------------------------------------------------------------- schema


def test_compose_file_matches_the_compose_spec():
    exe = Path(sys.executable).parent / "check-jsonschema"
    if not exe.exists():
        found = shutil.which("check-jsonschema")
        if found is None:
            pytest.skip("check-jsonschema is not installed (it is in the dev extra: run scripts/bootstrap.sh)")
        exe = Path(found)
    result = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------- cross-checks


def test_depends_on_targets_exist_and_start_with_their_dependents(services):
    for name, service in services.items():
        for target in service.get("depends_on") or {}:
            assert target in services, f"{name} depends on {target}, which is not a service"
            # A dependency in another profile would be missing when the dependent's profile runs.
            target_profiles = _profiles(services[target])
            assert not target_profiles or _profiles(service) <= target_profiles, f"{name} -> {target}: profiles"


def test_profiles_are_gpu_cpu_and_ray_and_redis_is_shared(services):
    assert {p for s in services.values() for p in _profiles(s)} == set(PROFILES)
    assert not _profiles(services["redis"])
    for profile in ("gpu", "cpu"):
        modules = [_module(s) for s in _long_running(_profile_services(services, profile)).values()]
        assert sorted(filter(None, modules)) == sorted(SERVICES), profile
    # ray: the pool's driver and the Ray head instead of the verifier
    modules = [_module(s) for s in _long_running(_profile_services(services, "ray")).values()]
    assert sorted(filter(None, modules)) == sorted({*SERVICES, POOL, RAY_HEAD} - {"verifier_service"})


def test_every_rsd_variable_is_a_config_field_with_a_valid_value(services):
    for name, service in services.items():
        env = _env(service)
        module = _module(service)
        if module in SERVICES:
            cls, svc, _ = SERVICES[module]
            known = {f"RSD_{svc.upper()}_{f.name.upper()}" for f in dataclasses.fields(cls)} | OTHER_RSD_VARS
            config = load_config(cls, svc, [], env=env)  # parses every value and runs __post_init__ checks
            assert config.port > 0, f"{name}: a container needs a fixed port"
        elif module == POOL:
            known = {
                f"RSD_{svc.upper()}_{f.name.upper()}"
                for svc, cls in (("pool", PoolConfig), ("verifier", VerifierConfig))
                for f in dataclasses.fields(cls)
            }
            parse_args([], env=env)  # both configs, checked
        else:
            known = OTHER_RSD_VARS
        for key in env:
            assert key.startswith("RSD_"), f"{name}: {key} is not read by rsd (set generic ones in deploy/Dockerfile)"
            assert key in known, f"{name}: {key} is not a config field of {module or 'this job'}"


def test_commands_name_real_entry_points(services):
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("rsd:"):
            continue
        command = service.get("command")
        assert command and command[0] in ("-m", "-c"), f"{name}: the entrypoint is python; command starts -m or -c"
        if command[0] == "-c":
            _check_imports(command[1])
            continue
        module = command[1]
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{name}: no module {module}"
        if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"
        else:
            assert '__name__ == "__main__"' in Path(spec.origin).read_text(), f"{name}: {module} is not runnable"


def test_healthchecks_use_grpc_health_on_the_service_port(services):
    for name, service in services.items():
        module = _module(service)
        if module not in SERVICES:
            continue
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1].endswith("python") and test[2] == "-c", name
        _check_imports(test[3])
        call = re.search(r"wait_healthy\('([^']+)', '([^']+)'", test[3])
        assert call is not None, f"{name}: healthcheck does not call wait_healthy(address, service)"
        assert call.group(1) == f"127.0.0.1:{_fields(service)['port']}", name
        assert call.group(2) == SERVICES[module][2], name
        if module != "gateway":
            server = importlib.import_module(f"{module}.server")
            assert call.group(2) == server.SERVICE_NAME


def test_ports_are_unique_bound_to_loopback_and_the_service_port(services):
    seen: dict[int, str] = {}
    for name, service in services.items():
        for port in service.get("ports") or []:
            assert isinstance(port, str), f"{name}: write ports as '127.0.0.1:HOST:CONTAINER'"
            host_ip, host_port, container_port = port.split(":")
            assert host_ip == "127.0.0.1", f"{name}: {port} is not bound to 127.0.0.1"
            assert int(host_port) not in seen, f"{name} and {seen.get(int(host_port))} both publish {host_port}"
            seen[int(host_port)] = name
            ports = {_fields(service)["port"], _fields(service).get("http_port")}  # gateway: gRPC and HTTP
            assert container_port in ports, f"{name}: {port} is not the service's port"
    assert seen, "the gateway must be published"


def test_addresses_name_services_of_the_same_profile(services):
    for name, service in services.items():
        if _module(service) not in SERVICES:
            continue
        fields = _fields(service)
        redis_host = re.fullmatch(r"redis://([^:/]+):\d+/\d+", fields["redis_url"]).group(1)
        assert redis_host in services and redis_host in service["depends_on"], name
        if "advertise_address" in fields:
            assert fields["advertise_address"] == f"{name}:{fields['port']}", f"{name}: advertises another host"
            assert fields["host"] == "0.0.0.0", f"{name}: must listen beyond the container's loopback"
    # each profile's services share one Redis database (sessions + registry), distinct between profiles
    urls = {p: {f["redis_url"] for f in _by_module(services, p).values()} for p in PROFILES}
    pool = services["verifier-pool"]
    urls["ray"].add(_fields(pool, "verifier")["redis_url"])
    assert all(len(u) == 1 for u in urls.values()) and len(set.union(*urls.values())) == len(PROFILES), urls
    # the pool's driver reaches the head through Ray Client, on the head's client server port
    client = re.fullmatch(r"ray://([^:/]+):(\d+)", _fields(pool, "pool")["ray_address"])
    assert client.group(1) == "ray-head" and client.group(1) in pool["depends_on"]
    assert f"--ray-client-server-port={client.group(2)}" in services["ray-head"]["command"]


def test_gpu_services_reserve_distinct_devices(services):
    reserved: dict[str, dict[str, list[str]]] = {"gpu": {}, "ray": {}}
    for name, service in services.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if not devices:
            if _module(service) in ("verifier_service", "drafter_service"):
                assert _fields(service)["device"] == "cpu", f"{name}: no GPU reserved but device is not cpu"
            continue
        (profile,) = _profiles(service) & {"gpu", "ray"}
        ids = [i for d in devices for i in d["device_ids"]]
        assert len(ids) == 1 and all("gpu" in d["capabilities"] for d in devices), name
        if _module(service) == RAY_HEAD:  # the replicas run there; the pool's driver names their device
            fields = _fields(services["verifier-pool"], "verifier")
            assert float(_fields(services["verifier-pool"], "pool")["num_gpus_per_replica"]) == 1
        else:
            fields = _fields(service)
        assert fields["device"] == "cuda:0", f"{name}: the container (or a replica) sees one GPU, as cuda:0"
        reserved[profile][_module(service)] = ids
    assert set(reserved["gpu"]) == {"verifier_service", "drafter_service"}
    assert set(reserved["ray"]) == {RAY_HEAD, "drafter_service"}
    for devices in reserved.values():
        first, second = devices.values()
        assert not set(first) & set(second), devices


def test_model_paths_are_in_the_model_volume(compose, services):
    assert "models" in compose["volumes"]
    for name, service in services.items():
        if str(service.get("image", "")).startswith("rsd:"):
            assert f"models:{MODEL_CACHE}" in service["volumes"], f"{name}: no model volume at {MODEL_CACHE}"
    gpu = _by_module(services, "gpu")
    assert gpu["verifier_service"]["model"] == f"{MODEL_CACHE}/{MODELS['target'].name}"
    assert gpu["drafter_service"]["model"] == f"{MODEL_CACHE}/{MODELS['draft'].name}"
    assert gpu["gateway"]["tokenizer"] == gpu["verifier_service"]["model"]
    assert services["models"]["command"] == ["-m", "rsd_tools.provision"]  # into default_cache_dir()
    ray = _by_module(services, "ray")
    pool = _fields(services["verifier-pool"], "verifier")
    assert pool["model"] == gpu["verifier_service"]["model"] == ray["gateway"]["tokenizer"]
    assert ray["drafter_service"]["model"] == gpu["drafter_service"]["model"]
    # the replicas load the model where they run: the Ray head has the volume too
    assert f"models:{MODEL_CACHE}" in services["ray-head"]["volumes"]


def test_gpu_and_cpu_profiles_set_the_same_fields(services):
    gpu, cpu = _by_module(services, "gpu"), _by_module(services, "cpu")
    for module in SERVICES:
        # CPU placement and the int8 drafter (CPU kernels only): the cpu profile's alone
        assert set(gpu[module]) == set(cpu[module]) - {"threads", "cores", "quantize"}, module


def test_cpu_models_job_builds_the_pair_the_cpu_services_load(services, tmp_path, monkeypatch, capsys):
    """Run the models-cpu one-shot `python -c` code as it is (in this process), into a temporary cache."""
    command = services["models-cpu"]["command"]
    assert command[0] == "-c"
    monkeypatch.setenv("RSD_MODEL_CACHE", str(tmp_path))
    exec(compile(command[1], "models-cpu", "exec"), {})
    out = capsys.readouterr()
    draft, target = (Path(p) for p in out.out.split())
    cpu = _by_module(services, "cpu")
    rel = {role: "/".join(path.relative_to(tmp_path).parts) for role, path in (("draft", draft), ("target", target))}
    assert cpu["drafter_service"]["model"] == f"{MODEL_CACHE}/{rel['draft']}"
    assert cpu["verifier_service"]["model"] == f"{MODEL_CACHE}/{rel['target']}"
    assert cpu["gateway"]["tokenizer"] == f"{MODEL_CACHE}/{rel['target']}"


# ----------------------------------------------------------------------------------------------- the launcher


class _FakePopen:
    returncode = 0

    def poll(self) -> int:
        return 0


def _launch(monkeypatch, tmp_path, flags: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """The processes `rsd cluster --tiny [flags]` starts (with redis-server present), recorded instead of run;
    its model cache is tmp_path/models."""
    spawned: list[tuple[str, list[str]]] = []

    def spawn(self, name, cmd, env, address=""):
        spawned.append((name.removesuffix("-0"), list(cmd)))  # one of each: verifier-0 is compose's verifier
        process = launcher.Process(name, _FakePopen(), self.run_dir / f"{name}.log", address)
        self.processes.append(process)
        return process

    async def ready(process, timeout_s):
        return None

    monkeypatch.setattr(launcher.Cluster, "spawn", spawn)
    monkeypatch.setattr(cluster_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(launcher, "redis_pings", lambda url: True)
    monkeypatch.setattr(launcher, "wait_ready", ready)
    argv = ["--tiny", "--cache-dir", str(tmp_path / "models"), "--run-dir", str(tmp_path), *flags]
    args = cluster_mod.build_parser().parse_args(argv)  # builds the tiny pair into tmp_path/models
    cluster_mod.start_cluster(args).stop()
    return spawned


def _flags(argv: list[str]) -> dict[str, str]:
    """--some-flag value ... -> {"some_flag": value}."""
    parser = argparse.ArgumentParser()
    names = [a for a in argv if a.startswith("--")]
    for flag in names:
        parser.add_argument(flag)
    return vars(parser.parse_args(argv))


def test_launcher_starts_the_cpu_profile_topology(services, monkeypatch, tmp_path):
    spawned = dict(_launch(monkeypatch, tmp_path))
    cpu = _long_running(_profile_services(services, "cpu"))
    assert set(spawned) == {name.removesuffix("-cpu") for name in cpu}
    assert Path(spawned["redis"][0]).name == "redis-server" and cpu["redis"]["command"][0] == "redis-server"
    for name, service in cpu.items():
        if name == "redis":
            continue
        argv = spawned[name.removesuffix("-cpu")]
        module = argv[argv.index("-m") + 1]
        assert module == _module(service), name
        cls = SERVICES[module][0]
        launcher, composed = _flags(argv[argv.index("-m") + 2 :]), _fields(service)
        assert set(launcher) <= set(composed), f"{name}: the launcher sets {set(launcher) - set(composed)}"
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for field in set(composed) - set(launcher) - CONTAINER_NETWORKING:
            assert composed[field] == str(defaults[field]), f"{name}: compose sets {field} to a non-default"
        for field in ("verifier_id", "drafter_id", "threads"):
            if field in launcher:
                assert launcher[field] == composed[field], f"{name}: {field}"
        for field in ("model", "tokenizer"):  # the same folder of the model cache
            if field in launcher:
                rel = "/".join(Path(launcher[field]).relative_to(tmp_path / "models").parts)
                assert composed[field] == f"{MODEL_CACHE}/{rel}", f"{name}: {field}"


def test_launcher_puts_each_service_on_its_cores(services, monkeypatch, tmp_path):
    """`rsd cluster --verifier-cores 1 --drafter-cores 0 --gateway-cores 0`: each command line carries its
    --cores (the RSD_<SERVICE>_CORES of the compose cpu profile), which the service's config accepts."""
    flags = ("--verifier-cores", "1", "--drafter-cores", "0", "--gateway-cores", "0")
    spawned = dict(_launch(monkeypatch, tmp_path, flags))
    cpu = _by_module(services, "cpu")
    for name, cores in (("verifier", "1"), ("drafter", "0"), ("gateway", "0")):
        argv = spawned[name]
        module = argv[argv.index("-m") + 1]
        cls, service, _ = SERVICES[module]
        assert "cores" in cpu[module], f"compose's {service} takes no RSD_{service.upper()}_CORES"
        assert load_config(cls, service, argv[argv.index("-m") + 2 :], env={}).cores == cores, name
